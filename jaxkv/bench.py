"""`python -m jaxkv bench`: jaxkv against numpy, memcpy and naive JAX, side by side in one run.

Every comparison runs its contenders alternately (one call of each per round) and reports
medians, so a slow moment of the machine hits all of them alike. Sections: pool updates,
connector transfers, a head-sharded pool on 8 devices, block hashing, allocators and
`store_async`. `--json` writes every figure and each performance target with whether it held;
`--plot` draws update time against pool size.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxkv import KOnlyPool, MHAPool, MLAPool, PagedAllocator, __version__
from jaxkv.connector import DiskStore, HostStore, KVConnector

HEADS, HEAD_DIM = 8, 128


@dataclass(frozen=True)
class Sizes:
    """The problem sizes of a run (token counts). The full run and `--quick` use the defaults
    (`--quick` runs fewer of the update configurations, fewer rounds and a quarter-size MLA and
    K-only pool); `TINY` runs every section and every target at toy sizes in seconds, for tests of
    the bench itself: its figures say nothing about performance."""

    pools: tuple[int, int, int] = (1 << 14, 1 << 18, 1 << 20)  # CPU updates: small, mid, big
    tokens: tuple[int, int, int] = (16, 256, 4096)  # CPU updates: T per call
    accel_pools: tuple[int, int, int] = (1 << 14, 1 << 20, 1 << 22)
    accel_tokens: tuple[int, int, int] = (256, 4096, 65536)
    connector_tokens: int = 1024
    hash_tokens: int = 1 << 16
    decoder_pool: int = 1 << 16
    cached: tuple[int, int] = (1 << 10, 1 << 14)  # decode steps: cached tokens, short and long
    prefix: int = 2048  # time to first token: the reused prefix
    new_tokens: int = 64  # time to first token: the new tail of each prompt
    remote_blocks: tuple[int, ...] = (1, 16, 64)  # store tiers: blocks per call
    sharded: tuple[int, int, int] = (65536, 1024, 1024)  # 8 devices: pool, update T, store T


FULL = Sizes()
TINY = Sizes(
    pools=(256, 1024, 4096),
    tokens=(4, 16, 64),
    accel_pools=(256, 1024, 4096),
    accel_tokens=(16, 64, 128),
    connector_tokens=256,
    hash_tokens=1 << 10,
    decoder_pool=1 << 10,
    cached=(32, 128),
    prefix=64,
    new_tokens=16,
    remote_blocks=(1, 4),
    sharded=(1024, 64, 256),
)


def _label(n: int) -> str:
    """16384 -> "16K", 1048576 -> "1M", 256 -> "256"."""
    for shift, unit in ((20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


# ---- timing ----------------------------------------------------------------------------------


def interleaved(cases: dict[str, Callable[[], object]], *, rounds: int, budget_s: float):
    """Median seconds per case; cases run alternately, `rounds` rounds or until `budget_s`."""
    for fn in cases.values():  # warm-up: compile, first touch
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    start = time.perf_counter()
    for r in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return {name: float(np.median(ts)) for name, ts in times.items()}


def _ready(x):
    jax.block_until_ready(x)
    return x


# ---- pool updates ----------------------------------------------------------------------------


def _np_dtype(dtype) -> np.dtype:
    return {
        jnp.dtype(jnp.bfloat16): np.dtype(ml_dtypes.bfloat16),
        jnp.dtype(jnp.float8_e4m3fn): np.dtype(ml_dtypes.float8_e4m3fn),
    }[jnp.dtype(dtype)]


def accelerated() -> bool:
    """Whether the default backend is an accelerator (GPU or TPU): its floors are on the device."""
    return jax.default_backend() != "cpu"


def _update_cases(kind: str, dtype, size: int, t: int, naive: bool, numpy_base: bool, rng):
    """Contenders writing `t` tokens into one layer of a `size`-token pool.

    On CPU the floors are numpy's in-place assignment and memcpy of the written bytes; on an
    accelerator they are a device-to-device copy of the same bytes (read once, written once,
    as the update does) and the plain donated `.at[loc].set` on logical-dtype buffers.

    Returns:
        `(cases, reps, nbytes)`: the cases to time, the calls each case makes per timing (its
        time is divided by that), and the bytes written per call.
    """
    if kind == "mha":
        make = functools.partial(
            MHAPool.create, size=size, head_num=HEADS, head_dim=HEAD_DIM, layer_num=1, dtype=dtype
        )
        rows = [(HEADS, HEAD_DIM), (HEADS, HEAD_DIM)]
    elif kind == "mla":
        make = functools.partial(
            MLAPool.create, size=size, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=1,
            dtype=dtype,
        )  # fmt: skip
        rows = [(1, 576)]
    else:
        make = functools.partial(
            KOnlyPool.create, size=size, head_num=HEADS, head_dim=HEAD_DIM, layer_num=1,
            dtype=dtype,
        )  # fmt: skip
        rows = [(HEADS, HEAD_DIM)]
    pool = make()
    loc_np = (rng.permutation(size)[:t] + 1).astype(np.int32)
    loc = jnp.asarray(loc_np)
    vals_np = [rng.standard_normal((t, *r)).astype(_np_dtype(dtype)) for r in rows]
    vals = [jnp.asarray(v) for v in vals_np]

    def put(p, loc, *v):
        return p.set_kv(0, loc, v[0], v[1]) if kind == "mha" else p.set_k(0, loc, v[0])

    step = jax.jit(put, donate_argnums=0)
    state = {"pool": pool}  # both jaxkv contenders thread one pool: it is donated each call
    # The same step fed raw bits (uint16/uint8, the store dtype): no bitcast pass on XLA:CPU.
    bits = [jnp.asarray(v.view(pool.store_dtype)) for v in vals_np]
    naive_fn = jax.jit(lambda bufs, loc, vals: [b.at[loc].set(v) for b, v in zip(bufs, vals)])
    naive_bufs = [jnp.zeros((size + 1, *r), dtype) for r in rows] if naive else None

    # Each contender is one call without waiting; `_timed` waits once per `reps` calls. On CPU
    # a call is synchronous anyway (reps 1). On an accelerator a wait costs a host round trip
    # (about 75 us on the H200 machine, more than a small update's device time), and a serving
    # loop does not wait between steps, so calls are issued back to back and the time is the
    # burst's over `reps`, the same for every contender.
    def eager():
        state["pool"] = put(state["pool"], loc, *vals)
        return state["pool"]

    def jitted():
        state["pool"] = step(state["pool"], loc, *vals)
        return state["pool"]

    def jitted_bits():
        state["pool"] = step(state["pool"], loc, *bits)
        return state["pool"]

    calls = {"jaxkv eager": eager, "jaxkv jit": jitted, "jaxkv jit raw bits": jitted_bits}
    if naive:
        # No donation: the obvious functional code, copying the pool every call.
        calls["naive JAX"] = lambda: naive_fn(naive_bufs, loc, vals)
    if accelerated():
        plain = {"b": [jnp.zeros((size + 1, *r), dtype) for r in rows]}
        plain_fn = jax.jit(
            lambda bufs, loc, vals: [b.at[loc].set(v, mode="drop") for b, v in zip(bufs, vals)],
            donate_argnums=0,
        )

        def plain_set():
            plain["b"] = plain_fn(plain["b"], loc, vals)
            return plain["b"]

        calls["plain donated .at[].set"] = plain_set
        # The same compiled update over the pool's buffers as a list: what a call costs the
        # host beyond the plain scatter's without the pool pytree (flatten, rebuild).
        names = pool.BUFFERS
        twin = {"b": [getattr(make(), n)[0] for n in names]}

        def put_lists(bufs, loc, *v):
            out = put(pool.with_buffers(**{n: [b] for n, b in zip(names, bufs)}), loc, *v)
            return [getattr(out, n)[0] for n in names]

        lists_fn = jax.jit(put_lists, donate_argnums=0)

        def jitted_lists():
            twin["b"] = lists_fn(twin["b"], loc, *vals)
            return twin["b"]

        calls["jaxkv jit over buffer lists"] = jitted_lists
        # A copy of the bytes an update moves: each value read once and written once. XOR with
        # a constant makes XLA read and write every element (a plain copy may be elided).
        copy_src = [jnp.asarray(v.view(pool.store_dtype)) for v in vals_np]
        flip = jax.jit(lambda xs: [x ^ jnp.ones((), x.dtype) for x in xs])
        calls["device copy"] = lambda: flip(copy_src)
        # Bursts of a few ms: at 256 tokens a call is ~40 us on an H200 and rows of identical
        # work differed by up to 15 us between bursts of 16 calls.
        reps = 64 if t <= 4096 else 8
        return (
            {name: _timed(fn, reps) for name, fn in calls.items()},
            reps,
            sum(v.nbytes for v in vals_np),
        )
    cases = {name: _timed(fn, 1) for name, fn in calls.items()}
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
    return cases, 1, sum(v.nbytes for v in vals_np)


def _timed(call: Callable[[], object], reps: int) -> Callable[[], None]:
    """`call` made `reps` times back to back, then waited for."""

    def run():
        out = None
        for _ in range(reps):
            out = call()
        _ready(out)

    return run


def _accelerator_configs(quick: bool, sizes: Sizes = FULL) -> list[tuple]:
    """MHA bf16 at 16K, 1M and 4M tokens (256 MiB and 16 GiB per layer at the ends), T up to
    65,536; `--quick` drops the middle pool and the MLA/K-only rows."""
    small, mid, big = sizes.accel_pools
    pools = (small, big) if quick else sizes.accel_pools
    configs = [
        ("mha", jnp.bfloat16, size, t) for size in pools for t in sizes.accel_tokens if t < size
    ]
    if not quick:
        configs += [("mha", jnp.float8_e4m3fn, mid, t) for t in sizes.accel_tokens[1:]]
        configs += [(kind, jnp.bfloat16, mid, sizes.accel_tokens[2]) for kind in ("mla", "k_only")]
    return configs


def bench_updates(quick: bool, sizes: Sizes = FULL) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    configs = []
    small, mid, big_pool = sizes.pools
    if accelerated():
        configs = _accelerator_configs(quick, sizes)
    for dtype in () if accelerated() else (jnp.bfloat16, jnp.float8_e4m3fn):
        for size in sizes.pools:
            for t in sizes.tokens:
                if quick and (
                    t == sizes.tokens[0]
                    or (size == big_pool and t != sizes.tokens[1])
                    or (dtype != jnp.bfloat16 and size != mid)
                ):
                    continue
                configs.append(("mha", dtype, size, t))
    for kind in () if accelerated() else ("mla", "k_only"):
        for t in sizes.tokens[1:]:
            configs.append((kind, jnp.bfloat16, mid // 4 if quick else mid, t))
    for kind, dtype, size, t in configs:
        big = size >= 1 << 20 and not accelerated()
        # Naive JAX copies the pool every call; on an accelerator the largest pool (16 GiB per
        # layer) would need two more copies of it in device memory, so it runs up to 1M tokens.
        naive = kind == "mha" and (not accelerated() or size <= 1 << 20)
        cases, reps, nbytes = _update_cases(
            kind, dtype, size, t, naive=naive, numpy_base=not big, rng=rng
        )
        naive = cases.pop("naive JAX", None)
        rounds = 5 if big else (15 if quick else 40)
        budget = 4.0 if big else (1.0 if quick else 3.0)
        med = {k: v / reps for k, v in interleaved(cases, rounds=rounds, budget_s=budget).items()}
        if naive is not None:
            # Each naive call allocates and frees a whole copy of the pool; XLA:CPU's release of
            # that memory slows whatever runs next (jaxkv jit at 256K tokens, T=4096: 4.8 ms
            # alternating with numpy and memcpy, 53.6 ms alternating with naive JAX), so naive
            # JAX alternates with memcpy in its own loop.
            floor = "device copy" if accelerated() else "memcpy"
            own = interleaved(
                {"naive JAX": naive, floor: cases[floor]},
                rounds=3 if big else rounds,
                budget_s=budget,
            )
            med["naive JAX"] = own["naive JAX"] / reps
        rows.append(
            {
                "kind": kind,
                "dtype": jnp.dtype(dtype).name,
                "pool_tokens": size,
                "tokens": t,
                "bytes": nbytes,
                **med,
            }
        )
        del cases, naive
    return rows


# ---- connector -------------------------------------------------------------------------------


def _filled_pool(rng, tokens: int, layers: int) -> tuple[MHAPool, np.ndarray]:
    """A bf16 MHA pool of `4 * tokens` rows (page 16) whose rows `16 .. 16 + tokens` hold
    random K and V in every layer, and those rows."""
    pool = MHAPool.create(
        size=4 * tokens, page_size=16, head_num=HEADS, head_dim=HEAD_DIM, layer_num=layers
    )
    slots = np.arange(16, 16 + tokens)
    x = jnp.asarray(rng.standard_normal((tokens, HEADS, HEAD_DIM)), jnp.bfloat16)
    for layer in range(layers):
        pool = pool.set_kv(layer, slots, x, x)
    return pool, slots


def bench_connector(quick: bool, sizes: Sizes = FULL) -> list[dict]:
    """Store and load throughput against memcpy (and, on accelerators, the pinned host link).

    CPU: 1024 tokens per call (32 MiB at 8 layers, 128 MiB at 32). Accelerators: 256 blocks of
    16 tokens x 32 layers (512 MiB per call), where transfers are long enough to reach the
    link's speed. Host rows at block 16 also time a fresh `HostStore` per round trip (cold).
    """
    rng = np.random.default_rng(1)
    rows = []
    accel = jax.default_backend() != "cpu"
    tokens = sizes.connector_tokens
    if accel:
        cases = [(4 * tokens, 32, (16,) if quick else (16, 256))]
    else:
        cases = [(tokens, layers, (16, 64, 256)) for layers in ((8,) if quick else (8, 32))]
    for tokens, layers, blocks in cases:
        pool, slots = _filled_pool(rng, tokens, layers)
        for block in blocks:
            for store_kind in ("host", "disk"):
                if store_kind == "disk" and quick and (accel or block != 16):
                    continue
                rows.append(_connector_row(pool, slots, layers, block, store_kind, quick, accel))
                pool = rows[-1].pop("_pool")
    return rows


def _pinned_link(nbytes: int) -> dict[str, Callable[[], object]]:
    """The host link of the default device, `nbytes` each way: device to pinned host memory
    and back (`memory_kind="device"`: a plain device target refuses pinned arrays)."""
    dev = jax.devices()[0]
    to_pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    to_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    on_device = _ready(jax.device_put(jnp.zeros(nbytes // 2, jnp.uint16), to_device))
    pinned = _ready(jax.device_put(on_device, to_pinned))
    return {
        "link d2h": lambda: _ready(jax.device_put(on_device, to_pinned)),
        "link h2d": lambda: _ready(jax.device_put(pinned, to_device)),
    }


def _connector_row(pool, slots, layers, block, store_kind, quick, accel):
    tokens = len(slots)
    nbytes = 2 * tokens * layers * HEADS * HEAD_DIM * 2
    tmp = tempfile.mkdtemp(prefix="jaxkv-bench-") if store_kind == "disk" else None

    def new_store():
        return HostStore(2 * nbytes) if tmp is None else DiskStore(tmp, capacity_bytes=2 * nbytes)

    conn = KVConnector(pool, new_store(), block_size=block)
    state = {"pool": pool, "round": 0}
    far = slots + 2 * tokens

    def export():
        conn.export_blocks(state["pool"], slots)

    def store_fn(c=conn):
        state["round"] += 1
        written = c.store(state["pool"], np.full(tokens, state["round"]), slots)
        assert written == tokens // block

    def load(c=conn):
        state["pool"], n = c.load(state["pool"], np.full(tokens, state["round"]), far)
        assert n == tokens

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)

    def memcpy():
        np.copyto(dst, src)

    cases = {"export": export, "store": store_fn, "load": load, "memcpy": memcpy}
    # Cold: a fresh HostStore for every round trip (its memory mapped when it is made, timed
    # apart); the connector and its staging are the warm one's twin. Warm: `conn`'s store, at
    # capacity after the warm-up, evicting and reusing its memory.
    cold = {"cold_store": [], "cold_load": [], "cold_create": []}
    if store_kind == "host" and block == 16:
        twin = KVConnector(pool, new_store(), block_size=block)

        def cold_trip():
            t0 = time.perf_counter()
            twin.backend = new_store()
            t1 = time.perf_counter()
            store_fn(twin)
            t2 = time.perf_counter()
            load(twin)
            cold["cold_create"].append(t1 - t0)
            cold["cold_store"].append(t2 - t1)
            cold["cold_load"].append(time.perf_counter() - t2)

        cases["cold round trip"] = cold_trip
    if accel:
        cases.update(_pinned_link(nbytes))
    store_fn()  # fill the store to capacity before timing (the warm-up call adds the second)
    med = interleaved(cases, rounds=5 if quick else 15, budget_s=2.0 if quick else 6.0)
    med.pop("cold round trip", None)  # reported split into its store and load
    med.update({k: float(np.median(v[1:])) for k, v in cold.items() if v})  # [0]: warm-up
    conn.close()
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    gbps = {
        f"{k.replace(' ', '_')}_GBps": nbytes / v / 1e9
        for k, v in med.items()
        if k != "cold_create"
    }
    row = {
        "layers": layers,
        "block_size": block,
        "blocks": tokens // block,
        "tier": store_kind,
        "bytes": nbytes,
        **med,
        **gbps,
        "store_load_vs_2memcpy": (med["store"] + med["load"]) / (2 * med["memcpy"]),
        "_pool": state["pool"],
    }
    if cold["cold_store"]:
        row["cold_store_load_vs_2memcpy"] = (med["cold_store"] + med["cold_load"]) / (
            2 * med["memcpy"]
        )
    if accel:
        row["store_vs_link"] = med["link d2h"] / med["store"]
        row["load_vs_link"] = med["link h2d"] / med["load"]
    return row


# ---- remote tier -----------------------------------------------------------------------------


def bench_remote(quick: bool, sizes: Sizes = FULL) -> dict:
    """Host, disk and Redis stores side by side: store and load of 1 to 64 blocks of 16 tokens
    (MHA 8x128 bf16, 8 layers: 512 KiB per block), Redis on a loopback `redis-server` started
    here, and Redis round trips per `store` and `load` call. Skipped (with the reason) without
    `redis-server` or redis-py."""
    from jaxkv.connector import RedisStore
    from jaxkv.connector._redis_server import MISSING, LocalRedis

    try:
        import redis  # noqa: F401
    except ImportError:
        return {"skipped": "redis-py is not installed (pip install 'jaxkv[redis]')", "rows": []}
    if not LocalRedis.available():
        return {"skipped": MISSING, "rows": []}
    layers, block = 8, 16
    counts = sizes.remote_blocks
    if quick:
        counts = (counts[0], counts[-1])
    pool = MHAPool.create(
        size=4 * block * max(counts),
        page_size=16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=layers,
    )
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((pool.size, HEADS, HEAD_DIM)), jnp.bfloat16)
    for layer in range(layers):
        pool = pool.set_kv(layer, np.arange(pool.size), x, x)
    rows = []
    tmp = tempfile.mkdtemp(prefix="jaxkv-bench-")
    with LocalRedis("--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru") as server:
        stores = {
            "host": lambda: HostStore(1 << 30),
            "disk": lambda: DiskStore(tempfile.mkdtemp(dir=tmp)),
            "redis": lambda: RedisStore(server.url),
        }
        for n in counts:
            for tier, make in stores.items():
                row, pool = _remote_row(pool, make(), tier, n, block, quick)
                rows.append({"layers": layers, **row})
    shutil.rmtree(tmp, ignore_errors=True)
    return {"skipped": None, "rows": rows}


def _remote_row(pool, store, tier: str, blocks: int, block: int, quick: bool):
    conn = KVConnector(pool, store, block_size=block)
    tokens = blocks * block
    slots, far = np.arange(tokens), np.arange(tokens, 2 * tokens)
    state = {"pool": pool, "round": 0}

    def store_fn():
        state["round"] += 1  # a new prompt each round: every block is written
        assert conn.store(state["pool"], np.arange(tokens) + (state["round"] << 20), slots)

    def load():
        prompt = np.arange(tokens) + (state["round"] << 20)
        state["pool"], n = conn.load(state["pool"], prompt, far)
        assert n == tokens

    trips = {}
    if tier == "redis":
        for name, fn in (("store", store_fn), ("load", load)):
            before = store.stats()["round_trips"]
            fn()
            trips[f"{name}_round_trips"] = store.stats()["round_trips"] - before
    med = interleaved({"store": store_fn, "load": load}, rounds=5 if quick else 15, budget_s=3.0)
    nbytes = conn.stats()["bytes_stored"] // conn.stats()["blocks_stored"] * blocks
    row = {"tier": tier, "blocks": blocks, "bytes": nbytes, **med, **trips}
    row.update({f"{k}_GBps": nbytes / v / 1e9 for k, v in med.items()})
    conn.close()
    return row, state["pool"]


# ---- hashing, allocators, async --------------------------------------------------------------


# ---- sharded pools (8 virtual devices, in a child process) -------------------------------------

_SHARDED_DEVICES = 8


def bench_sharded(quick: bool, sizes: Sizes = FULL) -> dict:
    """A head-sharded MHA pool on 8 devices against one device holding the same pool: update
    time, and the bytes the connector reads per shard. Runs in a child interpreter whose CPU
    platform has 8 virtual devices (the device count is fixed when jax starts); on CPU those
    devices share the same cores, so the update times compare overheads, not parallel speed.
    """
    import subprocess

    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={_SHARDED_DEVICES}",
    }
    code = f"import jaxkv.bench as b; b._sharded_child({quick!r}, {tuple(sizes.sharded)!r})"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        return {"skipped": "the 8-device child ran past 600 s"}
    if proc.returncode != 0:
        return {"skipped": f"the 8-device child failed: {proc.stderr.strip()[-500:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _sharded_child(quick: bool, sharded: tuple[int, int, int] = FULL.sharded) -> None:
    from jax.sharding import NamedSharding, PartitionSpec

    size, t, store_t = sharded
    if quick and sharded == FULL.sharded:
        size, t = 16384, 256
    mesh = jax.make_mesh((_SHARDED_DEVICES,), ("tp",))
    heads = NamedSharding(mesh, PartitionSpec(None, "tp", None))
    dims = dict(size=size, head_num=HEADS, head_dim=HEAD_DIM, layer_num=2)
    pools = {"sharded": MHAPool.create(**dims, sharding=heads), "one": MHAPool.create(**dims)}
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((t, HEADS, HEAD_DIM)), jnp.bfloat16)
    loc = jnp.asarray(rng.permutation(np.arange(1, size + 1))[:t].astype(np.int32))
    step = jax.jit(lambda p, loc, k: p.set_kv(0, loc, k, k), donate_argnums=0)

    def update(name):
        def fn():
            pools[name] = _ready(step(pools[name], loc, k))

        return fn

    times = interleaved(
        {n: update(n) for n in pools}, rounds=20 if quick else 50, budget_s=5 if quick else 20
    )
    # Connector: store 64 blocks of 16 tokens from each pool; bytes read per shard.
    tokens, slots = np.arange(store_t), np.arange(1, store_t + 1)
    moved = {}
    for name, pool in pools.items():
        conn = KVConnector(pool, HostStore(1 << 30))
        conn._give_back(conn._snapshot(pool, tokens, slots, None)[1])  # warm-up: compiles
        t0 = time.perf_counter()
        records, staging = conn._snapshot(pool, tokens, slots, None)
        snap_s = time.perf_counter() - t0
        per_shard: dict[str, int] = {}
        for r in records:
            per_shard[r.layout] = per_shard.get(r.layout, 0) + r.nbytes
        conn._give_back(staging)
        moved[name] = {
            "shards": len(per_shard),
            "bytes_total": sum(per_shard.values()),
            "bytes_per_shard": max(per_shard.values()),
            "snapshot_s": snap_s,
        }
    print(
        json.dumps(
            {
                "skipped": None,
                "devices": _SHARDED_DEVICES,
                "pool_tokens": size,
                "update_tokens": t,
                "store_tokens": store_t,
                "update_us": {n: s * 1e6 for n, s in times.items()},
                "connector": moved,
            }
        )
    )


def _report_sharded(sh: dict) -> None:
    if sh.get("skipped"):
        print(f"\nsharded pool: skipped ({sh['skipped']})")
        return
    up, conn = sh["update_us"], sh["connector"]
    print(
        f"\nsharded pool (MHA {HEADS}x{HEAD_DIM} bf16, {sh['pool_tokens']} tokens, "
        f"{sh['devices']} virtual CPU devices sharing the cores)"
    )
    print(
        f"  jitted set_kv of {sh['update_tokens']} tokens: head-sharded {up['sharded']:.0f} us, "
        f"one device {up['one']:.0f} us"
    )
    for name, row in conn.items():
        print(
            f"  store of {sh['store_tokens']} tokens, {name}: {row['shards']} shard(s), "
            f"{row['bytes_per_shard']} bytes per shard of {row['bytes_total']} in all, "
            f"snapshot {row['snapshot_s'] * 1e3:.1f} ms"
        )


def bench_hashing(quick: bool, sizes: Sizes = FULL) -> list[dict]:
    pool = MHAPool.create(size=16, head_num=1, head_dim=8, layer_num=1)
    tokens = np.random.default_rng(2).integers(0, 150_000, sizes.hash_tokens)
    data = tokens.astype("<u4").tobytes()
    rows = []
    for block in (16, 64, 256):
        conn = KVConnector(pool, HostStore(1 << 20), block_size=block)
        med = interleaved(
            {
                "block_hashes": lambda c=conn: c.block_hashes(tokens),
                "sha256 one pass": lambda: hashlib.sha256(data).digest(),
            },
            rounds=10 if quick else 30,
            budget_s=1.0 if quick else 3.0,
        )
        rows.append(
            {
                "block_size": block,
                "tokens": len(tokens),
                **med,
                "tokens_per_s": len(tokens) / med["block_hashes"],
                "ratio": med["block_hashes"] / med["sha256 one pass"],
            }
        )
    return rows


def bench_allocators(quick: bool) -> list[dict]:
    rng = np.random.default_rng(3)
    page, n_req = 16, 256
    alloc = PagedAllocator(1 << 20, page)
    prefix = rng.integers(1, 2048, n_req)
    held = alloc.alloc_extend(np.zeros(n_req, int), prefix, np.full(n_req, -1))
    last = held[np.cumsum(prefix) - 1]
    seq = prefix + rng.integers(1, 512, n_req)
    state = alloc.backup_state()

    def extend():
        alloc.restore_state(state)
        assert alloc.alloc_extend(prefix, seq, last) is not None

    def decode():
        alloc.restore_state(state)
        assert alloc.alloc_decode(prefix + 1, last) is not None

    def restore_only():
        alloc.restore_state(state)

    med = interleaved(
        {"alloc_extend": extend, "alloc_decode": decode, "restore": restore_only},
        rounds=30 if quick else 100,
        budget_s=1.0 if quick else 3.0,
    )
    return [
        {
            "requests": n_req,
            "page_size": page,
            "extend_tokens": int((seq - prefix).sum()),
            "alloc_extend": med["alloc_extend"] - med["restore"],
            "alloc_decode": med["alloc_decode"] - med["restore"],
        }
    ]


def bench_async(quick: bool, sizes: Sizes = FULL) -> dict:
    rng = np.random.default_rng(4)
    tokens, layers = sizes.connector_tokens, 8
    pool, slots = _filled_pool(rng, tokens, layers)
    nbytes = 2 * tokens * layers * HEADS * HEAD_DIM * 2
    conn = KVConnector(pool, HostStore(8 * nbytes), block_size=16)
    state = {"round": 0}

    def snapshot():
        state["round"] += 1
        conn._snapshot(pool, np.full(tokens, state["round"]), slots, None)

    def store_async():
        state["round"] += 1
        conn.store_async(pool, np.full(tokens, state["round"]), slots)
        # The write runs in the background; let it finish before the next contender runs.

    def flush():
        conn.flush()

    med = interleaved(
        {"snapshot": snapshot, "store_async": store_async, "flush": flush},
        rounds=10 if quick else 30,
        budget_s=2.0 if quick else 5.0,
    )
    conn.close()
    return {
        "bytes": nbytes,
        "snapshot": med["snapshot"],
        "store_async": med["store_async"],
        "ratio": med["store_async"] / med["snapshot"],
    }


# ---- serving: the reference decoder -----------------------------------------------------------


def bench_serving(quick: bool, sizes: Sizes = FULL) -> dict:
    """The reference decoder of `jaxkv.models` (GQA, 4 layers, d_model 512, 2 KV heads of 64)
    served from a bf16 `MHAPool` of 64K tokens (a serving pool holding many requests), page
    size 16.

    Decode: one request with 1K or 16K cached tokens. The jaxkv step (pool donated, writes in
    place, context read through the request-to-token table) runs against the very same jitted
    step with the pool not donated, where each `.at[].set` copies the whole buffer (the naive
    functional cache), and against recomputing the whole sequence without a cache (16K only
    in full runs: about a minute on 2 cores). Times are per layer (step / layers).

    Time to first token: a 2,048-token prefix plus 64 new tokens, served by the `Engine`
    without a store and with the prefix reused from a `HostStore` (stored by an earlier
    request; each round's 64 tokens are new). Compilation is excluded.
    """
    from jaxkv import ReqToTokenPool
    from jaxkv.models import Decoder, DecoderConfig, bucket

    model = Decoder(DecoderConfig())
    params = model.init_params()
    layers, page, pool_tokens = model.cfg.n_layers, 16, sizes.decoder_pool
    donated = jax.jit(model.step, donate_argnums=1, static_argnames="ctx")
    naive = jax.jit(model.step, static_argnames="ctx")
    recompute = jax.jit(model.reference_logits)
    state = {"pool": model.create_pool(size=pool_tokens, page_size=page)}
    decode = []
    for cached in sizes.cached:
        ctx = bucket(cached + 1)
        table = ReqToTokenPool(1, ctx).write(1, 0, np.arange(page, page + cached + 1))
        args = (
            table.req_to_token,
            np.array([1], np.int32),
            np.array([[1]], np.int32),
            np.array([cached], np.int32),
            np.array([1], np.int32),
            np.array([[page + cached]], np.int32),
        )
        seq = jnp.asarray(np.random.default_rng(5).integers(0, 256, cached + 1), jnp.int32)

        def jaxkv_step(args=args, ctx=ctx):
            logits, state["pool"] = donated(params, state["pool"], *args, ctx=ctx)
            _ready(logits)

        def naive_step(args=args, ctx=ctx):
            _ready(naive(params, state["pool"], *args, ctx=ctx))

        cases = {"jaxkv": jaxkv_step, "naive functional cache": naive_step}
        long = cached > sizes.cached[0]
        if not long:
            cases["recompute without cache"] = lambda seq=seq: _ready(recompute(params, seq))
        med = interleaved(cases, rounds=3 if quick else (5 if long else 20), budget_s=4.0)
        if long and not quick:
            # One call takes about a minute on 2 cores: compile it, then time a single run.
            exe = recompute.lower(params, seq).compile()
            t0 = time.perf_counter()
            _ready(exe(params, seq))
            med["recompute without cache"] = time.perf_counter() - t0
        decode.append(
            {
                "cached_tokens": cached,
                "pool_tokens": pool_tokens,
                "context_bucket": ctx,
                **{f"{k} per layer": v / layers for k, v in med.items()},
            }
        )
    return {"decode": decode, "ttft": _bench_ttft(model, params, quick, sizes)}


def _bench_ttft(model, params, quick: bool, sizes: Sizes = FULL) -> dict:
    from jaxkv.models import Engine, Request, bucket

    rng = np.random.default_rng(6)
    new = sizes.new_tokens
    prefix = rng.integers(0, 256, sizes.prefix).astype(np.int32)
    ctx = bucket(sizes.prefix + new)
    kw = dict(pool_size=2 * ctx, page_size=16, max_batch=1, max_context=ctx)
    plain = Engine(model, params, **kw)
    reuse = Engine(model, params, store=HostStore(1 << 30), **kw)
    times: dict[str, list[float]] = {"no reuse": [], "reuse from HostStore": []}
    loaded = 0
    # Round 0: the reusing engine computes the whole prompt (compiling the full-prompt step
    # both engines use) and offloads its blocks; later rounds' last 64 tokens are new. Round 1
    # compiles what reuse adds (the suffix step, the load's scatter): a compile costs more
    # than the load itself on a GPU, so timing starts at round 2.
    for r in range(2 + (2 if quick else 5)):
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


# ---- report ----------------------------------------------------------------------------------


def _sizes(res: dict) -> Sizes:
    """The sizes a result was measured at (results written before they were recorded: FULL)."""
    got = {k: tuple(v) if isinstance(v, list) else v for k, v in res.get("sizes", {}).items()}
    return Sizes(**got)


def _accelerator_update_targets(by: dict, target, sizes: Sizes) -> None:
    """Updates against the device's own floors (see `_update_cases`)."""
    small_pool, _, big_pool = (_label(n) for n in sizes.accel_pools)
    _, mid_t, big_t = sizes.accel_tokens
    r = by.get((sizes.accel_pools[2], big_t))
    target(
        f"jaxkv jit rate / device copy rate, T={big_t}, {big_pool}-token pool",
        r["device copy"] / r["jaxkv jit"] if r else None,
        0.7,
        at_least=True,
    )
    ratios = [r["jaxkv jit"] / r["plain donated .at[].set"] for r in by.values()]
    # "No slower" within the timing noise of one run: 5%.
    target("jaxkv jit / plain donated .at[].set, worst size", max(ratios) if ratios else None, 1.05)
    small = by.get((sizes.accel_pools[0], mid_t))
    big = by.get((sizes.accel_pools[2], mid_t))
    target(
        f"jaxkv jit: time({big_pool} pool) / time({small_pool} pool), T={mid_t}",
        big["jaxkv jit"] / small["jaxkv jit"] if small and big else None,
        1.3,
    )
    r = small
    value = r["jaxkv eager"] / r["jaxkv jit"] if r else None
    target(f"jaxkv eager / jaxkv jit, T={mid_t}", value, 3.0)


def _targets(res: dict) -> list[dict]:
    out = []

    def target(name, value, limit, at_least=False):
        ok = value is not None and (value >= limit if at_least else value <= limit)
        out.append({"target": name, "value": value, "limit": limit, "at_least": at_least, "ok": ok})

    upd = [r for r in res["updates"] if r["kind"] == "mha" and r["dtype"] == "bfloat16"]
    by = {(r["pool_tokens"], r["tokens"]): r for r in upd}
    sizes = _sizes(res)
    if res["machine"]["backend"] != "cpu":
        _accelerator_update_targets(by, target, sizes)
    else:
        _cpu_update_targets(by, target, sizes)
    _connector_targets(res, target)
    hashes = {h["block_size"]: h["ratio"] for h in res["hashing"]}
    target("block_hashes / one SHA-256 pass, block 16", hashes.get(16), 20.0)
    target("block_hashes / one SHA-256 pass, block 256", hashes.get(256), 3.0)
    target("store_async / snapshot alone", res["async"]["ratio"], 1.5)
    return out


def _cpu_update_targets(by: dict, target, sizes: Sizes) -> None:
    """Updates against numpy's in-place assignment and pool-size independence."""
    small_pool, mid_pool, big_pool = sizes.pools
    mid_t = sizes.tokens[1]
    small, big = by.get((small_pool, mid_t)), by.get((big_pool, mid_t))
    for mode in ("jaxkv jit", "jaxkv eager"):
        value = big[mode] / small[mode] if small and big else None
        name = f"time({_label(big_pool)} pool) / time({_label(small_pool)} pool)"
        target(f"{mode}: {name}, T={mid_t}", value, 1.3)
    for t in sizes.tokens[1:]:
        r = by.get((mid_pool, t))
        target(
            f"jaxkv jit / numpy in-place, T={t}",
            r["jaxkv jit"] / r["numpy in-place"] if r else None,
            1.5,
        )
    r = by.get((mid_pool, mid_t))
    value = r["jaxkv eager"] / r["jaxkv jit"] if r else None
    target(f"jaxkv eager / jaxkv jit, T={mid_t}", value, 3.0)


def _connector_targets(res: dict, target) -> None:
    """CPU: store+load against two memcpys, cold and warm. Accelerators: store and load
    against the pinned host link measured in the same run, 512 MiB per call."""
    rows = [c for c in res["connector"] if c["block_size"] == 16 and c["tier"] == "host"]
    if res["machine"]["backend"] == "cpu":
        row = next((c for c in rows if c["layers"] == 8), None)
        blocks = row["blocks"] if row else "-"
        name = f"connector (store+load) / (2 memcpy), {blocks}x16 tokens, 8 layers, host"
        target(f"{name}, at capacity", row["store_load_vs_2memcpy"] if row else None, 2.5)
        cold = row.get("cold_store_load_vs_2memcpy") if row else None
        target(f"{name}, fresh HostStore", cold, 2.5)
        return
    row = max(rows, key=lambda c: c["bytes"], default=None)  # 512 MiB per call in full runs
    blocks = row["blocks"] if row else "-"
    for op, link in (("store", "device to host"), ("load", "host to device")):
        value = row[f"{op}_vs_link"] if row else None
        name = f"{op} / pinned link ({link}), {blocks}x16 tokens, 32 layers, host"
        target(name, value, 0.5, True)


def _print_table(title: str, rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    head = "  ".join(f"{label:>{len(label) if len(label) > 9 else 9}}" for _, label, _ in cols)
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = []
        for key, label, fmt in cols:
            width = len(label) if len(label) > 9 else 9
            v = r.get(key)
            cells.append(f"{'-' if v is None else format(v, fmt):>{width}}")
        print("  ".join(cells))


def _report_remote(remote: dict) -> None:
    if remote["skipped"]:
        print(f"\nremote tier: skipped ({remote['skipped']})")
        return
    _print_table(
        "remote tier (GB/s; 512 KiB blocks; Redis on loopback; round trips per call)",
        remote["rows"],
        [
            ("tier", "tier", "s"),
            ("blocks", "blocks", "d"),
            ("store_GBps", "store", ".3f"),
            ("load_GBps", "load", ".3f"),
            ("store_round_trips", "store trips", "d"),
            ("load_round_trips", "load trips", "d"),
        ],
    )


def _report(res: dict) -> None:
    us = lambda k, lab: (k, lab, ".0f")  # noqa: E731
    upd = [
        {
            **r,
            **{
                k: r[k] * 1e6
                for k in r
                if k
                in (
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
            },
        }
        for r in res["updates"]
    ]
    for r in upd:
        r["jit/numpy"] = r["jaxkv jit"] / r["numpy in-place"] if "numpy in-place" in r else None
        r["naive/jit"] = r["naive JAX"] / r["jaxkv jit"] if "naive JAX" in r else None
        if "memcpy" in r:
            r["jit/memcpy"] = r["jaxkv jit"] / r["memcpy"]
        if "device copy" in r:
            r["copy rate"] = r["device copy"] / r["jaxkv jit"]
            r["jit/plain"] = r["jaxkv jit"] / r["plain donated .at[].set"]
            r["eager/jit"] = r["jaxkv eager"] / r["jaxkv jit"]
    head = [
        ("kind", "kind", ""),
        ("dtype", "dtype", ""),
        ("pool_tokens", "pool tokens", "d"),
        ("tokens", "T", "d"),
        us("jaxkv eager", "eager"),
        us("jaxkv jit", "jit"),
        us("jaxkv jit raw bits", "jit bits"),
    ]
    if res["machine"]["backend"] == "cpu":
        cols = [
            us("numpy in-place", "numpy"),
            us("naive JAX", "naive JAX"),
            us("memcpy", "memcpy"),
            ("jit/numpy", "jit/numpy", ".2f"),
            ("jit/memcpy", "jit/memcpy", ".2f"),
            ("naive/jit", "naive/jit", ".1f"),
        ]
    else:
        cols = [
            us("plain donated .at[].set", "plain .at[].set"),
            us("jaxkv jit over buffer lists", "jit lists"),
            us("naive JAX", "naive JAX"),
            us("device copy", "device copy"),
            ("copy rate", "jit/copy rate", ".2f"),
            ("jit/plain", "jit/plain", ".2f"),
            ("eager/jit", "eager/jit", ".2f"),
            ("naive/jit", "naive/jit", ".1f"),
        ]
    _print_table(
        f"updates on {res['machine']['backend']} (median us per call; one layer, K and V for MHA)",
        upd,
        head + cols,
    )
    cols = [
        ("layers", "layers", "d"),
        ("block_size", "block", "d"),
        ("tier", "tier", ""),
        ("bytes", "bytes", "d"),
        ("export_GBps", "export", ".2f"),
        ("store_GBps", "store", ".2f"),
        ("load_GBps", "load", ".2f"),
        ("memcpy_GBps", "memcpy", ".2f"),
        ("store_load_vs_2memcpy", "(st+ld)/2memcpy", ".2f"),
        ("cold_store_GBps", "cold store", ".2f"),
        ("cold_load_GBps", "cold load", ".2f"),
        ("cold_store_load_vs_2memcpy", "cold (st+ld)/2memcpy", ".2f"),
    ]
    if res["machine"]["backend"] != "cpu":
        cols += [
            ("link_d2h_GBps", "link d2h", ".2f"),
            ("link_h2d_GBps", "link h2d", ".2f"),
            ("store_vs_link", "store/link", ".2f"),
            ("load_vs_link", "load/link", ".2f"),
        ]
    _print_table(
        "connector (GB/s; MHA 8x128 bf16, K and V; cold: a fresh HostStore per round trip)",
        res["connector"],
        cols,
    )
    _report_remote(res["remote"])
    _report_sharded(res["sharded"])
    _print_table(
        f"hashing ({_label(res['hashing'][0]['tokens'])} tokens)",
        res["hashing"],
        [
            ("block_size", "block", "d"),
            ("tokens_per_s", "tokens/s", ".3g"),
            ("ratio", "vs one sha256 pass", ".1f"),
        ],
    )
    alloc = [
        {**r, "alloc_extend": r["alloc_extend"] * 1e6, "alloc_decode": r["alloc_decode"] * 1e6}
        for r in res["allocators"]
    ]
    _print_table(
        "allocators (us per call)",
        alloc,
        [
            ("requests", "requests", "d"),
            ("extend_tokens", "extend tokens", "d"),
            ("alloc_extend", "alloc_extend", ".0f"),
            ("alloc_decode", "alloc_decode", ".0f"),
        ],
    )
    _report_serving(res)
    a = res["async"]
    print(
        f"\nstore_async: returns in {a['store_async'] * 1e3:.2f} ms; snapshot alone "
        f"{a['snapshot'] * 1e3:.2f} ms; ratio {a['ratio']:.2f}"
    )
    print("\ntargets")
    for t in res["targets"]:
        v = "-" if t["value"] is None else f"{t['value']:.2f}"
        bound = "at least" if t.get("at_least") else "limit"
        print(f"  [{'ok' if t['ok'] else 'MISS'}] {t['target']}: {v} ({bound} {t['limit']})")


def _serving_targets(res: dict) -> list[dict]:
    """The reference decoder's rows: with 1K cached tokens in a 64K-token pool the in-place
    step must be at least 4x faster than the naive functional cache (which copies the pool
    every step), and reusing a 2K-token prefix (97% of the prompt) must at least halve the
    time to first token.

    The decode target is the host's: on an accelerator a copy of the 64K-token pool (32 MiB per
    layer) takes microseconds, so the naive cache is no floor there and the step is bound by
    kernel launches (both rows are printed; on an H200, 0.35 ms per layer for jaxkv and 0.26 ms
    for the naive cache)."""
    serving = res.get("serving") or {}
    sizes = _sizes(res)
    decode = {r["cached_tokens"]: r for r in serving.get("decode", [])}
    r = decode.get(sizes.cached[0])
    ttft = serving.get("ttft", {})
    cached, pool = _label(sizes.cached[0]), _label(sizes.decoder_pool)
    rows = []
    if res["machine"]["backend"] == "cpu":
        rows.append(
            (
                f"decode step, {cached} cached tokens, {pool}-token pool: jaxkv / naive "
                "functional cache",
                r["jaxkv per layer"] / r["naive functional cache per layer"] if r else None,
                0.25,
            )
        )
    rows.append(
        (
            f"time to first token: reused {_label(sizes.prefix)} prefix (HostStore) / no reuse",
            ttft["reuse from HostStore"] / ttft["no reuse"] if "no reuse" in ttft else None,
            0.5,
        )
    )
    return [
        {
            "target": name,
            "value": value,
            "limit": limit,
            "at_least": False,
            "ok": value is not None and value <= limit,
        }
        for name, value, limit in rows
    ]


def _report_serving(res: dict) -> None:
    serving = res.get("serving")
    if not serving:
        return
    rows = []
    for r in serving["decode"]:
        row = {"cached_tokens": r["cached_tokens"]}
        for key in ("jaxkv", "naive functional cache", "recompute without cache"):
            v = r.get(f"{key} per layer")
            row[key] = None if v is None else v * 1e3
        row["naive/jaxkv"] = row["naive functional cache"] / row["jaxkv"]
        if row["recompute without cache"] is not None:
            row["recompute/jaxkv"] = row["recompute without cache"] / row["jaxkv"]
        rows.append(row)
    _print_table(
        "reference decoder, decode step (ms per layer; GQA 8/2 heads of 64, bf16 pool of "
        f"{_label(serving['decode'][0]['pool_tokens'])} tokens, batch 1; recompute of the "
        "longer context in full runs only)",
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
    t = serving["ttft"]
    print(
        f"\nreference decoder, time to first token ({t['prompt_tokens']} prompt tokens): "
        f"{t['no reuse'] * 1e3:.0f} ms without reuse, {t['reuse from HostStore'] * 1e3:.0f} ms "
        f"with {t['reused_tokens']} prefix tokens loaded from a HostStore"
    )


def _plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [
        r
        for r in res["updates"]
        if r["kind"] == "mha" and r["dtype"] == "bfloat16" and r["tokens"] == 256
    ]
    rows.sort(key=lambda r: r["pool_tokens"])
    x = [r["pool_tokens"] for r in rows]
    for key, style in (("jaxkv jit", "o-"), ("jaxkv eager", "s-"), ("naive JAX", "x--")):
        ax.plot(x, [r[key] * 1e6 for r in rows], style, label=key)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("pool size (tokens)")
    ax.set_ylabel("update time, 256 tokens (us)")
    ax.set_title("set_kv: MHA 8x128 bf16, one layer")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def machine() -> dict:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "numpy": np.__version__,
        "jaxkv": __version__,
        "devices": [str(d) for d in jax.devices()],
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
    }


def run(
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    sizes: Sizes | None = None,
) -> int:
    """Runs every section, prints the tables and targets; returns the exit status.

    Args:
        quick: fewer update configurations and rounds (`--quick`).
        json_path: where to write every figure as JSON, or None.
        plot_path: where to draw update time against pool size (needs matplotlib), or None.
        sizes: the problem sizes (default `FULL`); `TINY` runs every section in seconds, with
            fewer configurations and rounds as `quick` does, for tests of the bench itself.
    """
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install 'jaxkv[bench]'", file=sys.stderr)
            return 2
    info = machine()
    sizes = FULL if sizes is None else sizes
    quick = quick or sizes != FULL
    print(
        "jaxkv bench"
        + (" --quick" if quick else "")
        + ("" if sizes == FULL else " at reduced sizes")
    )
    print("  " + ", ".join(f"{k} {v}" for k, v in info.items()))
    start = time.perf_counter()
    res: dict = {"machine": info, "quick": quick, "sizes": dataclasses.asdict(sizes)}
    res["updates"] = bench_updates(quick, sizes)
    res["connector"] = bench_connector(quick, sizes)
    res["remote"] = bench_remote(quick, sizes)
    res["sharded"] = bench_sharded(quick, sizes)
    res["hashing"] = bench_hashing(quick, sizes)
    res["allocators"] = bench_allocators(quick)
    res["async"] = bench_async(quick, sizes)
    res["serving"] = bench_serving(quick, sizes)
    res["targets"] = _targets(res) + _serving_targets(res)
    res["seconds"] = time.perf_counter() - start
    _report(res)
    print(f"\n{res['seconds']:.0f} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {json_path}")
    if plot_path:
        _plot(res, plot_path)
        print(f"wrote {plot_path}")
    return 0
