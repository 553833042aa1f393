"""Store tiers side by side: host, disk and (given a server) Redis, 1 to 64 blocks per call."""

from __future__ import annotations

import shutil
import tempfile
import uuid

import jax.numpy as jnp
import numpy as np

from jaxkv import MHAPool
from jaxkv.bench._harness import interleaved
from jaxkv.bench._report import print_table
from jaxkv.bench._section import Section, Setting
from jaxkv.bench._sizes import HEAD_DIM, HEADS, kv_bytes
from jaxkv.connector import DiskStore, HostStore, KVConnector

LAYERS, BLOCK = 8, 16  # 512 KiB per block of MHA 8x128 bf16, K and V

NO_URL = (
    "no --redis-url given; to measure a Redis or Valkey server, pass its URL: "
    "python -m jaxkv bench --redis-url redis://HOST:6379/0 (the bench writes its blocks under "
    "a key prefix of its own and deletes them at the end)"
)


def redis_problem(url: str) -> str | None:
    """Why the server at `url` cannot be benchmarked (redis-py missing, a malformed URL, no
    answer to PING), or None when it answers."""
    try:
        import redis
    except ImportError:
        return "needs redis-py (pip install 'jaxkv[redis]')"
    try:
        client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    except ValueError as err:
        return f"expected a redis://, rediss:// or unix:// URL, got {url!r} ({err})"
    try:
        client.ping()
    except (redis.RedisError, OSError) as err:
        return f"the server did not answer PING ({err})"
    finally:
        client.close()
    return None


def _delete_prefix(url: str, prefix: str) -> None:
    """Removes every key under `prefix` from the server: the bench's blocks are not the
    user's cache."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        for i in range(0, len(keys), 1000):
            client.delete(*keys[i : i + 1000])
    finally:
        client.close()


def measure(setting: Setting) -> dict:
    """Store and load of each of `remote_blocks` blocks per call, into a `HostStore`, a
    `DiskStore` and, with `setting.redis_url`, a `RedisStore` on that server (with its round
    trips per `store` and `load` call)."""
    from jaxkv.connector import RedisStore

    counts = setting.sizes.remote_blocks
    pool = MHAPool.create(
        size=4 * BLOCK * max(counts),
        page_size=BLOCK,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
    )
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((pool.size, HEADS, HEAD_DIM)), jnp.bfloat16)
    for layer in range(LAYERS):
        pool = pool.set_kv(layer, np.arange(pool.size), x, x)
    # Every round stores new blocks: room for four of the biggest calls, so the host store
    # runs at capacity, evicting the oldest rounds as a serving host's store does.
    capacity = 4 * max(counts) * kv_bytes(BLOCK, LAYERS)
    tmp = tempfile.mkdtemp(prefix="jaxkv-bench-")
    prefix = f"jaxkv-bench-{uuid.uuid4().hex[:12]}:"
    stores = {
        "host": lambda: HostStore(capacity),
        "disk": lambda: DiskStore(tempfile.mkdtemp(dir=tmp)),
    }
    url = setting.redis_url
    if url:
        stores["redis"] = lambda: RedisStore(url, key_prefix=prefix)
    rows = []
    try:
        for n in counts:
            for tier, make in stores.items():
                row, pool = _row(pool, make(), tier, n, setting.sizes.quick)
                rows.append({"layers": LAYERS, **row})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if setting.redis_url:
            _delete_prefix(setting.redis_url, prefix)
    return {"redis_skipped": None if setting.redis_url else NO_URL, "rows": rows}


def _row(pool, store, tier: str, blocks: int, quick: bool):
    conn = KVConnector(pool, store, block_size=BLOCK)
    tokens = blocks * BLOCK
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


def report(res: dict, setting: Setting) -> None:
    where = "Redis on the server given" if setting.redis_url else "no Redis"
    print_table(
        f"store tiers (GB/s; 512 KiB blocks; {where}; Redis round trips per call)",
        res["rows"],
        [
            ("tier", "tier", "s"),
            ("blocks", "blocks", "d"),
            ("store_GBps", "store", ".3f"),
            ("load_GBps", "load", ".3f"),
            ("store_round_trips", "store trips", "d"),
            ("load_round_trips", "load trips", "d"),
        ],
    )
    if res["redis_skipped"]:
        print(f"  Redis rows skipped: {res['redis_skipped']}")


SECTION = Section("remote", measure, report)
