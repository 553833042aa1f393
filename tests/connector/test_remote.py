"""`RedisStore` against a real `redis-server` on a loopback port, and a tiered stack over it.

Bit-exact round trips for every pool kind; two processes (two serving hosts) sharing a prefix;
one round trip per call whatever the number of blocks; verification (a bad record is a miss and
is deleted; a key holding another type or an empty string is no block, and is deleted);
`discard`; the server killed, stopped (slow) and restarted under a running store/lookup/load
loop: misses within the timeout, nothing raised, no wrong data, recovery; the server's LRU
evicting under `maxmemory`; promotion from Redis into host memory.

The server comes from `tests/redis_server.py`. Without `redis-server` (or redis-py)
these tests skip, naming what is missing, except under CI (`CI` set), where they fail.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
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
from redis_server import MISSING, LocalRedis

from jaxkv import MHAPool
from jaxkv.connector import HostStore, KVConnector, RedisStore, TieredStore, _records
from jaxkv.connector import remote as remote_module

BS = 16


def _need_redis() -> None:
    """Fails under CI, skips elsewhere, when the server or the client is missing."""
    missing = []
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py is not installed (`pip install 'jaxkv[redis]'`)")
    if not LocalRedis.available():
        missing.append(MISSING)
    require(missing, "the Redis tests")


@pytest.fixture(scope="module")
def server():
    """One server for the tests that only add keys (each under its own prefix)."""
    _need_redis()
    with LocalRedis() as srv:
        yield srv


@pytest.fixture
def own_server():
    """Starts a server of the test's own (`own_server(*options)`), for tests that kill, stop or
    fill it."""
    _need_redis()
    servers = []

    def start(*args: str) -> LocalRedis:
        servers.append(LocalRedis(*args))
        return servers[-1].start()

    yield start
    for srv in servers:
        srv.close()


def _store(srv, **kwargs) -> RedisStore:
    """A store under a fresh key prefix: tests sharing a server never see each other's keys."""
    return RedisStore(srv.url, key_prefix=f"test-{uuid.uuid4().hex[:8]}:", **kwargs)


def _mha(seed: int, size: int = 128) -> MHAPool:
    return random_connector_pool("mha", seed, size=size, page_size=1, dtype=jnp.float32)


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize(
    "kind,dtype",
    [(k, jnp.bfloat16) for k in CONNECTOR_KINDS] + [("nsa", jnp.float8_e4m3fn)],
)
def test_roundtrip_every_pool_kind_is_bit_exact(server, kind, dtype):
    rng = np.random.default_rng(1)
    src = fill_random_bits(connector_pool(kind, dtype=dtype, page_size=4), rng)
    dst = fill_random_bits(connector_pool(kind, dtype=dtype, page_size=4), rng)
    store = _store(server)
    conn = KVConnector(src, store)
    roundtrip(src, dst, conn, rng=rng, size=64, page_size=4, n_tokens=3 * conn.block_size + 1)
    assert store.stats()["verification_failures"] == 0


def test_store_lookup_and_load_are_one_round_trip_each_whatever_the_block_count(server):
    pool, dst = _mha(2, size=256), _mha(3, size=256)
    store = _store(server)
    conn = KVConnector(pool, store)

    def trips() -> int:
        return store.stats()["round_trips"]

    for blocks in (1, 4, 16):
        tokens, slots = np.arange(blocks * BS) + 100_000 * blocks, np.arange(blocks * BS)
        start = trips()
        assert conn.store(pool, tokens, slots) == blocks
        stored = trips()
        assert conn.lookup(tokens) == blocks * BS
        looked = trips()
        dst, n = conn.load(dst, tokens, slots)
        assert n == blocks * BS
        # store: which blocks are held, then the writes; lookup: one; load: one.
        assert (stored - start, looked - stored, trips() - looked) == (2, 1, 1), blocks


