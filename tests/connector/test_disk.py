"""Disk faults, async failures and the counters: every failure is a counted miss or dropped
write (or, with `strict=True`, an `OSError`), and what `lookup` reports is what `load` serves.

Faults are injected through `DiskStore`'s one file-operations object (`FileOps`): a full disk
(ENOSPC), a read-only or forbidden folder (EROFS, EACCES), a file that vanishes (ENOENT) and a
read error (EIO).
"""

from __future__ import annotations

import errno
import logging
import os
import threading

import numpy as np
import pytest
from helpers import random_mha_pool, raw_rows

from jaxkv import MHAPool
from jaxkv.connector import BlockRecord, DiskStore, HostStore, KVConnector, TieredStore
from jaxkv.connector.disk import FileOps

BS = 16
N_BLOCKS = 4
TOKENS = np.arange(N_BLOCKS * BS) + 7
SLOTS = np.arange(1, N_BLOCKS * BS + 1)


class FaultyOps(FileOps):
    """`FileOps` whose operation `op` fails with `code` on its calls number `after` onwards
    (0-based, counting only that operation), `times` times (None: for good)."""

    def __init__(self):
        self.faults: dict[str, tuple[int, int, int | None]] = {}
        self.calls: dict[str, int] = {}

    def fail(self, op: str, code: int, *, after: int = 0, times: int | None = None) -> None:
        self.faults[op] = (code, after, times)
        self.calls[op] = 0

    def clear(self) -> None:
        self.faults.clear()

    def _check(self, op: str, path: str) -> None:
        if op not in self.faults:
            return
        code, after, times = self.faults[op]
        n = self.calls[op]
        self.calls[op] = n + 1
        if n >= after and (times is None or n < after + times):
            raise OSError(code, os.strerror(code), path)


def _wrap(name):
    def method(self, path, *args):
        self._check(name, path)
        return getattr(FileOps, name)(self, path, *args)

    return method


_OPS = (
    "makedirs",
    "mkdir",
    "write",
    "replace",
    "read",
    "head",
    "listdir",
    "stat",
    "touch",
    "unlink",
)
for _name in _OPS:
    setattr(FaultyOps, _name, _wrap(_name))


def _pool(seed: int = 0) -> MHAPool:
    return random_mha_pool(seed, size=128, head_dim=4, layer_num=2)


def _disk(tmp_path, **kw):
    fs = FaultyOps()
    return DiskStore(tmp_path / "blocks", _fs=fs, **kw), fs


def _kvb_files(root) -> int:
    return sum(f.endswith(".kvb") for _, _, fs in os.walk(root) for f in fs)


def _tmp_files(root) -> int:
    return sum(f.endswith(".tmp") for _, _, fs in os.walk(root) for f in fs)


def _assert_consistent(conn, store, root):
    """Connector, store and folder agree on what was written, and lookup on what load
    serves."""
    st = conn.stats()
    assert st["blocks_stored"] == st["store"]["blocks_stored"]
    assert _kvb_files(root) == len(store)
    n = conn.lookup(TOKENS)
    dst = _pool(9)
    dst, loaded = conn.load(dst, TOKENS, SLOTS + 60)
    assert loaded == n
    src = _pool()
    np.testing.assert_array_equal(raw_rows(dst, SLOTS[:n] + 60), raw_rows(src, SLOTS[:n]))


