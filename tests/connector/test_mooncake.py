"""`MooncakeStore` against a real `mooncake_master` and a segment holder on loopback ports.

Bit-exact round trips for every pool kind and dtype; one client call per batch; records read
in place into the registered buffer, and a record a reader holds never overwritten; batches
larger than the buffer and objects larger than the store expects; verification (a flipped
bit, another key's record, a cut value: a miss, removed, then written again); `discard`
despite Mooncake's read leases; drop listeners; a tiered stack over Mooncake; the byte form
written in place equal to `_records.encode`'s; arguments checked; the client imported only
when a store is made.

The cluster comes from `tests/mooncake_server.py`. Without Mooncake installed these tests
skip, naming what is missing, except under CI (`CI` set), where they fail. The faults (the
master or a holder killed, memory full, two processes) are in test_mooncake_faults.py.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import uuid

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CONNECTOR_KINDS, connector_pool, fill_random_bits, require, roundtrip
from mooncake_server import MISSING, LocalMooncake

from jaxkv.connector import (
    BlockRecord,
    HostStore,
    KVConnector,
    MooncakeStore,
    TieredStore,
    _records,
)
from jaxkv.connector import _mooncake_buffers as buffers
from jaxkv.connector import mooncake as mooncake_module

MASTER, METADATA = "127.0.0.1:1", "http://127.0.0.1:1/metadata"


def need_mooncake() -> None:
    """Fails under CI, skips elsewhere, when Mooncake is missing."""
    require([] if LocalMooncake.available() else [MISSING], "the Mooncake tests")


@pytest.fixture(scope="module")
def cluster():
    """A master and one holder of 256 MiB, for the tests that only add blocks (each under a
    key prefix of its own)."""
    need_mooncake()
    with LocalMooncake() as mc:
        mc.holder(256 << 20)
        yield mc


@pytest.fixture
def stores(cluster):
    """`stores(**kwargs)` makes a store on the cluster under a fresh key prefix; closed after
    the test."""
    made: list[MooncakeStore] = []

    def make(prefix: str | None = None, **kwargs) -> MooncakeStore:
        prefix = prefix or f"test-{uuid.uuid4().hex[:8]}:"
        made.append(cluster.store(key_prefix=prefix, **kwargs))
        return made[-1]

    yield make
    close_all(made)


def close_all(closeable) -> None:
    """Closes each at once, side by side: a client takes about 1 s to close (its heartbeat's
    period)."""
    threads = [threading.Thread(target=c.close) for c in closeable]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.fixture(scope="module")
def raw(cluster):
    """Mooncake's own client on the cluster, to write values jaxkv never writes."""
    client = cluster.client()
    yield client
    client.close()


def _record(i: int, shape=(2, 16, 64)) -> BlockRecord:
    """A record of random float32 bits under a key of its own (`i`)."""
    rng = np.random.default_rng(i)
    k, v = (rng.integers(0, 2**32, size=shape, dtype=np.uint32).view(np.float32) for _ in "kv")
    return BlockRecord(f"{i:064x}", "layout", "tokens", {"k": k, "v": v})


def _same(got: BlockRecord | None, want: BlockRecord) -> bool:
    return (
        got is not None
        and (got.key, got.layout, got.tokens) == (want.key, want.layout, want.tokens)
        and got.parts.keys() == want.parts.keys()
        and all(
            got.parts[n].dtype == a.dtype
            and np.array_equal(got.parts[n].view(np.uint8), a.view(np.uint8))
            for n, a in want.parts.items()
        )
    )


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize(
    "kind,dtype",
    [(k, jnp.bfloat16) for k in CONNECTOR_KINDS]
    + [("mha", jnp.float32), ("mha", jnp.float8_e5m2), ("nsa", jnp.float8_e4m3fn)],
)
def test_roundtrip_every_pool_kind_and_dtype_is_bit_exact(stores, kind, dtype):
    rng = np.random.default_rng(1)
    src = fill_random_bits(connector_pool(kind, dtype=dtype, page_size=4), rng)
    dst = fill_random_bits(connector_pool(kind, dtype=dtype, page_size=4), rng)
    store = stores()
    conn = KVConnector(src, store)
    roundtrip(src, dst, conn, rng=rng, size=64, page_size=4, n_tokens=3 * conn.block_size + 1)
    stats = store.stats()
    assert stats["verification_failures"] == stats["io_errors"] == stats["dropped"] == 0


