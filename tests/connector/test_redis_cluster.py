"""`RedisStore` on a real Redis Cluster (`redis+cluster://`), three masters on loopback ports.

Cluster URLs and key slots; bit-exact round trips for every pool kind; one pipeline per node
owning any of a call's keys; damaged values refused and deleted on their node; two processes
sharing a prefix; a node killed, a failover to a replica, a slot moved (`ASK`, then `MOVED`)
under a running store/lookup/load loop: misses, never wrong data, nothing raised, then hits.

The clusters come from `tests/redis_server.py`. Without `redis-server`, `redis-cli` (or
redis-py) these tests skip, naming what is missing, except under CI (`CI` set), where they fail.
"""

from __future__ import annotations

import time
import uuid

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CONNECTOR_KINDS,
    REPO,
    connector_pool,
    fill_random_bits,
    random_connector_pool,
    require,
    roundtrip,
    row_bits,
    run_python,
)
from redis_server import MISSING, MISSING_CLI, LocalRedis, LocalRedisCluster

from jaxkv.connector import BlockRecord, KVConnector, RedisStore
from jaxkv.connector import _redis_cluster as cluster_module

BS = 16


def _need_cluster() -> None:
    """Fails under CI, skips elsewhere, when the servers or the client are missing."""
    missing = []
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py is not installed (`pip install 'jaxkv[redis]'`)")
    if not LocalRedisCluster.available():
        missing.append(f"{MISSING}; {MISSING_CLI}")
    require(missing, "the Redis Cluster tests")


@pytest.fixture(scope="module")
def cluster():
    """One cluster for the tests that only add keys (each under its own prefix)."""
    _need_cluster()
    with LocalRedisCluster(masters=3) as c:
        yield c


@pytest.fixture
def own_cluster():
    """A cluster of the test's own (`own_cluster(replicas=...)`), for tests that kill nodes or
    move slots."""
    _need_cluster()
    made = []

    def start(replicas: int = 0) -> LocalRedisCluster:
        made.append(LocalRedisCluster(masters=3, replicas=replicas))
        return made[-1].start()

    yield start
    for c in made:
        c.close()


def _store(c: LocalRedisCluster, **kwargs) -> RedisStore:
    return RedisStore(c.url, key_prefix=f"test-{uuid.uuid4().hex[:8]}:", **kwargs)


def _mha(seed: int, size: int = 256):
    return random_connector_pool("mha", seed, size=size, page_size=1, dtype=jnp.float32)


# --------------------------------------------------------------------------------------------
# URLs and slots (no server)


def test_a_cluster_url_names_its_startup_nodes_and_each_nodes_url():
    startup, node_url = cluster_module.parse_url(
        "redis+cluster://user:pw@cache-1:7000/0?nodes=cache-2:7001;[::1]:7002&socket_keepalive=1"
    )
    assert startup == [("cache-1", 7000), ("cache-2", 7001), ("::1", 7002)]
    assert node_url(("10.0.0.9", 7005)) == "redis://user:pw@10.0.0.9:7005/0?socket_keepalive=1"
    assert node_url(("::1", 7002)) == "redis://user:pw@[::1]:7002/0?socket_keepalive=1"
    tls, _ = cluster_module.parse_url("rediss+cluster://cache-1:7000")
    assert tls == [("cache-1", 7000)]


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://cache-1:7000/1",  # a cluster has database 0 alone
        "redis+cluster://cache-1",  # no port
        "redis+cluster://cache-1:7000?nodes=cache-2",
        "redis+cluster://cache-1:7000?nodes=cache-2:99999",
        "redis+cluster://cache-1:7000?nodes=cache-2:7001,cache-3:7002",  # commas split tiers
    ],
)
def test_a_malformed_cluster_url_names_the_argument(url):
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match="^url: expected"):
        RedisStore(url)