@pytest.mark.slow  # a second interpreter
def test_two_processes_share_a_prefix(server):
    """A child process (one serving host) stores a prompt; this one (another host) loads it."""
    prefix = f"hosts-{uuid.uuid4().hex[:8]}:"
    tokens = np.arange(5 * BS) + 7
    child = (
        "import sys, numpy as np; sys.path.insert(0, sys.argv[3]);"
        "import jax.numpy as jnp; from helpers import random_connector_pool;"
        "from jaxkv.connector import KVConnector, RedisStore;"
        "pool = random_connector_pool('mha', 5, size=128, page_size=1, dtype=jnp.float32);"
        " conn = KVConnector(pool, RedisStore(sys.argv[1], key_prefix=sys.argv[2]));"
        f"print(conn.store(pool, np.arange({5 * BS}) + 7, np.arange({5 * BS})))"
    )
    out = run_python("-c", child, server.url, prefix, str(REPO / "tests"), timeout=120)
    assert out.stdout.strip() == "5"
    src = _mha(5)
    dst = connector_pool("mha", size=128, page_size=1, dtype=jnp.float32)
    conn = KVConnector(dst, RedisStore(server.url, key_prefix=prefix))
    assert conn.lookup(tokens) == 5 * BS
    dst, n = conn.load(dst, tokens, np.arange(40, 40 + 5 * BS))
    assert n == 5 * BS
    np.testing.assert_array_equal(
        row_bits(dst, np.arange(40, 40 + 5 * BS)),
        row_bits(src, np.arange(5 * BS)),
    )


# --------------------------------------------------------------------------------------------
# Verification


def test_a_record_failing_verification_is_a_miss_and_is_deleted(server):
    import redis

    pool = _mha(3)
    store = _store(server)
    conn = KVConnector(pool, store)
    tokens = np.arange(3 * BS)
    assert conn.store(pool, tokens, np.arange(3 * BS)) == 3
    keys = conn.block_hashes(tokens)
    client = redis.Redis.from_url(server.url)
    good = client.get(store.key_prefix + keys[1])
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 1
    client.set(store.key_prefix + keys[1], bytes(damaged))
    # A valid record of another block, under this block's key.
    client.set(store.key_prefix + keys[2], client.get(store.key_prefix + keys[0]))
    dst = _mha(4)
    before = row_bits(dst, np.arange(64, 64 + 3 * BS))
    dst, n = conn.load(dst, tokens, np.arange(64, 64 + 3 * BS))
    assert n == BS  # the first block only: the damaged second one ends the prefix
    np.testing.assert_array_equal(row_bits(dst, np.arange(64 + BS, 64 + 3 * BS)), before[BS:])
    assert store.get(keys[2]) is None
    assert store.stats()["verification_failures"] == 2
    assert client.exists(store.key_prefix + keys[1], store.key_prefix + keys[2]) == 0
    # Stored again, the blocks are whole again.
    assert conn.store(pool, tokens, np.arange(3 * BS)) == 2
    assert conn.load(dst, tokens, np.arange(64, 64 + 3 * BS))[1] == 3 * BS


@pytest.mark.parametrize("value", [[b"a list"], b""], ids=["a list", "an empty string"])
def test_a_key_holding_no_record_is_not_promised_and_the_next_store_repairs_it(server, value):
    """A list (another type) or an empty string under a block key: `EXISTS` would say 1 and
    `SET NX` never replaces it, so a lookup would promise a block no load serves, forever."""
    import redis

    pool, dst = _mha(13), _mha(14)
    store = _store(server)
    conn = KVConnector(pool, store)
    tokens = np.arange(3 * BS) + 500
    keys = conn.block_hashes(tokens)
    client = redis.Redis.from_url(server.url)
    assert conn.store(pool, tokens, np.arange(3 * BS)) == 3
    name = store.key_prefix + keys[1]
    client.delete(name)
    if isinstance(value, list):
        client.rpush(name, *value)
    else:
        client.set(name, value)
    assert conn.lookup(tokens) == BS  # the first block only
    dst, n = conn.load(dst, tokens, np.arange(64, 64 + 3 * BS))
    assert n == BS
    assert client.exists(name) == 0  # deleted by the lookup (list) or the load (empty)
    assert store.stats()["verification_failures"] == 1
    assert conn.store(pool, tokens, np.arange(3 * BS)) == 1
    assert conn.lookup(tokens) == 3 * BS
    dst, n = conn.load(dst, tokens, np.arange(64, 64 + 3 * BS))
    assert n == 3 * BS
    np.testing.assert_array_equal(
        row_bits(dst, np.arange(64, 64 + 3 * BS)),
        row_bits(pool, np.arange(3 * BS)),
    )


