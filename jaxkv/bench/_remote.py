"""Store tiers side by side: host, disk and, given their servers, Redis, a Redis Cluster and
Mooncake, 1 to 64 blocks per call, beside a memcpy of the same bytes; then Mooncake's store
against Mooncake's own client moving the same records' bytes."""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from jaxkv import MHAPool
from jaxkv.bench._harness import interleaved
from jaxkv.bench._report import print_table
from jaxkv.bench._section import Section, Setting
from jaxkv.bench._sizes import HEAD_DIM, HEADS, kv_bytes
from jaxkv.connector import BlockRecord, BlockStore, DiskStore, HostStore, KVConnector

LAYERS, BLOCK = 8, 16  # 512 KiB per block of MHA 8x128 bf16, K and V

NO_URL = (
    "no --redis-url given; to measure a Redis or Valkey server, pass its URL: "
    "python -m jaxkv bench --redis-url redis://HOST:6379/0 (the bench writes its blocks under "
    "a key prefix of its own and deletes them at the end)"
)
NO_ENGINES = (
    "Redis Cluster and Mooncake rows are measured given --redis-cluster-url "
    "redis+cluster://HOST:PORT and --mooncake mooncake://HOST:PORT?metadata=URL (a master "
    "with segments of at least 1 GiB mounted, e.g. by mooncake_client); the bench deletes its "
    "blocks at the end"
)
# Mooncake's store against its own client: rounds of one put and one get of each contender.
_CLIENT_ROUNDS = {True: 5, False: 11}


def redis_problem(url: str) -> str | None:
    """Why the server (or the cluster's first startup node) at `url` cannot be benchmarked
    (redis-py missing, a malformed URL, no answer to PING), or None when it answers."""
    try:
        import redis
    except ImportError:
        return "needs redis-py (pip install 'jaxkv[redis]')"
    from jaxkv.connector.remote import CLUSTER_SCHEMES, parse_url

    try:
        if url.startswith(CLUSTER_SCHEMES):
            startup, node_url = parse_url(url)
            url = node_url(startup[0])
        client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    except ValueError as err:
        return (
            f"expected a redis://, rediss://, unix:// or redis+cluster:// URL, got {url!r} ({err})"
        )
    try:
        client.ping()
    except (redis.RedisError, OSError) as err:
        return f"the server did not answer PING ({err})"
    finally:
        client.close()
    return None


def mooncake_problem(spec: str) -> str | None:
    """Why the Mooncake cluster `spec` names cannot be benchmarked, or None."""
    from jaxkv.connector.mooncake import url_args as mooncake_args

    try:
        master, _ = mooncake_args(spec)
        store = _mooncake_store(spec, "jaxkv-bench-probe:")
    except (ImportError, ValueError) as err:
        return str(err)
    try:
        if not store.ready:
            return (
                f"no Mooncake client could be set up with the master at {master} and the "
                "metadata server named (are both running and reachable?)"
            )
    finally:
        store.close()
    return None


def _mooncake_store(spec: str, prefix: str):
    from jaxkv.connector import MooncakeStore
    from jaxkv.connector.mooncake import url_args as mooncake_args

    master, kwargs = mooncake_args(spec)
    return MooncakeStore(master, **{"timeout_s": 5.0, **kwargs, "key_prefix": prefix})


def _delete_redis_prefix(url: str, prefix: str) -> None:
    """Removes every key under `prefix` from the server or every master of the cluster: the
    bench's blocks are not the user's cache."""
    import redis

    from jaxkv.connector.remote import CLUSTER_SCHEMES, parse_url

    client: redis.Redis | redis.cluster.RedisCluster
    if url.startswith(CLUSTER_SCHEMES):
        startup, node_url = parse_url(url)
        client = redis.cluster.RedisCluster.from_url(node_url(startup[0]))
    else:
        client = redis.Redis.from_url(url)
    try:
        for key in list(client.scan_iter(match=prefix + "*", count=1000)):
            client.delete(key)
    finally:
        client.close()


def _pool() -> MHAPool:
    return MHAPool.create(
        size=8 * BLOCK, page_size=BLOCK, head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS
    )


