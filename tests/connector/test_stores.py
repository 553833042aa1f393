"""What every store does through the `BlockStore` interface: concurrent stores and loads through
one connector, flags checked rather than taken from truthiness, and `discard`'s default for a
store that cannot remove records.
"""

from __future__ import annotations

import logging
import sys
import threading

import numpy as np
import pytest
from helpers import (
    STORE_BLOCK_SIZE,
    assert_rows,
    block_key,
    random_mha_pool,
    raw_rows,
    record_path,
    small_record,
    token_seq,
)

from jaxkv import MHAPool
from jaxkv.connector import (
    BlockRecord,
    BlockStore,
    DiskStore,
    HostStore,
    KVConnector,
    TieredStore,
)

BS = STORE_BLOCK_SIZE  # the blocks of token_seq

# --------------------------------------------------------------------------------------------
# Thread safety (both stores, through one connector)


@pytest.fixture(params=("host", "disk"))
def any_store(request, tmp_path):
    return HostStore(1 << 20) if request.param == "host" else DiskStore(tmp_path / "kv")


def test_concurrent_store_and_load_through_one_connector(any_store):
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the threads as much as possible
    try:
        _concurrent_store_and_load(any_store)
    finally:
        sys.setswitchinterval(switch)


def _concurrent_store_and_load(store):
    n_threads, rounds = 4, 3
    src = random_mha_pool(size=128, layer_num=2)
    conn = KVConnector(src, store)
    src_slots = np.arange(1, 65)
    want = raw_rows(src, src_slots)
    shared = np.arange(64) + 777_000  # every thread stores and loads this one too
    start = threading.Barrier(n_threads)
    written, loaded, errors = [], [], []
    lock = threading.Lock()

    def worker(t: int):
        try:
            rng = np.random.default_rng(t)
            dst = MHAPool.create(size=128, dtype=np.float32, head_num=1, head_dim=2, layer_num=2)
            start.wait()
            for r in range(rounds):
                own = token_seq(10 * t + r, blocks=4)
                for tokens in (shared, own):
                    w = conn.store(src, tokens, src_slots)
                    dst_slots = rng.permutation(np.arange(1, 129))[:64]
                    dst, n = conn.load(dst, tokens, dst_slots)
                    assert n == 64
                    assert_rows(dst, dst_slots, want)
                    with lock:
                        written.append(w)
                        loaded.append(n // BS)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    distinct = 4 * (1 + n_threads * rounds)
    st = conn.stats()
    assert sum(written) == distinct == st["blocks_stored"]
    assert sum(loaded) == st["blocks_loaded"] == 4 * 2 * n_threads * rounds
    ss = store.stats()
    assert ss["blocks"] == ss["blocks_stored"] == distinct
    assert ss["hits"] == ss["blocks_loaded"] == st["blocks_loaded"]
    assert ss["verification_failures"] == ss["io_errors"] == ss["evictions"] == 0
    block_bytes = 2 * BS * (2 + 2) * 4  # layers * tokens * (K + V floats) * 4 bytes
    assert st["bytes_stored"] == ss["bytes_stored"] == distinct * block_bytes


# --------------------------------------------------------------------------------------------
# Flags and arguments are checked, never taken from truthiness


@pytest.mark.parametrize("bad", ["no", "yes", 0, 1, None, [False]])
def test_store_flags_must_be_bools(tmp_path, bad):
    for name in ("strict", "fsync"):
        with pytest.raises(TypeError, match=name):
            DiskStore(tmp_path / "d", **{name: bad})
    disk, host = DiskStore(tmp_path / "d"), HostStore(1 << 20, preallocate_bytes=0)
    stack = TieredStore(host, disk)
    for store, name in ((disk, "strict"), (disk, "fsync"), (host, "strict"), (stack, "strict")):
        with pytest.raises(TypeError, match=name):
            setattr(store, name, bad)
        assert getattr(store, name) is False  # unchanged
    for store in (host, stack):
        for call in (store.contains_many, store.get_many):
            with pytest.raises(TypeError, match="stop_at_miss"):
                call([block_key(1)], stop_at_miss=bad)


# --------------------------------------------------------------------------------------------
# discard: the default of a store that cannot remove records


def test_a_store_without_discard_counts_the_call():
    class Minimal(BlockStore):
        def contains(self, key):
            return False

        def get(self, key):
            return None

        def put(self, record):
            return False

        def __len__(self):
            return 0

    store = Minimal()
    assert store.discard(block_key(1)) is False
    assert store.stats()["undiscarded"] == 1 and store.stats()["discarded"] == 0


# --------------------------------------------------------------------------------------------
# A write that fails part way: what landed is reported, counted and found


class _FailingThird(BlockStore):
    """Holds records in a dict; its third `put` ever raises `error`."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error
        self.records: dict[str, object] = {}
        self.puts = 0

    def contains(self, key):
        return key in self.records

    def get(self, key):
        return self.records.get(key)

    def put(self, record):
        self.puts += 1
        if self.puts == 3:
            raise self.error
        if record.key in self.records:
            return False
        self.records[record.key] = record
        return True

    def __len__(self):
        return len(self.records)


@pytest.mark.parametrize("error", [OSError(28, "No space left"), RuntimeError("bug")])
@pytest.mark.parametrize("how", ["store", "store_async"])
def test_a_write_failing_on_its_third_block_reports_the_two_that_landed(error, how):
    src = random_mha_pool(size=64, layer_num=1)
    store = _FailingThird(error)
    tokens = token_seq(1, blocks=3)
    with KVConnector(src, store) as conn:
        call = getattr(conn, how)
        got = call(src, tokens, np.arange(1, 3 * BS + 1))
        n = got if how == "store" else got.result()
        assert n == 2
        stats = conn.stats()
        assert stats["blocks_stored"] == 2 and stats["records_stored"] == 2
        assert stats["io_errors"] == 1
        assert conn.lookup(tokens) == 2 * BS == len(store) * BS


@pytest.mark.parametrize("error", [OSError(28, "No space left"), RuntimeError("bug")])
def test_a_strict_write_failing_part_way_raises_and_counts_what_landed(error):
    src = random_mha_pool(size=64, layer_num=1)
    store = _FailingThird(error)
    tokens = token_seq(2, blocks=3)
    with KVConnector(src, store, strict=True) as conn:
        with pytest.raises(OSError, match="No space left|RuntimeError: bug"):
            conn.store(src, tokens, np.arange(1, 3 * BS + 1))
        assert conn.stats()["blocks_stored"] == 2
        assert conn.lookup(tokens) == 2 * BS
        # The next store writes the block that failed, and only that one.
        assert conn.store(src, tokens, np.arange(1, 3 * BS + 1)) == 1
        assert conn.lookup(tokens) == 3 * BS


def test_put_many_of_a_plain_store_lists_each_records_answer_and_the_failure():
    store = _FailingThird(OSError(5, "I/O error"))
    records = [small_record(block_key(i), i) for i in range(4)]
    result = store.put_many(records, strict=False)
    assert result.values == [True, True, False, True]
    assert [str(e) for e in result.errors] == ["[Errno 5] I/O error"]
    assert store.stats()["io_errors"] == 1
    store = _FailingThird(OSError(5, "I/O error"))
    result = store.put_many(records, strict=True)  # stops at the failure
    assert result.values == [True, True, False, False] and len(result.errors) == 1
    assert len(store) == 2


# --------------------------------------------------------------------------------------------
# on_drop: every record a store stops holding is reported, with its reason


class _Drops:
    def __init__(self, store: BlockStore):
        self.seen: list[tuple[str, str]] = []
        self.remove = store.on_drop(lambda key, reason: self.seen.append((key, reason)))


def test_host_store_reports_evictions_and_discards():
    records = [small_record(block_key(i), i, n=64) for i in range(3)]  # 256 bytes each
    store = HostStore(2 * 256, preallocate_bytes=0)
    drops = _Drops(store)
    assert store.put_many(records).values == [True, True, True]
    assert drops.seen == [(block_key(0), "evicted")]
    assert store.discard(block_key(2))
    assert drops.seen[-1] == (block_key(2), "discarded")
    drops.remove()
    drops.remove()  # harmless twice
    assert store.discard(block_key(1))
    assert len(drops.seen) == 2


def test_disk_store_reports_damaged_evicted_and_discarded_records(tmp_path, caplog):
    records = [small_record(block_key(i), i, n=64) for i in range(3)]
    store = DiskStore(tmp_path / "kv")
    drops = _Drops(store)
    store.put_many(records[:2])
    path = record_path(store.path, block_key(0))
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        assert store.get(block_key(0)) is None
        store.put(records[0])  # written again
        open(path, "wb").write(bytes(data))
        assert store.get(block_key(0)) is None
    assert drops.seen == [(block_key(0), "damaged")] * 2
    logged = [r.getMessage() for r in caplog.records if block_key(0) in r.getMessage()]
    assert len(logged) == 1, logged  # once per key
    assert logged[0].startswith(f"DiskStore: the record of key {block_key(0)} in {path}")
    assert "checksum" in logged[0] and logged[0].endswith("removed")
    assert store.discard(block_key(1))
    assert drops.seen[-1] == (block_key(1), "discarded")
    small = DiskStore(tmp_path / "small", capacity_bytes=2 * len(data) + 10)
    drops = _Drops(small)
    small.put_many(records)
    assert drops.seen == [(block_key(0), "evicted")]


def test_a_tiered_store_passes_its_tiers_drops_on(tmp_path):
    host = HostStore(256, preallocate_bytes=0)
    stack = TieredStore(host, DiskStore(tmp_path / "kv"))
    drops = _Drops(stack)
    stack.put_many([small_record(block_key(i), i, n=64) for i in range(2)])
    assert drops.seen == [(block_key(0), "evicted")]
    assert stack.discard(block_key(1))
    assert sorted(set(drops.seen[1:])) == [(block_key(1), "discarded")]


def test_a_failing_drop_listener_is_logged_and_the_store_goes_on(caplog):
    store = HostStore(256, preallocate_bytes=0)

    def broken(key, reason):
        raise KeyError(key)

    store.on_drop(broken)
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        assert store.put_many([small_record(block_key(i), i, n=64) for i in range(2)]).values == [
            True,
            True,
        ]
    assert "drop listener failed" in caplog.text
    with pytest.raises(TypeError, match="listener: expected a callable, got int"):
        store.on_drop(3)


def test_the_connector_logs_a_refused_record_once_with_its_key_store_and_reason(caplog):
    src = random_mha_pool(size=64, layer_num=1)
    store = HostStore(1 << 20)
    conn = KVConnector(src, store)
    tokens = token_seq(3, blocks=1)
    conn.store(src, tokens, np.arange(1, BS + 1))
    key = conn.block_hashes(tokens)[0]
    wrong = store.get(key)
    forged = BlockRecord(key=key, layout=wrong.layout, tokens="0" * 64, parts=dict(wrong.parts))
    dst = random_mha_pool(size=64, layer_num=1, seed=5)
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        for _ in range(2):
            store.discard(key)
            store.put(forged)
            dst, n = conn.load(dst, tokens, np.arange(1, BS + 1))
            assert n == 0
    logged = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert logged == [
        f"KVConnector: the record of key {key} served by HostStore holds other token ids "
        "than its key names; HostStore discarded it"
    ]
    assert conn.stats()["verification_failures"] == 2
