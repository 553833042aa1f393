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

    Time to first token: a `prefix`-token prefix plus `new_tokens` new tokens (each round's
    are new), served by the `Engine` with the prefix on the device (in its prefix cache since
    an earlier request), from a `HostStore` (stored by an earlier request, the device's copy
    evicted before each round) and without any reuse; beside them the bare step the device
    hit runs: the compiled prefill of the new tokens over the cached context, with its logits
    read back, and nothing else. Compilation is excluded. The three short cases alternate
    round by round; "no reuse", a whole prefill that leaves the caches cold for the case after
    it, is timed in rounds of its own.
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
    new, cached = sizes.new_tokens, sizes.prefix
    prefix = rng.integers(0, 256, cached).astype(np.int32)
    ctx = bucket(cached + new)
    make = functools.partial(
        Engine, model, params, pool_size=2 * ctx, page_size=PAGE, max_batch=1, max_context=ctx
    )
    plain, device = make(prefix_cache=False), make()
    stored = make(store=HostStore(64 << 20))  # it holds every round
    step = _bare_step(model, params, device, cached, new, ctx)
    tree = stored.tree_cache

    def served(name, engine):
        def run(prompt):
            if engine is stored:  # the device gives the prefix up (written back: no-op)
                tree.evict(tree.evictable_size(), pool=stored.pool)
            (res,) = engine.generate([Request(prompt, 1)])
            hits[name] = (res.device_tokens, res.reused_tokens)
            return res.ttft_s

        return run

    # "no reuse" prefills the whole prompt: tens of times the others' work, which leaves the
    # caches cold for whatever runs next. Interleaved with the short cases it would slow the one
    # after it and skew their ratios, so it is timed in rounds of its own after them; the three
    # short cases alternate, and take more rounds, since each costs little.
    short = {
        "device hit": served("device hit", device),
        "bare step": step,
        "reuse from HostStore": served("reuse from HostStore", stored),
    }
    long = {"no reuse": served("no reuse", plain)}
    times: dict[str, list[float]] = {name: [] for name in (*short, *long)}
    hits: dict[str, tuple[int, int]] = {}
    # Round 0: the reusing engines compute the whole prompt (compiling the full-prompt step
    # every engine uses) and cache or offload its prefix; later rounds' last tokens are new.
    # Round 1 compiles what reuse adds (the suffix step, the load's scatter): a compile costs
    # more than the load itself on a GPU, so timing starts at round 2.
    for cases, timed in ((short, 6 if sizes.quick else 10), (long, 2 if sizes.quick else 5)):
        for r in range(2 + timed):
            prompt = np.concatenate([prefix, rng.integers(0, 256, new).astype(np.int32)])
            for name, run in cases.items():
                if r == 0 and name == "bare step":
                    continue
                took = run(prompt)
                if r >= 2:
                    times[name].append(took)
    stored.close()
    return {
        "prompt_tokens": cached + new,
        "device_tokens": hits["device hit"][0],
        "reused_tokens": hits["reuse from HostStore"][1],
        **{name: float(np.median(ts)) for name, ts in times.items()},
    }


def _bare_step(model, params, engine, cached: int, new: int, ctx: int):
    """The step a device hit of `cached` tokens runs for the `new` ones, alone: the engine's
    compiled step (the same executable: pool, table and token shapes are the engine's) on a
    pool of its own, the context already in the table, the logits read back."""
    from jaxkv import ReqToTokenPool
    from jaxkv.models import bucket

    n = cached + new
    table = ReqToTokenPool(engine.max_batch, ctx).write(1, 0, np.arange(PAGE, PAGE + n))
    tokens = np.zeros((1, bucket(new)), np.int32)
    loc = np.full_like(tokens, -1)
    loc[0, :new] = np.arange(PAGE + cached, PAGE + n)
    state = {"pool": model.create_pool(size=engine.allocator.size, page_size=PAGE)}
    rows, start, n_new = (np.array([v], np.int32) for v in (1, cached, new))

    def run(prompt) -> float:
        tokens[0, :new] = prompt[cached:]
        t0 = time.perf_counter()
        logits, state["pool"] = engine.steps(
            params, state["pool"], table.req_to_token, rows, tokens, start, n_new, loc, ctx=ctx
        )
        np.asarray(logits)
        return time.perf_counter() - t0

    return run


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
    t, prefix = res["ttft"], label(sizes.prefix)
    return out + [
        Measured(
            "serving.ttft",
            f"time to first token: reused {prefix} prefix (HostStore) / no reuse",
            ratio(t, "reuse from HostStore", t, "no reuse"),
        ),
        Measured(
            "serving.ttft.device",
            f"time to first token: {prefix} prefix on the device / the bare step it runs",
            ratio(t, "device hit", t, "bare step"),
        ),
        Measured(
            "serving.ttft.device_store",
            f"time to first token: {prefix} prefix on the device / from a HostStore",
            ratio(t, "device hit", t, "reuse from HostStore"),
        ),
    ]


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
        f"\nreference decoder, time to first token ({t['prompt_tokens']} prompt tokens, ms): "
        f"{t['no reuse'] * 1e3:.1f} without reuse; {t['reuse from HostStore'] * 1e3:.1f} with "
        f"{t['reused_tokens']} prefix tokens loaded from a HostStore; "
        f"{t['device hit'] * 1e3:.1f} with {t['device_tokens']} on the device, whose bare step "
        f"takes {t['bare step'] * 1e3:.1f}"
    )


SECTION = Section("serving", measure, report, targets)