def test_each_batch_is_one_client_call(stores):
    store = stores()
    records = [_record(i) for i in range(6)]
    keys = [r.key for r in records]

    def calls(run) -> int:
        before = store.stats()["round_trips"]
        run()
        return store.stats()["round_trips"] - before

    assert calls(lambda: store.put_many(records)) == 2  # which are held, then the writes
    assert calls(lambda: store.contains_many(keys)) == 1
    assert calls(lambda: store.get_many(keys)) == 1
    assert calls(lambda: store.discard_many(keys[:2])) == 1
    assert store.put_many(records).values == [True, True, False, False, False, False]


def test_a_fresh_store_reads_blocks_another_stored_asking_one_size_first(stores):
    writer = stores()
    records = [_record(i) for i in range(4)]
    assert writer.put_many(records).values == [True] * 4
    reader = stores(prefix=writer.key_prefix)
    got = reader.get_many([r.key for r in records]).values
    assert all(_same(g, r) for g, r in zip(got, records))
    assert reader.stats()["round_trips"] == 2  # the first one's size, then the reads


def test_objects_larger_than_expected_and_batches_larger_than_the_buffer(stores):
    writer = stores(buffer_bytes=1 << 20)
    small = [_record(i, shape=(2, 4, 8)) for i in range(3)]
    large = [_record(10 + i, shape=(4, 64, 256)) for i in range(5)]  # 512 KiB each: 2.5 MiB
    assert writer.put_many(small + large).values == [True] * 8
    assert writer.stats()["round_trips"] >= 4  # the writes, in calls of at most 1 MiB
    reader = stores(prefix=writer.key_prefix, buffer_bytes=1 << 20)
    assert all(_same(g, r) for g, r in zip(reader.get_many([r.key for r in small]).values, small))
    got = reader.get_many([r.key for r in small + large]).values  # sized as the small ones
    assert all(_same(g, r) for g, r in zip(got, small + large))


def test_records_are_read_in_place_and_a_held_record_is_never_overwritten(stores):
    store = stores(buffer_bytes=1 << 20)
    records = [_record(i, shape=(2, 16, 128)) for i in range(40)]  # 32 KiB each
    assert all(store.put_many(records).values)
    held = store.get_many([records[0].key]).values[0]
    assert not held.parts["k"].flags.writeable and not held.parts["k"].flags.owndata
    for _ in range(3):  # reads that go round the buffer several times
        for i in range(0, 40, 8):
            got = store.get_many([r.key for r in records[i : i + 8]]).values
            assert all(_same(g, r) for g, r in zip(got, records[i : i + 8]))
    assert _same(held, records[0])


# --------------------------------------------------------------------------------------------
# Verification


def _raw_put(client, name: str, value: bytes) -> None:
    client.remove(name, True)
    assert client.put(name, value) == 0


