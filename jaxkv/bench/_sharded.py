"""A head-sharded pool on 8 devices against one device holding the same pool, measured in a
child interpreter whose CPU platform has 8 virtual devices (the device count is fixed when
jax starts)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import MHAPool
from jaxkv.bench._harness import interleaved, ready
from jaxkv.bench._section import Section, Setting
from jaxkv.bench._sizes import HEAD_DIM, HEADS, kv_bytes
from jaxkv.connector import HostStore, KVConnector

DEVICES = 8
TIMEOUT_S = 600


def measure(setting: Setting) -> dict:
    """Update time, and the bytes the connector reads per shard. On CPU the 8 devices share
    the same cores, so the update times compare overheads, not parallel speed."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
    }
    sizes = setting.sizes
    code = f"from jaxkv.bench import _sharded; _sharded.child({sizes.quick!r}, {sizes.sharded!r})"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"skipped": f"the {DEVICES}-device child ran past {TIMEOUT_S} s"}
    if proc.returncode != 0:
        return {"skipped": f"the {DEVICES}-device child failed: {proc.stderr.strip()[-500:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child(quick: bool, sharded: tuple[int, int, int]) -> None:
    """The measurement itself, in the 8-device interpreter; prints its result as one JSON line.

    Args:
        quick: fewer timing rounds.
        sharded: `(pool tokens, tokens per update, tokens per store)`.
    """
    from jax.sharding import NamedSharding, PartitionSpec

    size, t, store_t = sharded
    mesh = jax.make_mesh((DEVICES,), ("tp",))
    heads = NamedSharding(mesh, PartitionSpec(None, "tp", None))
    make = functools.partial(
        MHAPool.create, size=size, head_num=HEADS, head_dim=HEAD_DIM, layer_num=2
    )
    pools = {"sharded": make(sharding=heads), "one": make()}
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((t, HEADS, HEAD_DIM)), jnp.bfloat16)
    loc = jnp.asarray(rng.permutation(np.arange(1, size + 1))[:t].astype(np.int32))
    step = jax.jit(lambda p, loc, k: p.set_kv(0, loc, k, k), donate_argnums=0)

    def update(name):
        def fn():
            pools[name] = ready(step(pools[name], loc, k))

        return fn

    times = interleaved(
        {n: update(n) for n in pools}, rounds=20 if quick else 50, budget_s=5 if quick else 20
    )
    # Connector: the snapshot a store takes of `store_t` tokens from each pool, by shard.
    tokens, slots = np.arange(store_t), np.arange(1, store_t + 1)
    moved = {}
    for name, pool in pools.items():
        conn = KVConnector(pool, HostStore(4 * kv_bytes(store_t, pool.layer_num)))
        with conn.snapshot(pool, tokens, slots):  # warm-up: compiles
            pass
        per_shard: dict[str, int] = {}
        t0 = time.perf_counter()
        with conn.snapshot(pool, tokens, slots) as records:
            snap_s = time.perf_counter() - t0
            for r in records:
                per_shard[r.layout] = per_shard.get(r.layout, 0) + r.nbytes
        moved[name] = {
            "shards": len(per_shard),
            "bytes_total": sum(per_shard.values()),
            "bytes_per_shard": max(per_shard.values()),
            "snapshot_s": snap_s,
        }
    result = {
        "skipped": None,
        "devices": DEVICES,
        "pool_tokens": size,
        "update_tokens": t,
        "store_tokens": store_t,
        "update_us": {n: s * 1e6 for n, s in times.items()},
        "connector": moved,
    }
    print(json.dumps(result))


def report(sh: dict, setting: Setting) -> None:
    if sh.get("skipped"):
        print(f"\nsharded pool: skipped ({sh['skipped']})")
        return
    up = sh["update_us"]
    print(
        f"\nsharded pool (MHA {HEADS}x{HEAD_DIM} bf16, {sh['pool_tokens']} tokens, "
        f"{sh['devices']} virtual CPU devices sharing the cores)"
    )
    print(
        f"  jitted set_kv of {sh['update_tokens']} tokens: head-sharded {up['sharded']:.0f} us, "
        f"one device {up['one']:.0f} us"
    )
    for name, row in sh["connector"].items():
        print(
            f"  store of {sh['store_tokens']} tokens, {name}: {row['shards']} shard(s), "
            f"{row['bytes_per_shard']} bytes per shard of {row['bytes_total']} in all, "
            f"snapshot {row['snapshot_s'] * 1e3:.1f} ms"
        )


SECTION = Section("sharded", measure, report)
