"""Pool updates: jaxkv's eager and jitted writes against numpy, memcpy, naive JAX and, on an
accelerator, the device's own floors."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxkv import KOnlyPool, MHAPool, MLAPool
from jaxkv.bench._harness import burst, interleaved
from jaxkv.bench._report import print_table, scaled
from jaxkv.bench._section import Section, Setting
from jaxkv.bench._sizes import HEAD_DIM, HEADS, Sizes, label
from jaxkv.bench._targets import Measured, ratio

# The contenders' times, in seconds per call, as the rows hold them.
CONTENDERS = (
    "jaxkv eager",
    "jaxkv jit",
    "jaxkv jit raw bits",
    "numpy in-place",
    "naive JAX",
    "memcpy",
    "plain donated .at[].set",
    "jaxkv jit over buffer lists",
    "device copy",
)


def _np_dtype(dtype) -> np.dtype:
    return {
        jnp.dtype(jnp.bfloat16): np.dtype(ml_dtypes.bfloat16),
        jnp.dtype(jnp.float8_e4m3fn): np.dtype(ml_dtypes.float8_e4m3fn),
    }[jnp.dtype(dtype)]


def _pool_maker(kind: str):
    """A factory of one-layer pools of `kind` and the row shapes of the values they take."""
    head_rows = [(HEADS, HEAD_DIM)]
    if kind == "mha":
        return functools.partial(MHAPool.create, head_num=HEADS, head_dim=HEAD_DIM), head_rows * 2
    if kind == "mla":
        return functools.partial(MLAPool.create, kv_lora_rank=512, qk_rope_head_dim=64), [(1, 576)]
    return functools.partial(KOnlyPool.create, head_num=HEADS, head_dim=HEAD_DIM), head_rows


def update_cases(kind, dtype, size, t, *, naive, numpy_base, accel, rng):
    """Contenders writing `t` tokens into one layer of a `size`-token pool.

    On CPU the floors are numpy's in-place assignment and memcpy of the written bytes; on an
    accelerator they are a device-to-device copy of the same bytes (read once, written once,
    as the update does) and the plain donated `.at[loc].set` on logical-dtype buffers.

    Naive JAX (`naive`) allocates its copy of the pool at its first call, so that it can run
    after the other contenders' buffers are freed (see `measure`).

    Returns:
        `(cases, reps, nbytes)`: the cases to time, the calls each case makes per timing (its
        time is divided by that), and the bytes written per call.
    """
    maker, rows = _pool_maker(kind)
    make = functools.partial(maker, size=size, layer_num=1, dtype=dtype)
    pool = make()
    loc_np = (rng.permutation(size)[:t] + 1).astype(np.int32)
    loc = jnp.asarray(loc_np)
    vals_np = [rng.standard_normal((t, *r)).astype(_np_dtype(dtype)) for r in rows]
    vals = [jnp.asarray(v) for v in vals_np]
    nbytes = sum(v.nbytes for v in vals_np)

    def put(p, loc, *v):
        return p.set_kv(0, loc, v[0], v[1]) if kind == "mha" else p.set_k(0, loc, v[0])

    step = jax.jit(put, donate_argnums=0)
    state = {"pool": pool}  # the jaxkv contenders thread one pool: it is donated each call
    # The same step fed raw bits (uint16/uint8, the store dtype): no bitcast pass on XLA:CPU.
    bits = [jnp.asarray(v.view(pool.store_dtype)) for v in vals_np]

    def threaded(fn, *args):
        def call():
            state["pool"] = fn(state["pool"], loc, *args)
            return state["pool"]

        return call

    calls = {
        "jaxkv eager": threaded(put, *vals),
        "jaxkv jit": threaded(step, *vals),
        "jaxkv jit raw bits": threaded(step, *bits),
    }
    if naive:
        calls["naive JAX"] = _naive(size, rows, dtype, loc, vals)
    if accel:
        calls.update(_accelerator_floors(pool, make, put, size, rows, dtype, loc, vals, vals_np))
        # Calls are issued back to back and waited for once per burst: a wait costs a host
        # round trip, more than a small update's device time, and a serving loop does not
        # wait between steps. Bursts of a few ms keep rows of identical work comparable.
        reps = 64 if t <= 4096 else 8
        return {name: burst(fn, reps) for name, fn in calls.items()}, reps, nbytes
    cases = {name: burst(fn, 1) for name, fn in calls.items()}  # CPU calls are synchronous
    if numpy_base:
        bufs = [np.zeros((size + 1, *r), _np_dtype(dtype)) for r in rows]

        def numpy_set():
            for b, v in zip(bufs, vals_np):
                b[loc_np] = v

        cases["numpy in-place"] = numpy_set
    src = [np.ascontiguousarray(v.view(np.uint8)) for v in vals_np]
    dst = [np.empty_like(s) for s in src]

    def memcpy():
        for d, s in zip(dst, src):
            np.copyto(d, s)

    cases["memcpy"] = memcpy
    return cases, 1, nbytes


def _naive(size, rows, dtype, loc, vals):
    """The obvious functional code: `.at[].set` without donation, copying the pool per call."""
    fn = jax.jit(lambda bufs, loc, vals: [b.at[loc].set(v) for b, v in zip(bufs, vals)])
    held: dict = {}

    def call():
        if not held:
            held["bufs"] = [jnp.zeros((size + 1, *r), dtype) for r in rows]
        return fn(held["bufs"], loc, vals)

    return call


def _accelerator_floors(pool, make, put, size, rows, dtype, loc, vals, vals_np):
    """The plain donated scatter, the same update over buffer lists, and a device copy."""
    plain = {"b": [jnp.zeros((size + 1, *r), dtype) for r in rows]}
    plain_fn = jax.jit(
        lambda bufs, loc, vals: [b.at[loc].set(v, mode="drop") for b, v in zip(bufs, vals)],
        donate_argnums=0,
    )

    def plain_set():
        plain["b"] = plain_fn(plain["b"], loc, vals)
        return plain["b"]

    # The same compiled update over the pool's buffers as a list: what a call costs the host
    # beyond the plain scatter's without the pool pytree (flatten, rebuild).
    names = pool.BUFFERS
    twin = {"b": [getattr(make(), n)[0] for n in names]}

    def put_lists(bufs, loc, *v):
        out = put(pool.with_buffers(**{n: [b] for n, b in zip(names, bufs)}), loc, *v)
        return [getattr(out, n)[0] for n in names]

    lists_fn = jax.jit(put_lists, donate_argnums=0)

    def jitted_lists():
        twin["b"] = lists_fn(twin["b"], loc, *vals)
        return twin["b"]

    # Each value read once and written once. XOR with a constant makes XLA read and write
    # every element (a plain copy may be elided).
    copy_src = [jnp.asarray(v.view(pool.store_dtype)) for v in vals_np]
    flip = jax.jit(lambda xs: [x ^ jnp.ones((), x.dtype) for x in xs])
    return {
        "plain donated .at[].set": plain_set,
        "jaxkv jit over buffer lists": jitted_lists,
        "device copy": lambda: flip(copy_src),
    }


def configs(sizes: Sizes, accel: bool) -> list[tuple[str, Any, int, int]]:
    """The `(kind, dtype, pool tokens, T)` rows of a run.

    CPU: MHA bf16 and fp8 over every pool and T, MLA and K-only on the middle pool at the two
    bigger T; `quick` drops the smallest T, keeps only the middle T on the big pool and fp8
    only on the middle pool. Accelerator: MHA bf16 over every pool and T below the pool's
    size, fp8, MLA and K-only on the middle pool; `quick` drops the middle pool and those
    rows.
    """
    small, mid, big = sizes.accel_pools if accel else sizes.pools
    tokens = sizes.accel_tokens if accel else sizes.tokens
    if accel:
        pools = (small, big) if sizes.quick else (small, mid, big)
        out = [("mha", jnp.bfloat16, size, t) for size in pools for t in tokens if t < size]
        if not sizes.quick:
            out += [("mha", jnp.float8_e4m3fn, mid, t) for t in tokens[1:]]
            out += [(kind, jnp.bfloat16, mid, tokens[2]) for kind in ("mla", "k_only")]
        return out
    out = []
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        for size in (small, mid, big):
            for t in tokens:
                skip = t == tokens[0] or (size == big and t != tokens[1])
                if sizes.quick and (skip or (dtype != jnp.bfloat16 and size != mid)):
                    continue
                out.append(("mha", dtype, size, t))
    return out + [(kind, jnp.bfloat16, mid, t) for kind in ("mla", "k_only") for t in tokens[1:]]


def measure(setting: Setting) -> list[dict]:
    """One row per configuration (`configs`): median seconds per call of every contender."""
    rng = np.random.default_rng(0)
    return [
        _row(kind, dtype, size, t, setting, rng)
        for kind, dtype, size, t in configs(setting.sizes, setting.accel)
    ]


def _row(kind, dtype, size: int, t: int, setting: Setting, rng) -> dict:
    """One configuration's row. Its pools and buffers are freed when it returns, before the
    next row allocates its own."""
    accel, quick = setting.accel, setting.sizes.quick
    huge = size >= 1 << 20 and not accel
    # Naive JAX copies the pool every call: on CPU it runs up to `naive_pool` (see `Sizes`);
    # on an accelerator the largest pool (16 GiB per layer) would need two more copies of it
    # in device memory, so it runs up to 1M tokens.
    naive = kind == "mha" and size <= (1 << 20 if accel else setting.sizes.naive_pool)
    cases, reps, nbytes = update_cases(
        kind, dtype, size, t, naive=naive, numpy_base=not huge, accel=accel, rng=rng
    )
    naive_case = cases.pop("naive JAX", None)
    rounds = 5 if huge else (15 if quick else 40)
    budget = 4.0 if huge else (1.0 if quick else 3.0)
    times = interleaved(cases, rounds=rounds, budget_s=budget)
    if naive_case is not None:
        # Each naive call allocates and frees a whole copy of the pool, and XLA:CPU's release
        # of that memory slows whatever runs next: naive JAX alternates with the floor alone,
        # once the other contenders' pool and buffers are freed (so the pool and its copies
        # are never resident together). A naive call costs 100x to 10,000x a jaxkv call: a
        # few rounds measure it.
        name = "device copy" if accel else "memcpy"
        own = {"naive JAX": naive_case, name: cases[name]}
        del cases
        few = 3 if huge else (2 if quick else rounds)
        times["naive JAX"] = interleaved(own, rounds=few, budget_s=budget)["naive JAX"]
    return {
        "kind": kind,
        "dtype": jnp.dtype(dtype).name,
        "pool_tokens": size,
        "tokens": t,
        "bytes": nbytes,
        **{k: v / reps for k, v in times.items()},
    }


def _by_size(rows: list[dict]) -> dict:
    """The MHA bf16 rows by `(pool tokens, T)`: the rows the targets read."""
    return {
        (r["pool_tokens"], r["tokens"]): r
        for r in rows
        if r["kind"] == "mha" and r["dtype"] == "bfloat16"
    }


def targets(rows: list[dict], setting: Setting) -> list[Measured]:
    by, sizes = _by_size(rows), setting.sizes
    if setting.accel:
        return _accelerator_targets(by, sizes)
    small_pool, mid_pool, big_pool = sizes.pools
    mid_t, big_t = sizes.tokens[1:]
    small, big = by.get((small_pool, mid_t)), by.get((big_pool, mid_t))
    growth = f"time({label(big_pool)} pool) / time({label(small_pool)} pool), T={mid_t}"
    out = [
        Measured(f"update.growth.{mode}", f"jaxkv {mode}: {growth}", ratio(big, k, small, k))
        for mode, k in (("jit", "jaxkv jit"), ("eager", "jaxkv eager"))
    ]
    for key, t in (("update.numpy.mid_t", mid_t), ("update.numpy.big_t", big_t)):
        r = by.get((mid_pool, t))
        value = ratio(r, "jaxkv jit", r, "numpy in-place")
        out.append(Measured(key, f"jaxkv jit / numpy in-place, T={t}", value))
    r = by.get((mid_pool, mid_t))
    value = ratio(r, "jaxkv eager", r, "jaxkv jit")
    return out + [Measured("update.eager", f"jaxkv eager / jaxkv jit, T={mid_t}", value)]


def _accelerator_targets(by: dict, sizes: Sizes) -> list[Measured]:
    """Updates against the device's own floors (see `update_cases`)."""
    small_pool, _, big_pool = sizes.accel_pools
    _, mid_t, big_t = sizes.accel_tokens
    widest = by.get((big_pool, big_t))
    small, big = by.get((small_pool, mid_t)), by.get((big_pool, mid_t))
    plain = [r["jaxkv jit"] / r["plain donated .at[].set"] for r in by.values()]
    growth = f"time({label(big_pool)} pool) / time({label(small_pool)} pool), T={mid_t}"
    copy = f"jaxkv jit rate / device copy rate, T={big_t}, {label(big_pool)}-token pool"
    return [
        Measured("update.accel.copy_rate", copy, ratio(widest, "device copy", widest, "jaxkv jit")),
        Measured(
            "update.accel.plain",
            "jaxkv jit / plain donated .at[].set, worst size",
            max(plain) if plain else None,
        ),
        Measured(
            "update.accel.growth",
            f"jaxkv jit: {growth}",
            ratio(big, "jaxkv jit", small, "jaxkv jit"),
        ),
        Measured(
            "update.accel.eager",
            f"jaxkv eager / jaxkv jit, T={mid_t}",
            ratio(small, "jaxkv eager", small, "jaxkv jit"),
        ),
    ]