def test_discard_deletes_the_record_so_the_next_store_writes_it_again(server):
    pool = _mha(15)
    store = _store(server)
    conn = KVConnector(pool, store)
    tokens = np.arange(2 * BS) + 900
    assert conn.store(pool, tokens, np.arange(2 * BS)) == 2
    key = conn.block_hashes(tokens)[1]
    trips = store.stats()["round_trips"]
    assert store.discard(key) is True
    assert store.discard(key) is False  # nothing left to remove
    assert store.stats()["round_trips"] == trips + 2
    assert conn.lookup(tokens) == BS
    assert conn.store(pool, tokens, np.arange(2 * BS)) == 1
    assert conn.lookup(tokens) == 2 * BS
    stats = store.stats()
    assert (stats["discarded"], stats["undiscarded"], stats["io_errors"]) == (1, 0, 0)


# --------------------------------------------------------------------------------------------
# Faults


def _loop_step(conn, pool, dst, step):
    """One store / lookup / load of a fresh prompt; returns `dst`, what lookup and load found,
    and whether the loaded rows are the stored ones."""
    tokens = np.arange(2 * BS) + 1000 * step
    conn.store(pool, tokens, np.arange(2 * BS))
    found = conn.lookup(tokens)
    dst, n = conn.load(dst, tokens, np.arange(64, 64 + 2 * BS))
    exact = np.array_equal(
        row_bits(dst, np.arange(64, 64 + n)),
        row_bits(pool, np.arange(n)),
    )
    return dst, found, n, exact


def test_killed_and_restarted_server_misses_then_recovers_with_no_wrong_data(own_server):
    srv = own_server()
    timeout_s = 0.3
    store = RedisStore(srv.url, timeout_s=timeout_s, retry_after_s=0.1, max_retry_after_s=0.4)
    pool, dst = _mha(6), _mha(7)
    conn = KVConnector(pool, store)
    dst, found, n, exact = _loop_step(conn, pool, dst, 0)
    assert (found, n, exact) == (2 * BS, 2 * BS, True)

    srv.stop()
    for step in range(1, 6):
        before = row_bits(dst, np.arange(64, 128))
        start = time.monotonic()
        dst, found, n, exact = _loop_step(conn, pool, dst, step)
        assert time.monotonic() - start < 3 * timeout_s
        assert (found, n) == (0, 0)
        np.testing.assert_array_equal(row_bits(dst, np.arange(64, 128)), before)
    # An earlier prompt, stored while the server was up, is a miss too (not stale data).
    assert conn.lookup(np.arange(2 * BS)) == 0
    down = store.stats()
    assert down["breaker_trips"] >= 1 and down["dropped"] >= 2 and down["unavailable"] >= 1
    assert down["blocks"] == 0

    srv.start()  # comes back empty, as a restarted cache server does
    # Misses until the breaker's next probe finds the server, then whole hits. Recovered means
    # four whole round trips in a row: on a loaded 2-core machine one 0.3 s timeout can still
    # fire after the restart and reopen the breaker for a moment (a miss, never wrong data).
    deadline, step, in_a_row = time.monotonic() + 20, 10, 0
    while in_a_row < 4 and time.monotonic() < deadline:
        dst, found, n, exact = _loop_step(conn, pool, dst, step)
        assert exact
        step += 1
        in_a_row = in_a_row + 1 if found == n == 2 * BS else 0
    assert in_a_row == 4
    assert store.stats()["blocks"] >= 8  # the four round trips' blocks are all held