@pytest.mark.parametrize(
    "op, code",
    [
        ("mkdir", errno.ENOSPC),
        ("write", errno.ENOSPC),
        ("write", errno.EACCES),
        ("replace", errno.EROFS),
    ],
)
def test_a_write_fault_mid_store_is_a_counted_dropped_write(tmp_path, op, code, caplog):
    store, fs = _disk(tmp_path)
    conn = KVConnector(_pool(), store)
    # The first block's folder (and file) succeed, every later one fails.
    fs.fail(op, code, after=1)
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        written = conn.store(_pool(), TOKENS, SLOTS)
    failed = fs.calls[op] - 1
    assert written == N_BLOCKS - failed and failed >= 1
    st = conn.stats()
    assert st["io_errors"] == st["store"]["io_errors"] == failed
    assert _tmp_files(tmp_path) == 0 and _kvb_files(tmp_path) == written
    _assert_consistent(conn, store, tmp_path)
    # One log line per failure class at the 1st, 2nd, 4th... failure, each with its count.
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxkv"]
    assert lines and all("DiskStore: write failed" in line for line in lines)
    assert [int(line.split("(")[1].split()[0]) for line in lines] == [
        n for n in (1, 2, 4, 8) if n <= failed
    ]
    # The disk has room again: the dropped blocks are written by the next store.
    fs.clear()
    assert conn.store(_pool(), TOKENS, SLOTS) == failed
    _assert_consistent(conn, store, tmp_path)
    assert conn.lookup(TOKENS) == N_BLOCKS * BS


def test_strict_store_and_strict_connector_raise_the_io_error(tmp_path):
    store, fs = _disk(tmp_path, strict=True)
    conn = KVConnector(_pool(), store)
    fs.fail("mkdir", errno.ENOSPC, after=2)
    with pytest.raises(OSError) as err:
        conn.store(_pool(), TOKENS, SLOTS)
    assert err.value.errno == errno.ENOSPC
    st = conn.stats()
    assert st["blocks_stored"] == st["store"]["blocks_stored"] == 2 == _kvb_files(tmp_path)
    assert st["io_errors"] == 1

    store, fs = _disk(tmp_path / "b")
    strict = KVConnector(_pool(), store, strict=True)
    fs.fail("read", errno.EIO)
    strict.store(_pool(), TOKENS, SLOTS)
    with pytest.raises(OSError):
        strict.load(_pool(1), TOKENS, SLOTS)
    # The same store behind a lenient connector: a miss, counted.
    lenient = KVConnector(_pool(), store)
    assert lenient.load(_pool(1), TOKENS, SLOTS)[1] == 0
    assert lenient.stats()["misses"] == N_BLOCKS
    assert store.stats()["io_errors"] == 2


def test_a_read_error_ends_the_loaded_prefix_and_is_counted(tmp_path):
    store, fs = _disk(tmp_path)
    conn = KVConnector(_pool(), store)
    assert conn.store(_pool(), TOKENS, SLOTS) == N_BLOCKS
    fs.fail("read", errno.EIO, after=2, times=1)
    dst, n = conn.load(_pool(1), TOKENS, SLOTS)
    assert n == 2 * BS
    st = conn.stats()
    assert (st["hits"], st["misses"], st["io_errors"]) == (2, 2, 1)
    assert st["store"]["misses"] == 1  # the third block's read; the fourth was never asked for
    _assert_consistent(conn, store, tmp_path)  # the read works again: all four served


def test_a_vanished_file_is_a_miss_not_an_error(tmp_path):
    store, fs = _disk(tmp_path)
    conn = KVConnector(_pool(), store)
    conn.store(_pool(), TOKENS, SLOTS)
    assert conn.lookup(TOKENS) == N_BLOCKS * BS
    fs.fail("read", errno.ENOENT, after=1, times=1)  # another process evicted it meanwhile
    dst, n = conn.load(_pool(1), TOKENS, SLOTS)
    assert n == BS
    assert conn.stats()["io_errors"] == 0 and conn.stats()["misses"] == N_BLOCKS - 1