def test_key_slots_are_the_servers(cluster):
    client = cluster.client(cluster.nodes[0])
    try:
        for name in ["jaxkv:" + "ab" * 32, "x", "{user1000}.following", "a{}b", "{}{tag}", "é"]:
            assert cluster_module.key_slot(name) == client.cluster("keyslot", name), name
    finally:
        client.close()


def test_a_server_not_in_cluster_mode_answers_misses_and_the_log_says_why(caplog):
    _need_cluster()
    record = BlockRecord("ab" * 32, "layout", "tokens", {"k": np.arange(4, dtype=np.float32)})
    with LocalRedis() as srv:
        store = RedisStore(f"redis+cluster://127.0.0.1:{srv.port}", retry_after_s=0.01)
        assert store.put_many([record]).values == [False]
        time.sleep(0.02)
        assert store.contains_many([record.key]).values == [False]
        assert store.get(record.key) is None
        stats = store.stats()
    assert stats["io_errors"] >= 2 and stats["dropped"] == 1 and stats["blocks"] == 0
    assert "RedisStore: slot map failed" in caplog.text


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize(
    "kind,dtype",
    [(k, jnp.bfloat16) for k in CONNECTOR_KINDS] + [("nsa", jnp.float8_e4m3fn)],
)
def test_roundtrip_every_pool_kind_is_bit_exact(cluster, kind, dtype):
    rng = np.random.default_rng(1)
    src = fill_random_bits(connector_pool(kind, dtype=dtype, page_size=4), rng)
    dst = fill_random_bits(connector_pool(kind, dtype=dtype, page_size=4), rng)
    store = _store(cluster)
    conn = KVConnector(src, store)
    roundtrip(src, dst, conn, rng=rng, size=64, page_size=4, n_tokens=5 * conn.block_size + 1)
    stats = store.stats()
    assert stats["verification_failures"] == stats["io_errors"] == stats["moved"] == 0
    assert stats["blocks"] >= 5


def test_each_call_is_one_pipeline_per_node_owning_its_keys(cluster):
    pool, dst = _mha(2), _mha(3)
    store = _store(cluster)
    conn = KVConnector(pool, store)
    tokens, slots = np.arange(12 * BS) + 77, np.arange(12 * BS)
    nodes = {cluster.owner(store.key_prefix + k).port for k in conn.block_hashes(tokens)}
    assert len(nodes) > 1  # 12 random keys over 3 nodes

    def trips() -> int:
        return store.stats()["round_trips"]

    start = trips()
    assert conn.store(pool, tokens, slots) == 12
    stored = trips()
    assert conn.lookup(tokens) == 12 * BS
    looked = trips()
    dst, n = conn.load(dst, tokens, slots)
    assert n == 12 * BS
    # store: which blocks are held, then the writes; lookup: one; load: one; per node.
    assert (stored - start, looked - stored, trips() - looked) == (
        2 * len(nodes),
        len(nodes),
        len(nodes),
    )
    np.testing.assert_array_equal(row_bits(dst, slots), row_bits(pool, slots))