def test_a_stopped_server_costs_at_most_the_timeout_then_the_breaker_answers(own_server, caplog):
    srv = own_server()
    timeout_s = 0.3
    store = RedisStore(srv.url, timeout_s=timeout_s, retry_after_s=0.3)
    pool = _mha(8)
    conn = KVConnector(pool, store)
    tokens = np.arange(2 * BS)
    conn.store(pool, tokens, np.arange(2 * BS))
    os.kill(srv.pid, signal.SIGSTOP)  # a server that no longer answers
    try:
        start = time.monotonic()
        assert conn.lookup(tokens) == 0
        first = time.monotonic() - start
        start = time.monotonic()
        assert conn.load(pool, tokens, np.arange(2 * BS))[1] == 0
        second = time.monotonic() - start
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    assert timeout_s * 0.9 < first < timeout_s + 1.0
    assert second < timeout_s / 3  # the breaker is open: no network
    time.sleep(0.7)
    assert conn.lookup(tokens) == 2 * BS  # the probe finds the server back
    assert store.stats()["io_errors"] == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "jaxkv"]
    assert len(logged) == 1 and logged[0].startswith("RedisStore: server call failed (1 so far)")


def test_allkeys_lru_keeps_the_server_within_maxmemory(own_server):
    srv = own_server("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")

    def make():  # 2 KiB per token: 2 MiB per prompt
        return MHAPool.create(
            size=1024, page_size=1, dtype=jnp.float32, head_num=4, head_dim=32, layer_num=2
        )

    pool, dst = fill_random_bits(make(), np.random.default_rng(9)), make()
    store = RedisStore(srv.url)
    conn = KVConnector(pool, store)
    for i in range(4):
        assert conn.store(pool, np.arange(1024) + 10_000 * i, np.arange(1024)) == 64
    stats = store.stats()
    assert stats["blocks_stored"] == 4 * 64
    assert stats["dropped"] == stats["rejected"] == stats["io_errors"] == 0
    assert stats["blocks"] < 4 * 64 and stats["bytes"] <= 5 << 20
    # Whatever the server kept loads bit-exact (its LRU clock is too coarse to say which).
    for i in range(4):
        tokens = np.arange(1024) + 10_000 * i
        dst, n = conn.load(dst, tokens, np.arange(1024))
        assert n == conn.lookup(tokens)
        np.testing.assert_array_equal(
            row_bits(dst, np.arange(n)),
            row_bits(pool, np.arange(n)),
        )