@pytest.mark.parametrize("damage", ["flipped bit", "another key's record", "cut", "garbage"])
def test_a_damaged_value_is_a_miss_is_removed_and_the_next_store_repairs_it(
    cluster, raw, stores, damage, caplog
):
    store = stores()
    drops: list[tuple[str, str]] = []
    store.on_drop(lambda key, reason: drops.append((key, reason)))
    records = [_record(i) for i in range(3)]
    assert store.put_many(records).values == [True] * 3
    good = _records.encode(records[1])
    value = {
        "flipped bit": good[:100] + bytes([good[100] ^ 1]) + good[101:],
        "another key's record": _records.encode(records[2]),
        "cut": good[: len(good) // 2],
        "garbage": b"not a record at all",
    }[damage]
    name = store.key_prefix + records[1].key
    _raw_put(raw, name, value)
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        got = store.get_many([r.key for r in records], stop_at_miss=True).values
    assert _same(got[0], records[0]) and got[1] is None and got[2] is None
    assert drops == [(records[1].key, "damaged")]
    assert f"MooncakeStore: the record of key {records[1].key}" in caplog.text
    assert name not in cluster.keys()
    assert store.stats()["verification_failures"] == 1
    assert store.put_many(records).values == [False, True, False]
    assert all(
        _same(g, r) for g, r in zip(store.get_many([r.key for r in records]).values, records)
    )


def test_discard_removes_a_block_just_read_and_tells_the_listeners(stores):
    store = stores()
    drops: list[tuple[str, str]] = []
    store.on_drop(lambda key, reason: drops.append((key, reason)))
    record = _record(7)
    assert store.put(record) and _same(store.get(record.key), record)  # now leased to us
    assert store.discard(record.key) is True
    assert store.discard(record.key) is False
    assert store.contains(record.key) is False and store.get(record.key) is None
    assert drops == [(record.key, "discarded")]
    stats = store.stats()
    assert (stats["discarded"], stats["undiscarded"], stats["io_errors"]) == (1, 0, 0)


def test_tiered_host_over_mooncake_promotes_then_reads_host_only(stores):
    records = [_record(i) for i in range(4)]
    writer = stores()
    assert writer.put_many(records).values == [True] * 4
    host, remote = HostStore(1 << 20), stores(prefix=writer.key_prefix)
    stack = TieredStore(host, remote)
    got = stack.get_many([r.key for r in records]).values
    assert all(_same(g, r) for g, r in zip(got, records)) and len(host) == 4
    trips = remote.stats()["round_trips"]
    assert all(
        _same(g, r) for g, r in zip(stack.get_many([r.key for r in records]).values, records)
    )
    assert remote.stats()["round_trips"] == trips


# --------------------------------------------------------------------------------------------
# No server


@pytest.mark.parametrize(
    "record",
    [
        _record(3),
        BlockRecord("ab" * 32, "L" * 300, "t", {"kv": np.arange(24, dtype=np.uint16)[::2]}),
        BlockRecord("cd" * 32, "L", "t", {"k": np.zeros((0, 4), np.float32)}),
    ],
    ids=["two parts", "strided part", "empty part"],
)
def test_the_byte_form_written_in_place_is_the_record_format(record):
    head = buffers.header(record)
    out = np.full(buffers.encoded_size(head, record), 0xAA, np.uint8)
    buffers.write(record, head, out)
    assert out.tobytes() == _records.encode(record)


URLS = [
    ({"master": "localhost"}, ValueError, "master"),
    ({"master": "host:0"}, ValueError, "master"),
    ({"master": 50051}, TypeError, "master"),
    ({"metadata": ""}, ValueError, "metadata"),
    ({"metadata": None}, TypeError, "metadata"),
    ({"local_hostname": " "}, ValueError, "local_hostname"),
    ({"protocol": "tpc"}, ValueError, "protocol"),
    ({"segment_bytes": -1}, ValueError, "segment_bytes"),
    ({"segment_bytes": 1.5}, ValueError, "segment_bytes"),
    ({"segment_bytes": 1 << 20}, ValueError, "segment_bytes"),
    ({"buffer_bytes": 1000}, ValueError, "buffer_bytes"),
    ({"timeout_s": 0}, ValueError, "timeout_s"),
    ({"timeout_s": float("nan")}, ValueError, "timeout_s"),
    ({"key_prefix": 3}, TypeError, "key_prefix"),
]


@pytest.mark.parametrize("kwargs,error,name", URLS)
def test_bad_arguments_name_themselves(kwargs, error, name):
    args = {"master": MASTER, "metadata": METADATA, **kwargs}
    with pytest.raises(error, match=f"^{name}: expected"):
        MooncakeStore(args.pop("master"), **args)


def test_without_mooncake_jaxkv_imports_and_the_store_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)  # `import mooncake...` now fails
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    module = importlib.reload(mooncake_module)
    try:
        with pytest.raises(ImportError, match=r"jaxkv\[mooncake\]"):
            module.MooncakeStore(MASTER, metadata=METADATA)
    finally:
        monkeypatch.undo()
        importlib.reload(mooncake_module)


# --------------------------------------------------------------------------------------------
# The bench's rows


def test_the_bench_measures_mooncake_beside_its_client_and_leaves_nothing(cluster):
    import jax

    from jaxkv import bench
    from jaxkv.bench import _remote

    setting = bench.Setting(bench.TINY, jax.default_backend(), mooncake=cluster.spec)
    before = set(cluster.keys())
    res = _remote.measure(setting)
    assert [r["blocks"] for r in res["rows"] if r["tier"] == "mooncake"] == [1, 4]
    assert [r["contender"] for r in res["mooncake_client"]] == ["store", "from/into", "bytes"]
    assert all(r["store_GBps"] > 0 and r["load_GBps"] > 0 for r in res["mooncake_client"])
    assert set(cluster.keys()) == before
    assert _remote.mooncake_problem("mooncake://127.0.0.1:1") is not None  # no metadata