def test_opening_a_folder_whose_files_vanish_does_not_crash(tmp_path):
    store, _ = _disk(tmp_path)
    KVConnector(_pool(), store).store(_pool(), TOKENS, SLOTS)
    fs = FaultyOps()
    fs.fail("stat", errno.ENOENT, after=1)  # listed, then gone before its stat
    reopened = DiskStore(tmp_path / "blocks", _fs=fs)
    assert len(reopened) == 1 and reopened.stats()["io_errors"] == 0
    fs = FaultyOps()
    fs.fail("listdir", errno.EACCES, after=1)  # unreadable subfolders
    reopened = DiskStore(tmp_path / "blocks", _fs=fs)
    assert reopened.stats()["io_errors"] == fs.calls["listdir"] - 1 >= 1


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_file_is_dropped_and_rewritten(tmp_path, damage):
    store, _ = _disk(tmp_path)
    conn = KVConnector(_pool(), store)
    conn.store(_pool(), TOKENS, SLOTS)
    key = conn.block_hashes(TOKENS)[1]
    path = tmp_path / "blocks" / key[:2] / f"{key}.kvb"
    raw = bytearray(path.read_bytes())
    if damage == "truncate":  # a torn write: lookup sees it without reading the payload
        path.write_bytes(bytes(raw[: len(raw) // 2]))
        assert conn.lookup(TOKENS) == BS
    else:  # bit rot: only the checksum sees it, on the first load
        raw[-8] ^= 0x40
        path.write_bytes(bytes(raw))
        assert conn.lookup(TOKENS) == N_BLOCKS * BS
        assert conn.load(_pool(1), TOKENS, SLOTS)[1] == BS
        assert conn.lookup(TOKENS) == BS
    assert not path.exists() and store.stats()["verification_failures"] == 1
    assert conn.store(_pool(), TOKENS, SLOTS) == 1  # rewritten
    _assert_consistent(conn, store, tmp_path)


def test_a_failing_async_write_never_makes_load_raise(tmp_path):
    store, fs = _disk(tmp_path)
    conn = KVConnector(_pool(), store)
    gate = threading.Event()
    original = fs.write

    def slow_failing_write(path, data, fsync):
        gate.wait(10)  # hold the write until load is waiting on it
        raise OSError(errno.ENOSPC, "No space left on device", path)

    fs.write = slow_failing_write
    future = conn.store_async(_pool(), TOKENS, SLOTS)
    assert conn.lookup(TOKENS) == N_BLOCKS * BS  # pending blocks count as stored
    threading.Timer(0.05, gate.set).start()
    dst, n = conn.load(_pool(1), TOKENS, SLOTS)
    assert n == 0
    assert future.result(timeout=10) == 0
    conn.flush()  # dropped writes are counted, not raised
    st = conn.stats()
    assert st["io_errors"] == N_BLOCKS and st["async_failures"] == 0 and st["pending_blocks"] == 0
    fs.write = original
    assert conn.store(_pool(), TOKENS, SLOTS) == N_BLOCKS
    conn.close()


def test_a_strict_tier_raises_through_a_stack_and_what_faster_tiers_stored_counts(tmp_path):
    disk, fs = _disk(tmp_path, strict=True)
    host = HostStore(1 << 20)
    conn = KVConnector(_pool(), TieredStore(host, disk))  # a lenient connector
    fs.fail("mkdir", errno.ENOSPC, after=2)
    with pytest.raises(OSError) as err:
        conn.store(_pool(), TOKENS, SLOTS)
    assert err.value.errno == errno.ENOSPC
    st = conn.stats()
    # The host tier took every block before the disk tier failed on its third.
    assert len(host) == N_BLOCKS and _kvb_files(tmp_path) == 2
    assert st["blocks_stored"] == st["store"]["blocks_stored"] == N_BLOCKS
    assert st["io_errors"] == st["store"]["io_errors"] == 1
    lenient = TieredStore(HostStore(1 << 20), _disk(tmp_path / "b")[0])
    assert not lenient.strict
    lenient.strict = True  # as on any store
    assert lenient.strict and not lenient.tiers[1].strict


def test_strict_async_failure_reaches_flush_but_not_load(tmp_path):
    store, fs = _disk(tmp_path)
    conn = KVConnector(_pool(), store, strict=True)
    fs.fail("write", errno.ENOSPC)
    future = conn.store_async(_pool(), TOKENS, SLOTS)
    assert conn.load(_pool(1), TOKENS, SLOTS)[1] == 0
    with pytest.raises(OSError):
        conn.flush()
    assert isinstance(future.exception(timeout=10), OSError)
    assert conn.stats()["async_failures"] == 1
    conn.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_max_pending_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_pending"):
        KVConnector(_pool(), HostStore(1 << 20), max_pending=bad)


def test_max_pending_takes_numpy_ints():
    conn = KVConnector(_pool(), HostStore(1 << 20), max_pending=np.int64(1))
    assert conn.store_async(_pool(), TOKENS, SLOTS).result(timeout=30) == N_BLOCKS
    conn.close()


def test_a_closed_connector_rejects_new_work_and_starts_no_thread():
    conn = KVConnector(_pool(), HostStore(1 << 20))
    conn.store_async(_pool(), TOKENS[:BS], SLOTS[:BS]).result(timeout=30)
    conn.close()
    before = {t for t in threading.enumerate() if t.name.startswith("jaxkv-store")}
    for call in (conn.store_async, conn.store, conn.load):
        with pytest.raises(RuntimeError, match="closed"):
            call(_pool(), TOKENS, SLOTS)
    after = {t for t in threading.enumerate() if t.name.startswith("jaxkv-store")}
    assert after <= before
    assert conn.lookup(TOKENS) == BS  # reading what is there still answers
    conn.flush()


def test_stores_take_numpy_ints_and_refuse_a_file_as_folder(tmp_path):
    assert HostStore(np.int64(1 << 20), preallocate_bytes=np.int32(0)).capacity_bytes == 1 << 20
    assert DiskStore(tmp_path / "d", np.uint32(1 << 20)).capacity_bytes == 1 << 20
    file = tmp_path / "a_file"
    file.write_bytes(b"x")
    with pytest.raises(ValueError, match="path: expected a folder"):
        DiskStore(file)
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="capacity_bytes"):
            HostStore(bad)
        with pytest.raises(ValueError, match="capacity_bytes"):
            DiskStore(tmp_path / "e", bad)


def test_lookup_and_load_count_apart(tmp_path):
    conn = KVConnector(_pool(), HostStore(1 << 20))
    conn.store(_pool(), TOKENS[: 2 * BS], SLOTS[: 2 * BS])
    assert conn.lookup(TOKENS) == 2 * BS
    conn.load(_pool(1), TOKENS, SLOTS)
    st = conn.stats()
    assert (st["lookups"], st["lookup_hits"], st["lookup_misses"]) == (1, 2, 2)
    assert (st["loads"], st["hits"], st["misses"], st["blocks_loaded"]) == (1, 2, 2, 2)
    assert (st["store"]["hits"], st["store"]["misses"]) == (2, 1)


# --------------------------------------------------------------------------------------------
# What a store promises when it cannot remove a file, and failures after a write landed


def _records(n: int) -> list[BlockRecord]:
    return [
        BlockRecord(f"{i:064x}", "layout", "tokens", {"k": np.full((2, 4), i, np.float32)})
        for i in range(n)
    ]


def _damage_payload(store, key) -> None:
    path = os.path.join(store.path, key[:2], key + ".kvb")
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        byte = f.read(1)
        f.seek(-8, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_damaged_file_that_cannot_be_removed_is_not_promised_again(tmp_path):
    store, fs = _disk(tmp_path)
    (record,) = _records(1)
    assert store.put(record)
    _damage_payload(store, record.key)
    fs.fail("unlink", errno.EACCES)  # a folder where this process may not remove files
    assert store.contains(record.key) is True  # the header and size are whole
    assert store.get(record.key) is None
    st = store.stats()
    assert (st["verification_failures"], st["io_errors"]) == (1, 1)
    assert store.contains(record.key) is False and store.get(record.key) is None
    assert store.put(record) is True  # the rename still replaces it
    np.testing.assert_array_equal(store.get(record.key).parts["k"], record.parts["k"])
    assert store.contains(record.key) is True


@pytest.mark.parametrize("strict", [False, True])
def test_a_discard_that_cannot_remove_the_file_stops_serving_it(tmp_path, strict):
    store, fs = _disk(tmp_path, strict=strict)
    (record,) = _records(1)
    assert store.put(record)
    fs.fail("unlink", errno.EACCES)
    if strict:
        with pytest.raises(PermissionError):
            store.discard(record.key)
    else:
        assert store.discard(record.key) is False
    st = store.stats()
    assert (st["discarded"], st["io_errors"]) == (0, 1)
    assert store.contains(record.key) is False and store.get(record.key) is None
    fs.clear()
    assert store.put(record) is True and store.get(record.key) is not None
    assert store.discard(record.key) is True and store.stats()["discarded"] == 1


@pytest.mark.parametrize("strict", [False, True])
def test_a_failed_eviction_is_not_counted_nor_fails_the_write_that_landed(tmp_path, strict):
    records = _records(4)
    probe = DiskStore(tmp_path / "probe")
    probe.put(records[0])
    size = probe.nbytes
    store, fs = _disk(tmp_path, capacity_bytes=2 * size, strict=strict)
    assert store.put_many(records[:2]) == [True, True]
    fs.fail("unlink", errno.EACCES)
    assert store.put_many(records[2:]) == [True, True]  # each evicts, and removing fails
    st = store.stats()
    assert st["evictions"] == 0 and st["io_errors"] >= 2 and st["blocks_stored"] == 4
    assert _kvb_files(tmp_path / "blocks") == 4
    fs.clear()
    assert store.put(_records(5)[4])  # removals work again: the rescan finds all five files
    assert store.stats()["evictions"] == 3 and _kvb_files(tmp_path / "blocks") == 2


@pytest.mark.parametrize("stored_first", [0, 2])
def test_a_failed_promotion_keeps_the_records_read(tmp_path, stored_first):
    records = _records(4)
    slow = DiskStore(tmp_path / "slow")
    slow.put_many(records)
    fast, fs = _disk(tmp_path / "fast", strict=True)
    fs.fail("mkdir", errno.ENOSPC, after=stored_first)  # the fast disk fills up
    stack = TieredStore(fast, slow)
    got = stack.get_many([r.key for r in records])
    assert [g.key for g in got] == [r.key for r in records]
    st = stack.stats()
    assert st["promotions"] == stored_first == len(fast)
    assert st["io_errors"] == st["tiers"][0]["io_errors"] == 1  # the strict tier stopped there
    assert st["hits"] == 4


def test_a_strict_connector_loads_what_a_failed_promotion_read(tmp_path):
    src = _pool()
    slow = DiskStore(tmp_path / "slow")
    KVConnector(src, slow).store(src, TOKENS, SLOTS)
    fast, fs = _disk(tmp_path / "fast")
    fs.fail("write", errno.ENOSPC)
    conn = KVConnector(src, TieredStore(fast, slow), strict=True)
    dst, n = conn.load(_pool(1), TOKENS, SLOTS + 60)
    assert n == N_BLOCKS * BS
    np.testing.assert_array_equal(raw_rows(dst, SLOTS + 60), raw_rows(src, SLOTS))
    # The strict write stopped at its first failure, counted once (the store's count).
    assert fast.stats()["io_errors"] == conn.stats()["io_errors"] == 1 and len(fast) == 0


def test_a_stack_set_strict_raises_its_tiers_io_errors(tmp_path):
    disk, fs = _disk(tmp_path)
    (record,) = _records(1)
    stack = TieredStore(HostStore(1 << 20), disk)
    disk.put(record)
    fs.fail("read", errno.EIO)
    assert stack.get(record.key) is None  # lenient: a counted miss
    stack.strict = True
    with pytest.raises(OSError) as err:
        stack.get(record.key)
    assert err.value.errno == errno.EIO
    assert disk.stats()["io_errors"] == 2 and not disk.strict  # the tier's own flag is as set


def test_a_stack_discards_from_every_tier_before_raising_a_tiers_error(tmp_path):
    first, fs = _disk(tmp_path / "a", strict=True)
    second = DiskStore(tmp_path / "b")
    (record,) = _records(1)
    stack = TieredStore(first, second)
    assert stack.put(record)
    fs.fail("unlink", errno.EACCES)
    with pytest.raises(PermissionError):
        stack.discard(record.key)
    assert not second.contains(record.key) and not first.contains(record.key)
    assert stack.stats()["discarded"] == 1