def report(rows: list[dict], setting: Setting) -> None:
    table = scaled(rows, CONTENDERS, 1e6)
    for r, us in zip(rows, table):
        us["jit/numpy"] = ratio(r, "jaxkv jit", r, "numpy in-place")
        us["jit/memcpy"] = ratio(r, "jaxkv jit", r, "memcpy")
        us["naive/jit"] = ratio(r, "naive JAX", r, "jaxkv jit")
        us["copy rate"] = ratio(r, "device copy", r, "jaxkv jit")
        us["jit/plain"] = ratio(r, "jaxkv jit", r, "plain donated .at[].set")
        us["eager/jit"] = ratio(r, "jaxkv eager", r, "jaxkv jit")
    cols = [
        ("kind", "kind", ""),
        ("dtype", "dtype", ""),
        ("pool_tokens", "pool tokens", "d"),
        ("tokens", "T", "d"),
        ("jaxkv eager", "eager", ".0f"),
        ("jaxkv jit", "jit", ".0f"),
        ("jaxkv jit raw bits", "jit bits", ".0f"),
    ]
    if setting.accel:
        cols += [
            ("plain donated .at[].set", "plain .at[].set", ".0f"),
            ("jaxkv jit over buffer lists", "jit lists", ".0f"),
            ("naive JAX", "naive JAX", ".0f"),
            ("device copy", "device copy", ".0f"),
            ("copy rate", "jit/copy rate", ".2f"),
            ("jit/plain", "jit/plain", ".2f"),
            ("eager/jit", "eager/jit", ".2f"),
            ("naive/jit", "naive/jit", ".1f"),
        ]
    else:
        cols += [
            ("numpy in-place", "numpy", ".0f"),
            ("naive JAX", "naive JAX", ".0f"),
            ("memcpy", "memcpy", ".0f"),
            ("jit/numpy", "jit/numpy", ".2f"),
            ("jit/memcpy", "jit/memcpy", ".2f"),
            ("naive/jit", "naive/jit", ".1f"),
        ]
    title = f"updates on {setting.backend} (median us per call; one layer, K and V for MHA)"
    print_table(title, table, cols)


SECTION = Section("updates", measure, report, targets)