def measure(setting: Setting) -> dict:
    """Store and load of each of `remote_blocks` blocks per call, into a `HostStore`, a
    `DiskStore` and the servers given (a `RedisStore` on `redis_url`, on
    `redis_cluster_url`, a `MooncakeStore` on `mooncake`, with their round trips per `store`
    and `load` call), and a memcpy of the same bytes; then, with `mooncake`, the store's
    `put_many` and `get_many` of the largest batch against Mooncake's client putting and
    getting the same records' bytes."""
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
    stores: dict[str, Callable[[], BlockStore]] = {
        "host": lambda: HostStore(capacity),
        "disk": lambda: DiskStore(tempfile.mkdtemp(dir=tmp)),
    }
    servers = [("redis", setting.redis_url), ("cluster", setting.redis_cluster_url)]
    for tier, url in servers:
        if url:
            stores[tier] = functools.partial(RedisStore, url, key_prefix=prefix)
    if setting.mooncake:
        stores["mooncake"] = functools.partial(_mooncake_store, setting.mooncake, prefix)
    rows, memcpy, client_rows = [], [], []
    try:
        for n in counts:
            memcpy.append({"layers": LAYERS, **_memcpy_row(n, setting.sizes.quick)})
            for tier, make in stores.items():
                row, pool = _row(pool, make(), tier, n, setting.sizes.quick)
                rows.append({"layers": LAYERS, **row})
        if setting.mooncake:
            client_rows = _against_the_client(setting.mooncake, max(counts), setting.sizes.quick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for _, url in servers:
            if url:
                _delete_redis_prefix(url, prefix)
        if setting.mooncake:
            _remove_mooncake_prefix(setting.mooncake, prefix)
    return {
        "redis_skipped": None if setting.redis_url else NO_URL,
        "engines_skipped": None if setting.redis_cluster_url and setting.mooncake else NO_ENGINES,
        "rows": rows,
        "memcpy": memcpy,
        "mooncake_client": client_rows,
    }


def _memcpy_row(blocks: int, quick: bool) -> dict:
    """numpy copying the blocks' bytes to other host memory (store) and back (load)."""
    nbytes = blocks * kv_bytes(BLOCK, LAYERS)
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    med = interleaved(
        {"store": lambda: np.copyto(dst, src), "load": lambda: np.copyto(src, dst)},
        rounds=5 if quick else 15,
        budget_s=1.0,
    )
    row = {"tier": "memcpy", "blocks": blocks, "bytes": nbytes, **med}
    row.update({f"{k}_GBps": nbytes / v / 1e9 for k, v in med.items()})
    return row


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
    if "round_trips" in store.stats():
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


# ---- Mooncake's store against its own client -----------------------------------------------


def _bench_records(blocks: int, seed: int) -> list[BlockRecord]:
    """`blocks` records of one block of the section's pool each (random bits)."""
    rng = np.random.default_rng(seed)
    half = kv_bytes(BLOCK, LAYERS) // 2
    return [
        BlockRecord(
            f"{seed:032x}{i:032x}",
            "bench",
            "bench",
            {n: rng.integers(0, 2**16, half // 2, dtype=np.uint16) for n in "kv"},
        )
        for i in range(blocks)
    ]


def _against_the_client(spec: str, blocks: int, quick: bool) -> list[dict]:
    """Per round, a put and a get of `blocks` records by `MooncakeStore` (`put_many`,
    `get_many`), and of the same records' bytes by Mooncake's client: from and into host
    memory registered with it (`batch_put_from`, `batch_get_into`), and as Python bytes
    (`put_batch`, `get_batch`). Medians of the rounds, the contenders alternating; every
    round's objects are removed before the next (untimed)."""
    from mooncake.store import MooncakeDistributedStore

    from jaxkv.connector.mooncake import url_args as mooncake_args

    master, kwargs = mooncake_args(spec)
    prefix = f"jaxkv-bench-{uuid.uuid4().hex[:12]}:"
    store = _mooncake_store(spec, prefix)
    client = MooncakeDistributedStore()
    records = _bench_records(blocks, 7)
    values = [r.to_bytes() for r in records]
    size = len(values[0])
    nbytes = size * blocks
    host = kwargs.get("local_hostname", "127.0.0.1")
    code = client.setup(
        host, kwargs["metadata"], 0, 2 * nbytes, kwargs.get("protocol", "tcp"), "", master
    )
    if code != 0:
        store.close()
        raise RuntimeError(f"Mooncake's client setup failed ({code})")
    src = np.frombuffer(b"".join(values), np.uint8).copy()
    dst = np.zeros_like(src)
    client.register_buffer(src.ctypes.data, src.nbytes)
    client.register_buffer(dst.ctypes.data, dst.nbytes)
    ptrs = [src.ctypes.data + i * size for i in range(blocks)]
    into = [dst.ctypes.data + i * size for i in range(blocks)]

    def contenders(r: int) -> dict[str, tuple[Callable, Callable, list[str]]]:
        names = [f"{prefix}{c}{r}-{i}" for c in "ab" for i in range(blocks)]
        a, b = names[:blocks], names[blocks:]
        keyed = [BlockRecord(f"{r:032x}{i:032x}", x.layout, x.tokens, x.parts) for i, x in
                 enumerate(records)]  # fmt: skip
        keys = [x.key for x in keyed]
        return {
            "store": (
                lambda: store.put_many(keyed),
                lambda: store.get_many(keys),
                [prefix + k for k in keys],
            ),
            "from/into": (
                lambda: client.batch_put_from(a, ptrs, [size] * blocks),
                lambda: client.batch_get_into(a, into, [size] * blocks),
                a,
            ),
            "bytes": (
                lambda: client.put_batch(b, values),
                lambda: client.get_batch(b),
                b,
            ),
        }

    times: dict[str, dict[str, list[float]]] = {}
    try:
        for r in range(_CLIENT_ROUNDS[quick] + 1):  # round 0 warms up, untimed
            for name, (put, get, names) in contenders(r).items():
                t0 = time.perf_counter()
                put()
                t1 = time.perf_counter()
                get()
                t2 = time.perf_counter()
                client.batch_remove(names, True)
                if r:
                    timed = times.setdefault(name, {"store": [], "load": []})
                    timed["store"].append(t1 - t0)
                    timed["load"].append(t2 - t1)
    finally:
        client.close()
        store.close()
    rows: list[dict] = []
    for name, timed in times.items():
        med = {k: float(np.median(v)) for k, v in timed.items()}
        row = {"contender": name, "blocks": blocks, "bytes": nbytes, **med}
        row.update({f"{k}_GBps": nbytes / v / 1e9 for k, v in med.items()})
        row["both_GBps"] = 2 * nbytes / (med["store"] + med["load"]) / 1e9
        rows.append(row)
    ours = rows[0]["both_GBps"]
    for row in rows:
        row["store_vs_it"] = ours / row["both_GBps"]
    return rows


def _remove_mooncake_prefix(spec: str, prefix: str) -> None:
    """Removes the bench's objects (every key under `prefix`) from the cluster."""
    import re

    from mooncake.store import MooncakeDistributedStore

    from jaxkv.connector.mooncake import url_args as mooncake_args

    master, kwargs = mooncake_args(spec)
    client = MooncakeDistributedStore()
    host = kwargs.get("local_hostname", "127.0.0.1")
    if client.setup(host, kwargs["metadata"], 0, 0, "tcp", "", master) == 0:
        client.remove_by_regex("^" + re.escape(prefix), True)
    client.close()


def report(res: dict, setting: Setting) -> None:
    given = [
        name
        for name, url in (
            ("Redis", setting.redis_url),
            ("Redis Cluster", setting.redis_cluster_url),
            ("Mooncake", setting.mooncake),
        )
        if url
    ]
    where = " and ".join(given) + " on the servers given" if given else "no servers"
    memcpy = {r["blocks"]: r for r in res.get("memcpy", [])}
    memcpy_sizes = list(memcpy) or [0]
    rows = []
    for row in res["rows"]:  # each size's rows after a memcpy of the same bytes
        if row["blocks"] in memcpy:
            rows.append(memcpy.pop(row["blocks"]))
        rows.append(row)
    print_table(
        f"store tiers (GB/s; 512 KiB blocks; {where}; cluster: Redis Cluster; round trips per "
        "call)",
        rows,
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
    if res.get("engines_skipped"):
        print(f"  {res['engines_skipped']}")
    if res.get("mooncake_client"):
        print_table(
            "Mooncake's store against its own client on the same records' bytes (GB/s; store: "
            "MooncakeStore.put_many / get_many; from/into: the client's batch_put_from / "
            "batch_get_into, registered memory; bytes: its put_batch / get_batch; store / it: "
            "the store's put+get rate over the contender's)",
            res["mooncake_client"],
            [
                ("contender", "contender", "s"),
                ("blocks", "blocks", "d"),
                ("store_GBps", "put", ".3f"),
                ("load_GBps", "get", ".3f"),
                ("both_GBps", "put+get", ".3f"),
                ("store_vs_it", "store / it", ".2f"),
            ],
        )
        both = {r["tier"]: _both(r) for r in res["rows"] if r["blocks"] == max(memcpy_sizes)}
        if "redis" in both and "mooncake" in both:
            print(
                f"  MooncakeStore store+load through the connector, {max(memcpy_sizes)} blocks: "
                f"{both['mooncake'] / both['redis']:.2f}x Redis's"
            )


def _both(row: dict) -> float:
    """A row's store+load rate (GB/s): its bytes moved both ways over both times."""
    return 2 * row["bytes"] / (row["store"] + row["load"]) / 1e9


SECTION = Section("remote", measure, report)
