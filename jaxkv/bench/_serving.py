"""Serving with the reference decoder: decode steps and time to first token."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.bench._harness import interleaved, ready, ready_call
from jaxkv.bench._report import print_table
from jaxkv.bench._section import Section, Setting
from jaxkv.bench._sizes import Sizes, label
from jaxkv.bench._targets import Measured, ratio
from jaxkv.connector import HostStore

PAGE = 16


def measure(setting: Setting) -> dict:
    """The reference decoder of `jaxkv.models` (GQA, 4 layers, d_model 512, 2 KV heads of 64)
    served from a bf16 `MHAPool` of `decoder_pool` tokens (a serving pool holding many
    requests), page size 16.

    Decode: one request with each of `cached` cached tokens. The jaxkv step (pool donated,
    writes in place, context read through the request-to-token table) runs against the very
    same jitted step with the pool not donated, where each `.at[].set` copies the whole
    buffer (the naive functional cache), and against recomputing the whole sequence without
    a cache (the longer context in full runs only: about a minute on 2 cores). Times are per
    layer (step / layers).

    Time to first token: a `prefix`-token prefix plus `new_tokens` new tokens, served by the
    `Engine` without a store and with the prefix reused from a `HostStore` (stored by an
    earlier request; each round's new tokens are new). Compilation is excluded.
    """
    from jaxkv.models import Decoder, DecoderConfig

    model = Decoder(DecoderConfig())
    params = model.init_params()
    decode = _decode(model, params, setting.sizes)
    return {"decode": decode, "ttft": _ttft(model, params, setting.sizes)}


def _decode(model, params, sizes: Sizes) -> list[dict]:
    from jaxkv import ReqToTokenPool
    from jaxkv.models import bucket

    layers = model.cfg.n_layers
    donated = jax.jit(model.step, donate_argnums=1, static_argnames="ctx")
    naive = jax.jit(model.step, static_argnames="ctx")
    recompute = jax.jit(model.reference_logits)
    state = {"pool": model.create_pool(size=sizes.decoder_pool, page_size=PAGE)}
    rows = []
    for cached in sizes.cached:
        ctx = bucket(cached + 1)
        table = ReqToTokenPool(1, ctx).write(1, 0, np.arange(PAGE, PAGE + cached + 1))
        args = (
            table.req_to_token,
            np.array([1], np.int32),
            np.array([[1]], np.int32),
            np.array([cached], np.int32),
            np.array([1], np.int32),
            np.array([[PAGE + cached]], np.int32),
        )
        seq = jnp.asarray(np.random.default_rng(5).integers(0, 256, cached + 1), jnp.int32)

        def jaxkv_step(args=args, ctx=ctx):
            logits, state["pool"] = donated(params, state["pool"], *args, ctx=ctx)
            ready(logits)

        def naive_step(args=args, ctx=ctx):
            ready(naive(params, state["pool"], *args, ctx=ctx))

        cases = {"jaxkv": jaxkv_step, "naive functional cache": naive_step}
        long = cached > sizes.cached[0]
        if not long:
            cases["recompute without cache"] = functools.partial(ready_call, recompute, params, seq)
        rounds = 3 if sizes.quick else (5 if long else 20)
        med = interleaved(cases, rounds=rounds, budget_s=4.0)
        if long and not sizes.quick:
            # One call takes about a minute on 2 cores: compile it, then time a single run.
            exe = recompute.lower(params, seq).compile()
            t0 = time.perf_counter()
            ready(exe(params, seq))
            med["recompute without cache"] = time.perf_counter() - t0
        rows.append(
            {
                "cached_tokens": cached,
                "pool_tokens": sizes.decoder_pool,
                "context_bucket": ctx,
                **{f"{k} per layer": v / layers for k, v in med.items()},
            }
        )
    return rows


def _ttft(model, params, sizes: Sizes) -> dict:
    from jaxkv.models import Engine, Request, bucket

    rng = np.random.default_rng(6)
    new = sizes.new_tokens
    prefix = rng.integers(0, 256, sizes.prefix).astype(np.int32)
    ctx = bucket(sizes.prefix + new)
    make = functools.partial(
        Engine, model, params, pool_size=2 * ctx, page_size=PAGE, max_batch=1, max_context=ctx
    )
    plain, reuse = make(), make(store=HostStore(64 << 20))  # it holds every round
    times: dict[str, list[float]] = {"no reuse": [], "reuse from HostStore": []}
    loaded = 0
    # Round 0: the reusing engine computes the whole prompt (compiling the full-prompt step
    # both engines use) and offloads its blocks; later rounds' last tokens are new. Round 1
    # compiles what reuse adds (the suffix step, the load's scatter): a compile costs more
    # than the load itself on a GPU, so timing starts at round 2.
    for r in range(2 + (2 if sizes.quick else 5)):
        prompt = np.concatenate([prefix, rng.integers(0, 256, new).astype(np.int32)])
        runs = [("no reuse", plain)] if r else []
        for name, engine in runs + [("reuse from HostStore", reuse)]:
            (res,) = engine.generate([Request(prompt, 1)])
            if r >= 2:
                times[name].append(res.ttft_s)
                loaded = max(loaded, res.reused_tokens)
    reuse.close()
    return {
        "prompt_tokens": sizes.prefix + new,
        "reused_tokens": loaded,
        **{name: float(np.median(ts)) for name, ts in times.items()},
    }


def targets(res: dict, setting: Setting) -> list[Measured]:
    """The decode target is the host's: on an accelerator a copy of the decoder's pool takes
    microseconds, so the naive cache is no floor there (both rows are still printed)."""
    sizes = setting.sizes
    r = next((d for d in res["decode"] if d["cached_tokens"] == sizes.cached[0]), None)
    out = []
    if not setting.accel:
        out.append(
            Measured(
                "serving.decode",
                f"decode step, {label(sizes.cached[0])} cached tokens, "
                f"{label(sizes.decoder_pool)}-token pool: jaxkv / naive functional cache",
                ratio(r, "jaxkv per layer", r, "naive functional cache per layer"),
            )
        )
    t = res["ttft"]
    name = f"time to first token: reused {label(sizes.prefix)} prefix (HostStore) / no reuse"
    return out + [Measured("serving.ttft", name, ratio(t, "reuse from HostStore", t, "no reuse"))]


def report(res: dict, setting: Setting) -> None:
    rows = []
    for r in res["decode"]:
        row = {"cached_tokens": r["cached_tokens"]}
        for key in ("jaxkv", "naive functional cache", "recompute without cache"):
            v = r.get(f"{key} per layer")
            row[key] = None if v is None else v * 1e3
        row["naive/jaxkv"] = ratio(row, "naive functional cache", row, "jaxkv")
        row["recompute/jaxkv"] = ratio(row, "recompute without cache", row, "jaxkv")
        rows.append(row)
    print_table(
        "reference decoder, decode step (ms per layer; GQA 8/2 heads of 64, bf16 pool of "
        f"{label(setting.sizes.decoder_pool)} tokens, batch 1; recompute of the longer context "
        "in full runs only)",
        rows,
        [
            ("cached_tokens", "cached tokens", "d"),
            ("jaxkv", "jaxkv", ".3f"),
            ("naive functional cache", "naive cache", ".3f"),
            ("recompute without cache", "recompute", ".1f"),
            ("naive/jaxkv", "naive/jaxkv", ".1f"),
            ("recompute/jaxkv", "recompute/jaxkv", ".0f"),
        ],
    )
    t = res["ttft"]
    print(
        f"\nreference decoder, time to first token ({t['prompt_tokens']} prompt tokens): "
        f"{t['no reuse'] * 1e3:.0f} ms without reuse, {t['reuse from HostStore'] * 1e3:.0f} ms "
        f"with {t['reused_tokens']} prefix tokens loaded from a HostStore"
    )


SECTION = Section("serving", measure, report, targets)