def test_a_damaged_value_is_a_miss_and_is_deleted_from_its_node(cluster):
    pool, dst = _mha(4), _mha(5)
    store = _store(cluster)
    conn = KVConnector(pool, store)
    tokens = np.arange(3 * BS) + 5000
    assert conn.store(pool, tokens, np.arange(3 * BS)) == 3
    name = store.key_prefix + conn.block_hashes(tokens)[1]
    owner = cluster.client(cluster.owner(name))
    try:
        value = bytearray(owner.get(name))
        value[len(value) // 2] ^= 1
        owner.set(name, bytes(value))
        dst, n = conn.load(dst, tokens, np.arange(3 * BS))
        assert n == BS  # the damaged second block ends the prefix
        assert owner.exists(name) == 0
    finally:
        owner.close()
    assert store.stats()["verification_failures"] == 1
    assert conn.store(pool, tokens, np.arange(3 * BS)) == 1
    dst, n = conn.load(dst, tokens, np.arange(3 * BS))
    assert n == 3 * BS
    np.testing.assert_array_equal(
        row_bits(dst, np.arange(3 * BS)), row_bits(pool, np.arange(3 * BS))
    )


@pytest.mark.slow  # a second interpreter
def test_two_processes_share_a_prefix(cluster):
    prefix = f"hosts-{uuid.uuid4().hex[:8]}:"
    child = (
        "import sys, numpy as np; sys.path.insert(0, sys.argv[3]);"
        "import jax.numpy as jnp; from helpers import random_connector_pool;"
        "from jaxkv.connector import KVConnector, RedisStore;"
        "pool = random_connector_pool('mha', 5, size=256, page_size=1, dtype=jnp.float32);"
        " conn = KVConnector(pool, RedisStore(sys.argv[1], key_prefix=sys.argv[2]));"
        f"print(conn.store(pool, np.arange({8 * BS}) + 7, np.arange({8 * BS})))"
    )
    out = run_python("-c", child, cluster.url, prefix, str(REPO / "tests"), timeout=120)
    assert out.stdout.strip() == "8"
    src, dst = _mha(5), connector_pool("mha", size=256, page_size=1, dtype=jnp.float32)
    conn = KVConnector(dst, RedisStore(cluster.url, key_prefix=prefix))
    tokens, slots = np.arange(8 * BS) + 7, np.arange(40, 40 + 8 * BS)
    assert conn.lookup(tokens) == 8 * BS
    dst, n = conn.load(dst, tokens, slots)
    assert n == 8 * BS
    np.testing.assert_array_equal(row_bits(dst, slots), row_bits(src, np.arange(8 * BS)))


# --------------------------------------------------------------------------------------------
# Faults


def _serve(conn, pool, dst, tokens):
    """One store / lookup / load of `tokens` (raising nothing: the connector is lenient);
    returns `dst`, what the load found, and whether every loaded row is the stored one."""
    slots = np.arange(len(tokens))
    conn.store(pool, tokens, slots)
    conn.lookup(tokens)
    dst, n = conn.load(dst, tokens, slots + 256)
    return dst, n, np.array_equal(row_bits(dst, slots[:n] + 256), row_bits(pool, slots[:n]))


def test_a_node_down_is_a_miss_for_its_slots_and_the_others_still_serve(own_cluster):
    c = own_cluster()
    store = RedisStore(c.url, timeout_s=0.3, retry_after_s=0.1, max_retry_after_s=0.4)
    pool, dst = _mha(6, size=512), _mha(7, size=512)
    conn = KVConnector(pool, store)
    tokens = np.arange(12 * BS) + 90_000
    keys = conn.block_hashes(tokens)
    dst, n, exact = _serve(conn, pool, dst, tokens)
    assert (n, exact) == (12 * BS, True)
    first = c.owner(store.key_prefix + keys[0])
    first.stop()
    for step in range(4):
        start = time.monotonic()
        dst, n, exact = _serve(conn, pool, dst, tokens + 1000 * step)
        assert exact and time.monotonic() - start < 3.0
    # The stored prompt: its first block is on the dead node, so nothing loads; blocks on the
    # other nodes are still held, one lookup at a time.
    assert conn.lookup(tokens) == 0
    held = store.contains_many(keys).values
    assert held[0] is False and any(held)
    assert all(h == (c.owner(store.key_prefix + k) is not first) for k, h in zip(keys, held))
    assert store.stats()["io_errors"] >= 1

    first.start()  # comes back empty; the cluster takes it back
    c.wait_until_ok()
    deadline, in_a_row = time.monotonic() + 20, 0
    while in_a_row < 3 and time.monotonic() < deadline:
        dst, n, exact = _serve(conn, pool, dst, tokens)
        assert exact
        in_a_row = in_a_row + 1 if n == 12 * BS else 0
    assert in_a_row == 3


def test_a_failover_is_misses_then_the_replica_serves_the_same_blocks(own_cluster):
    c = own_cluster(replicas=1)
    store = RedisStore(c.url, timeout_s=0.3, retry_after_s=0.1, max_retry_after_s=0.4)
    pool, dst = _mha(8, size=512), _mha(9, size=512)
    conn = KVConnector(pool, store)
    tokens = np.arange(8 * BS) + 70_000
    slots = np.arange(8 * BS)
    assert conn.store(pool, tokens, slots) == 8
    name = store.key_prefix + conn.block_hashes(tokens)[0]
    master = c.owner(name)
    client = c.client(master)
    try:
        assert client.execute_command("WAIT", 1, 5000) == 1  # the replica has every write
    finally:
        client.close()
    master.stop()
    dst, n = conn.load(dst, tokens, slots + 256)  # no exception, whatever it finds
    assert np.array_equal(row_bits(dst, slots[:n] + 256), row_bits(pool, slots[:n]))
    deadline, n = time.monotonic() + 20, 0
    while n < 8 * BS and time.monotonic() < deadline:
        dst, n = conn.load(dst, tokens, slots + 256)
        assert np.array_equal(row_bits(dst, slots[:n] + 256), row_bits(pool, slots[:n]))
        time.sleep(0.05)
    assert n == 8 * BS  # the same blocks, from the promoted replica: nothing stored again
    assert c.owner(name) is not master
    assert store.stats()["blocks_stored"] == 8


def test_a_moving_slot_is_a_miss_then_served_from_its_new_node(own_cluster):
    c = own_cluster()
    store = RedisStore(c.url, retry_after_s=0.05)
    pool, dst = _mha(10), _mha(11)
    conn = KVConnector(pool, store)
    tokens = np.arange(BS) + 60_000
    assert conn.store(pool, tokens, np.arange(BS)) == 1
    name = store.key_prefix + conn.block_hashes(tokens)[0]
    source = c.owner(name)
    target = next(n for n in c.nodes if n is not source)
    src, dst_node = c.client(source), c.client(target)
    try:
        slot = src.cluster("keyslot", name)
        src_id, dst_id = (x.execute_command("CLUSTER", "MYID").decode() for x in (src, dst_node))
        dst_node.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", name)
        dst, n = conn.load(dst, tokens, np.arange(BS))  # the source answers ASK: a miss
        assert n == 0 and store.stats()["moved"] >= 1
        for node in c.nodes:
            client = c.client(node)
            try:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            finally:
                client.close()
    finally:
        src.close()
        dst_node.close()
    deadline, n = time.monotonic() + 10, 0
    while n == 0 and time.monotonic() < deadline:
        dst, n = conn.load(dst, tokens, np.arange(BS))  # MOVED, then the new map: a hit
        time.sleep(0.06)
    assert n == BS
    np.testing.assert_array_equal(row_bits(dst, np.arange(BS)), row_bits(pool, np.arange(BS)))
    stats = store.stats()
    assert stats["io_errors"] == stats["verification_failures"] == 0


def test_the_bench_measures_a_cluster_and_leaves_nothing_on_it(cluster):
    import jax

    from jaxkv import bench
    from jaxkv.bench import _remote

    owner = cluster.client(cluster.owner("the-users-own-key"))
    try:
        owner.set("the-users-own-key", b"1")
        setting = bench.Setting(bench.TINY, jax.default_backend(), redis_cluster_url=cluster.url)
        res = _remote.measure(setting)
        assert [r["blocks"] for r in res["rows"] if r["tier"] == "cluster"] == [1, 4]
        left = []
        for node in cluster.nodes:
            client = cluster.client(node)
            left += client.keys("jaxkv-bench-*")
            client.close()
        assert left == [] and owner.get("the-users-own-key") == b"1"
    finally:
        owner.close()
    assert _remote.redis_problem("redis+cluster://127.0.0.1:1") is not None