def test_without_redis_py_jaxkv_imports_and_the_store_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` now raises ImportError
    module = importlib.reload(remote_module)
    try:
        with pytest.raises(ImportError, match=r"jaxkv\[redis\]"):
            module.RedisStore("redis://127.0.0.1:1/0")
    finally:
        monkeypatch.undo()
        importlib.reload(remote_module)


URL = "redis://127.0.0.1:1/0"
TIMES = ("timeout_s", "retry_after_s", "max_retry_after_s")


@pytest.mark.parametrize(
    "url,kwargs,error,name",
    [
        (URL, {"timeout_s": 0}, ValueError, "timeout_s"),
        (URL, {"retry_after_s": -1}, ValueError, "retry_after_s"),
        (URL, {"key_prefix": 3}, TypeError, "key_prefix"),
        (URL, {"key_prefix": "jaxkv-\ud800:"}, ValueError, "key_prefix"),
        ("redis://127.0.0.1:1/\ud800", {}, ValueError, "url"),
        (URL + "?decode_responses=True", {}, ValueError, "url"),
        ("http://127.0.0.1:1/0", {}, ValueError, "url"),
        (None, {}, TypeError, "url"),
        (URL, {"retry_after_s": 5, "max_retry_after_s": 1}, ValueError, "max_retry_after_s"),
    ]
    + [
        (URL, {arg: value}, ValueError, arg)
        for arg in TIMES
        for value in (float("inf"), float("-inf"), float("nan"), 1e300, 10**400, 86400.5, True, "1")
    ],
)
def test_bad_arguments_name_themselves(url, kwargs, error, name):
    pytest.importorskip("redis")
    with pytest.raises(error, match=f"^{name}: expected"):
        RedisStore(url, **kwargs)


def test_times_up_to_a_day_are_taken_and_the_longest_wait_follows_the_first():
    pytest.importorskip("redis")
    store = RedisStore(URL, **dict.fromkeys(TIMES, remote_module.MAX_SECONDS))
    assert (store.timeout_s, store.retry_after_s, store.max_retry_after_s) == (86400.0,) * 3
    assert RedisStore(URL, retry_after_s=60).max_retry_after_s == 60  # not below the first
    assert RedisStore(URL).max_retry_after_s == 30
    with pytest.raises(ValueError, match=r"in \(0, 86400\], got inf$"):
        RedisStore(URL, timeout_s=float("inf"))


# --------------------------------------------------------------------------------------------
# A tiered stack over Redis


def test_tiered_host_over_redis_promotes_and_then_reads_host_only(server):
    pool = _mha(10)
    redis_tier = _store(server)
    tokens = np.arange(4 * BS)
    writer = KVConnector(pool, TieredStore(HostStore(1 << 20), redis_tier))
    assert writer.store(pool, tokens, np.arange(4 * BS)) == 4
    # Another host: an empty host tier over the same server.
    host = HostStore(1 << 20)
    stack = TieredStore(host, RedisStore(server.url, key_prefix=redis_tier.key_prefix))
    reader = KVConnector(pool, stack)
    dst = _mha(11)
    dst, n = reader.load(dst, tokens, np.arange(64, 64 + 4 * BS))
    assert n == 4 * BS and len(host) == 4
    remote = stack.tiers[1]
    trips = remote.stats()["round_trips"]
    dst, n = reader.load(dst, tokens, np.arange(64, 64 + 4 * BS))
    assert n == 4 * BS and remote.stats()["round_trips"] == trips
    np.testing.assert_array_equal(
        row_bits(dst, np.arange(64, 64 + 4 * BS)),
        row_bits(pool, np.arange(4 * BS)),
    )
    stats = stack.stats()
    assert stats["promotions"] == 4 and stats["hits"] == 8
    assert [t["hits"] for t in stats["tiers"]] == [4, 4]


def test_records_in_redis_are_the_disk_format(server):
    """The same self-describing bytes as a disk file: any store's reader verifies them."""
    import redis

    pool = _mha(12)
    store = _store(server)
    conn = KVConnector(pool, store)
    tokens = np.arange(BS)
    conn.store(pool, tokens, np.arange(BS))
    key = conn.block_hashes(tokens)[0]
    raw = redis.Redis.from_url(server.url).get(store.key_prefix + key)
    record = _records.decode(raw, key)
    assert record.layout == conn.fingerprint
    assert raw == _records.encode(store.get(key))


def test_damaged_and_discarded_values_are_reported_to_drop_listeners(server, caplog):
    import redis

    store = _store(server)
    drops: list[tuple[str, str]] = []
    store.on_drop(lambda key, reason: drops.append((key, reason)))
    pool = _mha(15)
    conn = KVConnector(pool, store)
    tokens = np.arange(2 * BS) + 900
    keys = conn.block_hashes(tokens)
    assert conn.store(pool, tokens, np.arange(2 * BS)) == 2
    redis.Redis.from_url(server.url).set(store.key_prefix + keys[0], b"not a record")
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        assert store.get(keys[0]) is None
    assert drops == [(keys[0], "damaged")]
    assert f"RedisStore: the record of key {keys[0]} failed verification" in caplog.text
    assert store.discard(keys[1])
    assert drops[-1] == (keys[1], "discarded")
