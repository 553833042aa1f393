"""`python -m jaxkv demo`: a small decoder served through jaxkv, with and without prefix reuse.

Requests share a long system prompt. The reference decoder (`jaxkv.models`, random weights)
serves them with its cache in a jaxkv pool: slots from a `PagedAllocator`, context read
through a `ReqToTokenPool`, prefill and decode jitted with the pool donated. The same requests
are served twice in this process, both paths timed:

* without reuse: the engine's prefix cache is off and there is no store, so every prompt is
  prefilled in full;
* with reuse (the engine as it comes, with a store): the first prompt is computed, its pages
  join the engine's `RadixCache` after its prefill and its blocks are offloaded with
  `KVConnector.store_async`; later requests find the shared prefix on the device (device
  hits: read in place), and load from the store only what the device no longer holds (store
  hits), then prefill the rest (misses).

A first, untimed pass (another namespace, in memory) compiles the shapes the reuse pass uses
and warms the connector; the pass without reuse can compile more (its later prompts prefilled
in full, together), and every compilation is taken out of the times, so neither timed pass
pays for it. Then every output is checked:
equal across the two passes, equal to a reference forward that recomputes each whole sequence
without a cache (token for token, logits within a bound), the pool updated in place, decode
traced once per shape. The exit status is 1 if any check fails.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.connector import BlockStore, DiskStore, HostStore
from jaxkv.models import (
    LOGIT_BOUNDS,
    ByteTokenizer,
    Decoder,
    DecoderConfig,
    Engine,
    Request,
    bucket,
    steps_for,
)

DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
# The verification bound on |logit difference| against the uncached reference, per --dtype.
BOUNDS = {name: LOGIT_BOUNDS[jnp.dtype(dt)] for name, dt in DTYPES.items()}

SYSTEM_PROMPT = (
    "You are the on-call assistant of a JAX serving cluster; answer in one sentence.\n"
    "Runbook: 1. Replicas keep their KV cache in a jaxkv pool, page size 16. 2. Prompts that "
    "start with this text reuse its cached blocks. 3. Slow decode: check batch size, then "
    "context length. 4. A full pool rejects new requests. 5. Disk stores survive restarts. "
    "6. A block failing its checksum is never loaded.\n"
)
QUESTIONS = (
    "Why is decode slower today?",
    "Can a restarted replica reuse yesterday's prompts?",
    "What happens when the pool is full?",
    "Which page size do we use?",
    "Is it safe to load a block that failed its checksum?",
    "Where does the KV cache live?",
    "How do I check the store's hit rate, and what should it be here?",
    "Hi",
)


class Progress:
    """A one-line progress bar on stderr, shown only when stderr is a terminal."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream = max(total, 1), 0, stream
        self.enabled = stream.isatty()
        self.label = ""

    def phase(self, label: str) -> None:
        self.label = label
        self.advance(0)

    def advance(self, n: int) -> None:
        self.done = min(self.total, self.done + n)
        if self.enabled:
            filled = 30 * self.done // self.total
            bar = "#" * filled + "." * (30 - filled)
            self.stream.write(f"\r[{bar}] {100 * self.done // self.total:3d}% {self.label:<28}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 70 + "\r")
            self.stream.flush()


@dataclasses.dataclass
class Pass:
    """One timed serving pass."""

    name: str
    results: list
    stats: dict
    connector: dict | None
    in_place: bool


def _requests(tok: ByteTokenizer, n: int, new_tokens: int) -> list[Request]:
    """`n` prompts sharing the system prompt; the first arrives alone, the rest one step later
    (so the first's prompt is cached, and offloaded, before they look it up)."""
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            q = f"{q} (asked again, #{i})"
        prompt = tok.encode(SYSTEM_PROMPT + "User: " + q + "\nAssistant:")
        out.append(Request(prompt, new_tokens, arrival=0 if i == 0 else 1))
    return out


def _pointers(pool) -> list[int]:
    return [leaf.unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(pool)]


def _serve(
    name, model, params, requests, engine_kw, store, progress, namespace=None, prefix_cache=True
) -> Pass:
    engine = Engine(
        model, params, store=store, namespace=namespace, prefix_cache=prefix_cache, **engine_kw
    )
    before = _pointers(engine.pool)
    progress.phase(name)
    results = engine.generate(requests, on_token=progress.advance)
    in_place = _pointers(engine.pool) == before
    conn = engine.connector.stats() if engine.connector is not None else None
    engine.close()
    return Pass(name, results, dict(engine.stats), conn, in_place)


def _verify(model, params, requests, passes, dtype_name, progress):
    """Checks both passes against each other and against the uncached reference."""
    ref = jax.jit(model.reference_logits, static_argnums=2)
    dtype = DTYPES[dtype_name]
    worst, tokens_ok = 0.0, True
    for req, *res in zip(requests, *(p.results for p in passes)):
        a = res[0]
        tokens_ok &= all(np.array_equal(a.tokens, r.tokens) for r in res[1:])
        seq = np.concatenate([req.prompt, a.tokens[:-1]]).astype(np.int32)
        padded = np.zeros(bucket(len(seq)), np.int32)
        padded[: len(seq)] = seq
        logits = np.asarray(ref(params, padded, dtype))[len(req.prompt) - 1 : len(seq)]
        for r in res:
            tokens_ok &= np.array_equal(np.argmax(logits, -1), r.tokens)
            worst = max(worst, float(np.abs(logits - r.logits).max()))
        progress.advance(1)
    return tokens_ok, worst


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n else "0"


def _table(passes: list[Pass], n_requests: int) -> list[tuple[str, str, str]]:
    rows = []

    def row(label, fn):
        rows.append((label, *(fn(p) for p in passes)))

    row("requests", lambda p: str(len(p.results)))
    row("prompt tokens", lambda p: str(p.stats["prompt_tokens"]))
    row("generated tokens", lambda p: str(sum(len(r.tokens) for r in p.results)))
    row(
        "prefix hit rate (prompt tokens)",
        lambda p: f"{100 * (1 - p.stats['prefill_tokens'] / p.stats['prompt_tokens']):.0f}%",
    )
    row(
        "requests with a prefix hit",
        lambda p: f"{sum(r.device_tokens + r.reused_tokens > 0 for r in p.results)}/{n_requests}",
    )
    row("device hits (prompt tokens)", lambda p: str(p.stats["device_tokens"]))
    row("store hits (prompt tokens)", lambda p: str(p.stats["reused_tokens"]))
    row("misses (prompt tokens prefilled)", lambda p: str(p.stats["prefill_tokens"]))
    row("bytes offloaded", lambda p: _fmt_bytes(p.connector["bytes_stored"] if p.connector else 0))
    row("bytes loaded", lambda p: _fmt_bytes(p.connector["bytes_loaded"] if p.connector else 0))
    row(
        "time to first token, mean (ms)",
        lambda p: f"{1e3 * np.mean([r.ttft_s for r in p.results]):.1f}",
    )
    row(
        "time to first token, 2nd+ requests (ms)",
        lambda p: f"{1e3 * np.mean([r.ttft_s for r in p.results[1:]] or [0]):.1f}",
    )
    row(
        "decode tokens/s",
        lambda p: f"{p.stats['decode_tokens'] / max(p.stats['decode_seconds'], 1e-9):.0f}",
    )
    return rows


def run(
    attention: str = "gqa",
    store: str = "host",
    requests: int = 8,
    new_tokens: int = 32,
    dtype: str = "bf16",
    cache_dir: str | None = None,
    config: DecoderConfig | None = None,
) -> int:
    """Runs the demo; returns 0 when every check passes, else 1.

    `config` replaces the decoder's sizes (its `attention` is set from `attention`); tests use
    it to run the same program on a smaller model.
    """
    wall = time.perf_counter()
    if requests < 1 or new_tokens < 1:
        raise ValueError(
            f"requests, new_tokens: expected >= 1, got requests={requests}, new_tokens={new_tokens}"
        )
    cfg = dataclasses.replace(config or DecoderConfig(), attention=attention)
    model, tok = Decoder(cfg), ByteTokenizer()
    params = model.init_params()
    reqs = _requests(tok, requests, new_tokens)
    page = 16
    budget = max(len(r.prompt) for r in reqs) + new_tokens
    max_batch = min(8, requests)
    engine_kw = dict(
        pool_size=max_batch * (bucket(budget) + 2 * page),
        page_size=page,
        dtype=DTYPES[dtype],
        max_batch=max_batch,
        max_context=bucket(budget),
        eos_id=tok.eos_id,
    )
    if attention == "gqa":
        arch = (
            f"grouped-query attention, {cfg.n_heads} query / {cfg.n_kv_heads} KV heads of "
            f"{cfg.head_dim}, MHAPool"
        )
    else:
        arch = (
            f"latent attention, {cfg.n_heads} heads, latent {cfg.kv_lora_rank} + rope "
            f"{cfg.qk_rope_head_dim}, MLAPool"
        )
    prefix = len(tok.encode(SYSTEM_PROMPT))
    print(
        f"jaxkv demo on {jax.devices()[0].platform}: decoder of {cfg.n_layers} layers, "
        f"d_model {cfg.d_model}, {arch}, {dtype} pool, page size {page}, {store} store\n"
        f"{requests} requests sharing a {prefix}-token system prompt, up to {new_tokens} new "
        "tokens each (greedy; random weights, so the text is noise)\n"
    )
    tmp = None
    if store == "disk":
        if cache_dir is None:
            tmp = cache_dir = tempfile.mkdtemp(prefix="jaxkv-demo-")
        backing: BlockStore = DiskStore(cache_dir)
    else:
        backing = HostStore(1 << 30)
    progress = Progress(3 * requests * (new_tokens + 1) + requests)
    try:
        warm = _serve(
            "compiling (untimed pass)", model, params, reqs, engine_kw, HostStore(1 << 30),
            progress, namespace="jaxkv-demo-warmup",
        )  # fmt: skip
        compiles = steps_for(model)
        decode_traces_after_warmup = compiles.traces["decode"]
        plain = _serve(
            "serving without reuse", model, params, reqs, engine_kw, None, progress,
            prefix_cache=False,
        )  # fmt: skip
        reuse = _serve("serving with reuse", model, params, reqs, engine_kw, backing, progress)
        progress.phase("checking against reference")
        tokens_ok, worst = _verify(model, params, reqs, [plain, reuse], dtype, progress)
    finally:
        progress.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    del warm
    passes = [plain, reuse]
    rows = _table(passes, requests)
    width = max(len(r[0]) for r in rows) + 2
    print(f"{'':<{width}}{'no reuse':>12}{'reuse':>12}")
    for label, *vals in rows:
        print(f"{label:<{width}}" + "".join(f"{v:>12}" for v in vals))
    bound = BOUNDS[dtype]
    retraced = compiles.traces["decode"] - decode_traces_after_warmup
    checks = {
        "outputs equal with and without reuse, and to the uncached reference": tokens_ok,
        f"logits within {bound:g} of the reference (max |diff| {worst:.2g})": worst <= bound,
        "pool buffers updated in place (pointers unchanged)": all(p.in_place for p in passes),
        f"decode not retraced in the timed passes ({retraced} new traces)": retraced == 0,
    }
    ok = all(checks.values())
    print(f"\nverification: {'OK' if ok else 'FAILED'}")
    for name, good in checks.items():
        print(f"  [{'ok' if good else 'FAIL'}] {name}")
    print(
        f"\nTimes exclude XLA compilation ({len(compiles)} shapes, "
        f"{compiles.compile_seconds:.1f} s); "
        f"wall time {time.perf_counter() - wall:.1f} s."
    )
    return 0 if ok else 1
