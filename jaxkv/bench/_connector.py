"""Connector transfers: `store` and `load` against memcpy of the same bytes (and, on an
accelerator, the pinned host link), and `store_async` against its snapshot."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import MHAPool
from jaxkv.bench._harness import interleaved, ready
from jaxkv.bench._report import print_table
from jaxkv.bench._section import Section, Setting
from jaxkv.bench._sizes import HEAD_DIM, HEADS, kv_bytes
from jaxkv.bench._targets import Measured
from jaxkv.connector import DiskStore, HostStore, KVConnector


def filled_pool(rng, tokens: int, layers: int) -> tuple[MHAPool, np.ndarray]:
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


def measure(setting: Setting) -> list[dict]:
    """Store and load throughput against memcpy (and, on accelerators, the pinned host link).

    CPU: `connector_tokens` per call (1024 tokens: 32 MiB at 8 layers, 128 MiB at 32), block
    16, 64 and 256, host and disk stores. Accelerators: 4x the tokens x 32 layers (512 MiB
    per call), where transfers are long enough to reach the link's speed. Host rows at block
    16 also time a fresh `HostStore` per round trip (cold).
    """
    rng = np.random.default_rng(1)
    sizes, quick, accel = setting.sizes, setting.sizes.quick, setting.accel
    cases: list[tuple[int, int, tuple[int, ...]]]  # tokens, layers, block sizes
    if accel:
        cases = [(4 * sizes.connector_tokens, 32, (16,) if quick else (16, 256))]
    else:
        cases = [(sizes.connector_tokens, n, (16, 64, 256)) for n in sizes.connector_layers]
    rows = []
    for tokens, layers, blocks in cases:
        pool, slots = filled_pool(rng, tokens, layers)
        for block in blocks:
            for tier in ("host", "disk"):
                if tier == "disk" and quick and (accel or block != 16):
                    continue
                row, pool = _row(pool, slots, layers, block, tier, quick, accel)
                rows.append(row)
    return rows


def _pinned_link(nbytes: int) -> dict[str, Callable[[], object]]:
    """The host link of the default device, `nbytes` each way: device to pinned host memory
    and back (`memory_kind="device"`: a plain device target refuses pinned arrays)."""
    dev = jax.devices()[0]
    to_pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    to_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    on_device = ready(jax.device_put(jnp.zeros(nbytes // 2, jnp.uint16), to_device))
    pinned = ready(jax.device_put(on_device, to_pinned))
    return {
        "link d2h": lambda: ready(jax.device_put(on_device, to_pinned)),
        "link h2d": lambda: ready(jax.device_put(pinned, to_device)),
    }


def _row(pool, slots, layers, block, tier, quick, accel) -> tuple[dict, MHAPool]:
    """One connector row, and the pool (loads replace it)."""
    tokens = len(slots)
    nbytes = kv_bytes(tokens, layers)
    tmp = tempfile.mkdtemp(prefix="jaxkv-bench-") if tier == "disk" else None

    def new_store():
        return HostStore(2 * nbytes) if tmp is None else DiskStore(tmp, capacity_bytes=2 * nbytes)

    conn = KVConnector(pool, new_store(), block_size=block)
    state = {"pool": pool, "round": 0}
    far = slots + 2 * tokens

    def export():
        conn.export_blocks(state["pool"], slots)

    def store(c=conn):
        state["round"] += 1
        written = c.store(state["pool"], np.full(tokens, state["round"]), slots)
        assert written == tokens // block

    def load(c=conn):
        state["pool"], n = c.load(state["pool"], np.full(tokens, state["round"]), far)
        assert n == tokens

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    cases = {"export": export, "store": store, "load": load, "memcpy": lambda: np.copyto(dst, src)}
    # Cold: a fresh HostStore for every round trip (its memory mapped when it is made, timed
    # apart); the connector and its staging are the warm one's twin. Warm: `conn`'s store, at
    # capacity after the warm-up, evicting and reusing its memory.
    cold: dict[str, list[float]] = {"cold_store": [], "cold_load": [], "cold_create": []}
    if tier == "host" and block == 16:
        twin = KVConnector(pool, new_store(), block_size=block)

        def cold_trip():
            t0 = time.perf_counter()
            twin.backend = new_store()
            t1 = time.perf_counter()
            store(twin)
            t2 = time.perf_counter()
            load(twin)
            cold["cold_create"].append(t1 - t0)
            cold["cold_store"].append(t2 - t1)
            cold["cold_load"].append(time.perf_counter() - t2)

        cases["cold round trip"] = cold_trip
    if accel:
        cases.update(_pinned_link(nbytes))
    store()  # fill the store to capacity before timing (the warm-up call adds the second)
    med = interleaved(cases, rounds=5 if quick else 15, budget_s=2.0 if quick else 6.0)
    med.pop("cold round trip", None)  # reported split into its store and load
    med.update({k: float(np.median(v[1:])) for k, v in cold.items() if v})  # [0]: warm-up
    conn.close()
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    rates = {
        f"{k.replace(' ', '_')}_GBps": nbytes / v / 1e9
        for k, v in med.items()
        if k != "cold_create"
    }
    row = {
        "layers": layers,
        "block_size": block,
        "blocks": tokens // block,
        "tier": tier,
        "bytes": nbytes,
        **med,
        **rates,
        "store_load_vs_2memcpy": (med["store"] + med["load"]) / (2 * med["memcpy"]),
    }
    if cold["cold_store"]:
        trip = med["cold_store"] + med["cold_load"]
        row["cold_store_load_vs_2memcpy"] = trip / (2 * med["memcpy"])
    if accel:
        row["store_vs_link"] = med["link d2h"] / med["store"]
        row["load_vs_link"] = med["link h2d"] / med["load"]
    return row, state["pool"]


def targets(rows: list[dict], setting: Setting) -> list[Measured]:
    """CPU: store+load against two memcpys of the same bytes, warm and cold. Accelerators:
    store and load against the pinned host link measured in the same run."""
    host16 = [r for r in rows if r["block_size"] == 16 and r["tier"] == "host"]
    if not setting.accel:
        row = next((r for r in host16 if r["layers"] == 8), None) or {}
        name = (
            f"connector (store+load) / (2 memcpy), {row.get('blocks', '-')}x16 tokens, "
            "8 layers, host"
        )
        return [
            Measured("connector.warm", f"{name}, at capacity", row.get("store_load_vs_2memcpy")),
            Measured(
                "connector.cold", f"{name}, fresh HostStore", row.get("cold_store_load_vs_2memcpy")
            ),
        ]
    row = max(host16, key=lambda r: r["bytes"], default={})
    blocks = row.get("blocks", "-")
    return [
        Measured(
            f"connector.accel.{op}",
            f"{op} / pinned link ({link}), {blocks}x16 tokens, 32 layers, host",
            row.get(f"{op}_vs_link"),
        )
        for op, link in (("store", "device to host"), ("load", "host to device"))
    ]


def report(rows: list[dict], setting: Setting) -> None:
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
    if setting.accel:
        cols += [
            ("link_d2h_GBps", "link d2h", ".2f"),
            ("link_h2d_GBps", "link h2d", ".2f"),
            ("store_vs_link", "store/link", ".2f"),
            ("load_vs_link", "load/link", ".2f"),
        ]
    title = "connector (GB/s; MHA 8x128 bf16, K and V; cold: a fresh HostStore per round trip)"
    print_table(title, rows, cols)


def measure_async(setting: Setting) -> dict:
    """`store_async` (which returns once the snapshot is taken) against the snapshot alone."""
    rng = np.random.default_rng(4)
    tokens, layers = setting.sizes.connector_tokens, 8
    pool, slots = filled_pool(rng, tokens, layers)
    nbytes = kv_bytes(tokens, layers)
    conn = KVConnector(pool, HostStore(8 * nbytes), block_size=16)
    state = {"round": 0}

    def snapshot():
        state["round"] += 1
        with conn.snapshot(pool, np.full(tokens, state["round"]), slots):
            pass

    def store_async():
        state["round"] += 1
        conn.store_async(pool, np.full(tokens, state["round"]), slots)

    quick = setting.sizes.quick
    med = interleaved(
        # The write runs in the background: `flush` lets it finish before the next case runs.
        {"snapshot": snapshot, "store_async": store_async, "flush": conn.flush},
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


def targets_async(res: dict, setting: Setting) -> list[Measured]:
    return [Measured("async.return", "store_async / snapshot alone", res["ratio"])]


def report_async(res: dict, setting: Setting) -> None:
    print(
        f"\nstore_async: returns in {res['store_async'] * 1e3:.2f} ms; snapshot alone "
        f"{res['snapshot'] * 1e3:.2f} ms; ratio {res['ratio']:.2f}"
    )


SECTION = Section("connector", measure, report, targets)
ASYNC = Section("async", measure_async, report_async, targets_async)
