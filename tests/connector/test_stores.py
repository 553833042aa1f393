"""Store tests: the stores of the block connector and their `stats`.

`HostStore`: least-recently-used eviction by bytes, records isolated from their callers,
memory mapped up front and reused (a fresh store copies into touched memory, never into fresh
allocations), segments kept without a copy, capacity bounding all the memory it holds, thread
safety. `DiskStore`: persistence across instances and processes, atomic writes, eviction,
and verification: no damaged, truncated or misplaced record file is ever loaded.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import socket
import stat
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    REPO,
    STORE_BLOCK_SIZE,
    assert_rows,
    random_mha_pool,
    raw_rows,
    run_python,
    token_seq,
)

import jaxkv.connector.disk as disk_module
from jaxkv import MHAPool
from jaxkv.connector import BlockRecord, BlockStore, DiskStore, HostStore, KVConnector, TieredStore
from jaxkv.connector._records import Segment, is_block_of

BS = STORE_BLOCK_SIZE  # the blocks of token_seq

# --------------------------------------------------------------------------------------------
# Helpers; the pools are `random_mha_pool`s (float32, 1 layer, 1 head of 2 dims: 256-byte blocks)


def _files(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
    )


def _record_path(root, key: str) -> str:
    return os.path.join(root, key[:2], key + ".kvb")


# --------------------------------------------------------------------------------------------
# HostStore


def _record(key: str, value: float, n: int = 4) -> BlockRecord:
    return BlockRecord(
        key=key, layout="L", tokens="T", parts={"k": np.full((1, n), value, np.float32)}
    )


def _fill_lent(store: HostStore, count: int, value: float):
    """`count` records of arena memory `store` lends (`lend`), filled with `value`."""
    lent = store.lend({"k": ((1, 4), np.float32)}, count)
    assert lent is not None
    arrays, reservation = lent
    records = []
    for i, parts in enumerate(arrays):
        parts["k"][...] = value + i
        records.append(BlockRecord(key=f"lent{value}-{i}", layout="L", tokens="T", parts=parts))
    return records, reservation


def test_host_store_keeps_lent_memory_it_filled_without_a_copy(monkeypatch):
    """The connector copies CPU pool rows straight into memory the store lends: a record whose
    parts are those very arrays is kept as it is, read-only, with nothing copied."""
    import jaxkv.connector.host as stores_module

    store = HostStore(1 << 12)
    records, reservation = _fill_lent(store, 2, 5.0)
    monkeypatch.setattr(stores_module, "_copy_into", None)  # a copy would raise TypeError
    assert store.put_many(records) == [True, True]
    reservation.release()  # nothing left to give back
    for i, record in enumerate(records):
        got = store.get(record.key)
        assert np.shares_memory(got.parts["k"], record.parts["k"])
        assert not got.parts["k"].flags.writeable
        np.testing.assert_array_equal(got.parts["k"], np.full((1, 4), 5.0 + i, np.float32))
    # A record of other arrays (here a copy of lent memory) is copied as any other.
    monkeypatch.undo()
    other = dataclasses.replace(records[0], key="copy", parts={"k": records[0].parts["k"] + 0})
    assert store.put(other) and not np.shares_memory(store.get("copy").parts["k"], other.parts["k"])


def test_host_store_takes_back_lent_memory_no_put_kept():
    """Lent memory counts against the capacity until it is put or released: an abandoned
    store or a duplicate key gives it back, and later records fit without evicting."""
    record_bytes = 16
    store = HostStore(4 * record_bytes, preallocate_bytes=4 * record_bytes)
    records, reservation = _fill_lent(store, 4, 1.0)
    assert store.lend({"k": ((1, 4), np.float32)}, 1) is None  # all of it is lent out
    del records  # abandoned: nothing was put (memory a caller still holds is never reused)
    reservation.release()
    assert len(store) == 0 and store.memory_bytes == 4 * record_bytes
    assert store.put(_record("lent2.0-0", 9.0))
    records, reservation = _fill_lent(store, 2, 2.0)
    assert store.put_many(records) == [False, True]  # the first key was already there
    del records
    reservation.release()  # the duplicate's memory comes back...
    assert store.put(_record("a", 3.0)) and store.put(_record("b", 4.0))  # ...so both fit
    assert len(store) == 4 and store.memory_bytes == 4 * record_bytes
    np.testing.assert_array_equal(store.get("lent2.0-0").parts["k"], np.full((1, 4), 9.0))
    np.testing.assert_array_equal(store.get("lent2.0-1").parts["k"], np.full((1, 4), 3.0))


def test_host_store_capacity_must_be_positive():
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="capacity_bytes"):
            HostStore(bad)


def test_host_store_evicts_least_recently_used_by_bytes():
    pool = random_mha_pool()
    slots = np.arange(1, BS + 1)
    probe = HostStore(1 << 20)
    KVConnector(pool, probe).store(pool, token_seq(0), slots)
    block = probe.stats()["bytes"]
    assert block == 2 * BS * 2 * 4  # K and V, 16 tokens, 2 float32 each

    store = HostStore(3 * block + block // 2)  # room for 3 blocks
    conn = KVConnector(pool, store)
    a, b, c, d, e = (token_seq(i) for i in range(5))
    for seq in (a, b, c):
        assert conn.store(pool, seq, slots) == 1
    assert store.stats()["evictions"] == 0
    assert conn.lookup(a) == BS  # order now b, c, a
    assert conn.store(pool, d, slots) == 1  # evicts b
    st = store.stats()
    assert st["evictions"] == 1 and st["blocks"] == 3 and st["bytes"] == 3 * block
    fresh = random_mha_pool(1)
    fresh, n = conn.load(fresh, c, slots)  # a get refreshes c: order a, d, c
    assert n == BS
    assert conn.store(pool, e, slots) == 1  # evicts a
    held = {name: conn.lookup(seq) == BS for name, seq in dict(a=a, b=b, c=c, d=d, e=e).items()}
    assert held == {"a": False, "b": False, "c": True, "d": True, "e": True}
    st = store.stats()
    assert st["evictions"] == 2 and st["blocks"] == 3 and st["bytes"] <= store.capacity_bytes


def test_host_store_evicts_as_many_blocks_as_a_new_one_needs():
    store = HostStore(100)
    for i in range(6):
        assert store.put(_record(f"{i:064x}", i))  # 16 bytes each
    # 80 more bytes: 96 + 80 - 100 = 76 must go, which takes the 5 oldest records.
    assert store.put(BlockRecord("f" * 64, "L", "T", {"k": np.zeros((1, 20), np.float32)}))
    st = store.stats()
    assert st["bytes"] == 96 and st["evictions"] == 5 and st["blocks"] == 2
    assert [store.contains(f"{i:064x}") for i in range(6)] == [False] * 5 + [True]
    assert store.contains("f" * 64)


def test_host_store_rejects_a_record_larger_than_its_capacity():
    store = HostStore(15)
    assert not store.put(_record("a" * 64, 1.0))
    assert store.stats()["rejected"] == 1 and len(store) == 0


def test_host_store_records_are_isolated_and_read_only():
    store = HostStore(1 << 10)
    record = _record("a" * 64, 1.0)
    assert store.put(record)
    assert not store.put(_record("a" * 64, 2.0))  # already held: not replaced
    record.parts["k"][...] = 7.0  # the caller's arrays are not the store's
    got = store.get("a" * 64)
    np.testing.assert_array_equal(got.parts["k"], np.ones((1, 4), np.float32))
    assert not got.parts["k"].flags.writeable
    with pytest.raises(ValueError):
        got.parts["k"][0, 0] = 3.0


def test_host_store_keeps_a_returned_record_intact_after_eviction():
    store = HostStore(32)  # room for two 16-byte records
    assert store.put(_record("a" * 64, 1.0))
    held = store.get("a" * 64)
    view = held.parts["k"][0]
    for i in range(4):  # evicts "a"; its bytes stay reserved (and counted) while it is held
        assert store.put(_record(f"{i + 1:064x}", 10.0 + i))
    assert not store.contains("a" * 64)
    np.testing.assert_array_equal(held.parts["k"], np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(view, np.ones(4, np.float32))
    assert len(store) == 1 and store.memory_bytes <= store.capacity_bytes
    np.testing.assert_array_equal(
        store.get(f"{4:064x}").parts["k"], np.full((1, 4), 13.0, np.float32)
    )
    del held, view
    for i in (5, 6):  # the reader let go: its bytes are reused and two records fit again
        assert store.put(_record(f"{i:064x}", 10.0 + i))
    assert len(store) == 2 and store.stats()["evictions"] == 5
    for i in (5, 6):  # records placed in recycled memory hold their own values
        np.testing.assert_array_equal(
            store.get(f"{i:064x}").parts["k"], np.full((1, 4), 10.0 + i, np.float32)
        )


def test_host_store_stats_counters():
    store = HostStore(64)
    assert store.get("0" * 64) is None
    assert store.put(_record("a" * 64, 1.0)) and store.put(_record("b" * 64, 2.0))
    assert not store.put(_record("a" * 64, 1.0))
    assert store.get("a" * 64) is not None
    assert store.contains("b" * 64) and not store.contains("c" * 64)
    for i in range(3):
        store.put(_record(f"{i + 1:064x}", 3.0))
    st = store.stats()
    want = {
        "hits": 1,
        "misses": 1,
        "blocks_stored": 5,
        "bytes_stored": 80,
        "blocks_loaded": 1,
        "bytes_loaded": 16,
        "verification_failures": 0,
        "evictions": 1,
        "io_errors": 0,
        "rejected": 0,
        "blocks": 4,
        "bytes": 64,
    }
    assert {k: st[k] for k in want} == want


def test_host_store_preallocate_bytes_must_fit_the_capacity():
    for bad in (-1, 1.5, True, (1 << 20) + 1):
        with pytest.raises(ValueError, match="preallocate_bytes"):
            HostStore(1 << 20, preallocate_bytes=bad)
    assert HostStore(1 << 20, preallocate_bytes=0).memory_bytes == 0
    assert HostStore(1 << 20, preallocate_bytes=1 << 20).memory_bytes == 1 << 20


def test_host_store_maps_a_bounded_arena_up_front_and_grows_in_chunks():
    huge = HostStore(1 << 40)  # a terabyte of capacity maps 256 MiB now, not a terabyte
    assert huge.memory_bytes == 256 << 20
    del huge
    lazy = HostStore(1 << 40, preallocate_bytes=0)
    assert lazy.memory_bytes == 0
    assert lazy.put(_record("a" * 64, 1.0))
    assert lazy.memory_bytes == 64 << 20  # one chunk, touched when mapped
    small = HostStore(1000)  # capacities under a chunk map exactly the capacity
    assert small.memory_bytes == 1000


def _arena_ranges(store) -> list[tuple[int, int]]:
    out = []
    for chunk in store._chunks.values():
        start = np.frombuffer(chunk.mem, np.uint8).ctypes.data
        out.append((start, start + chunk.nbytes))
    return out


def test_host_store_copies_into_its_arena_without_fresh_allocations():
    block = 1 << 14
    records = [
        BlockRecord(f"{i:064x}", "L", "T", {"k": np.full((4, block // 16), i, np.float32)})
        for i in range(64)
    ]
    for capacity in (16 * block, 64 * block):  # cold (empty) and evicting at capacity
        store = HostStore(capacity, preallocate_bytes=capacity)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for record in records:
                assert store.put(record)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        # Python objects only (dicts, views): far below one copy of the records' bytes.
        assert grown < len(records) * block // 8, grown
        assert store.memory_bytes == capacity  # the arena did not grow
        ranges = _arena_ranges(store)
        for i in range(64 - capacity // block, 64):
            got = store.get(f"{i:064x}").parts["k"]
            np.testing.assert_array_equal(got, records[i].parts["k"])
            assert not got.flags.writeable
            assert any(
                lo <= got.ctypes.data and got.ctypes.data + got.nbytes <= hi for lo, hi in ranges
            )


def test_host_store_reuses_evicted_bytes_in_place():
    store = HostStore(3 * 64, preallocate_bytes=3 * 64)
    addresses = set()
    for i in range(12):
        assert store.put(_record(f"{i:064x}", float(i), n=16))  # 64-byte records
        addresses.add(store.get(f"{i:064x}").parts["k"].ctypes.data)
    assert len(addresses) == 3 and store.stats()["evictions"] == 9


def test_host_store_memory_stays_within_capacity_under_mixed_sizes_and_readers():
    rng = np.random.default_rng(9)
    capacity = 4096
    store = HostStore(capacity, preallocate_bytes=0)
    held: dict[str, tuple[BlockRecord, float]] = {}
    for i in range(600):
        n = int(rng.choice([4, 16, 40, 100]))
        key = f"{i:064x}"
        stored = store.put(_record(key, float(i), n=n))
        assert store.memory_bytes <= capacity and store.nbytes <= capacity
        if stored and rng.random() < 0.2:
            held[key] = (store.get(key), float(i))
        if held and rng.random() < 0.3:
            held.pop(next(iter(held)))  # the oldest reader lets go
        for record, value in held.values():  # what readers hold is never overwritten
            assert np.all(record.parts["k"] == value)
    st = store.stats()
    assert st["evictions"] > 100 and st["blocks"] == len(store)


def _segment(n_blocks: int, value: float = 0.0, width: int = 4) -> Segment:
    """A segment of numpy memory standing in for a pinned transfer's output."""
    k = np.arange(n_blocks * width, dtype=np.float32).reshape(n_blocks, 1, width) + value
    host = k.copy()
    host.flags.writeable = False
    return Segment({"k": k}, {"k": host})


def _segment_records(segment: Segment, first_key: int) -> list[BlockRecord]:
    return [
        BlockRecord(f"{first_key + j:064x}", "L", "T", {"k": segment.host["k"][j]}, (segment, j))
        for j in range(segment.blocks)
    ]


def test_host_store_keeps_segments_without_copying_and_counts_them_whole():
    store = HostStore(200, preallocate_bytes=0)
    first = _segment(4)  # 4 blocks of 16 bytes: 64 bytes
    for record in _segment_records(first, 0):
        assert store.put(record)
    assert store.memory_bytes == first.nbytes == 64  # no arena, no copy
    for j in range(4):
        got = store.get(f"{j:064x}")
        assert got.parts["k"].ctypes.data == first.host["k"][j].ctypes.data
        assert got.source[0] is first and not got.parts["k"].flags.writeable
    second = _segment(8, value=100.0)  # 128 bytes: 64 + 128 fits in 200
    records = _segment_records(second, 10)
    assert store.put(records[0])
    assert store.memory_bytes == 64 + 128
    third = _segment(4, value=200.0)  # 64 more: the oldest blocks go until `first` is gone
    assert store.put(_segment_records(third, 30)[0])
    st = store.stats()
    assert st["evictions"] == 4 and store.memory_bytes == 128 + 64
    assert not any(store.contains(f"{j:064x}") for j in range(4))
    assert store.contains(f"{10:064x}") and store.contains(f"{30:064x}")


def test_a_record_checked_as_its_segments_block_is_checked_again_when_its_parts_change(
    monkeypatch,
):
    segment = _segment(2)
    record = _segment_records(segment, 0)[1]
    checks = []
    holds = Segment.holds
    monkeypatch.setattr(Segment, "holds", lambda *a: checks.append(1) or holds(*a))
    assert is_block_of(record) and is_block_of(record)
    assert len(checks) == 1, "the second answer is remembered"
    record.parts["k"] = segment.host["k"][0]  # the mapping is the caller's: now block 0
    assert not is_block_of(record)
    record.parts["k"] = segment.host["k"][1]  # another array object of the same block
    assert is_block_of(record)
    record.parts["v"] = record.parts.pop("k")  # the same array under another name
    assert not is_block_of(record)
    record.parts["k"] = record.parts.pop("v")
    assert is_block_of(record) and len(checks) == 4
    copied = copy.deepcopy(record)  # other memory, claiming the same block
    assert "_block_parts" not in copied.__dict__ and not is_block_of(copied)


def test_host_store_copies_a_record_whose_source_is_not_its_memory():
    store = HostStore(1 << 10, preallocate_bytes=1 << 10)
    segment = _segment(2)
    other = np.ones((1, 4), np.float32)  # claims block 0 of `segment`, holds other bytes
    record = BlockRecord("a" * 64, "L", "T", {"k": other}, (segment, 0))
    assert store.put(record)
    got = store.get("a" * 64)
    assert got.source is None and store.memory_bytes == 1 << 10
    np.testing.assert_array_equal(got.parts["k"], other)
    # Memory of the segment that is not exactly the block it names: the next block, a
    # view starting where the block starts but striding differently, a shorter view. Each
    # goes to a fresh store with room for the segment, which would keep the segment if the
    # record were its block.
    host = segment.host["k"]
    for key, part, index in (
        ("b", host[1], 0),
        ("c", np.lib.stride_tricks.as_strided(host, (1, 4), (16, 8), writeable=False), 0),
        ("d", host[0][:, :2], 0),
        ("e", host[0], 2),
    ):
        store = HostStore(1 << 10, preallocate_bytes=0)
        assert store.put(BlockRecord(key * 64, "L", "T", {"k": part}, (segment, index)))
        got = store.get(key * 64)
        assert got.source is None and got.parts["k"].ctypes.data != part.ctypes.data
        np.testing.assert_array_equal(got.parts["k"], part)
    too_big = _segment(100)  # a segment larger than the capacity: its block is copied
    assert store.put(_segment_records(too_big, 5)[0])
    assert store.get(f"{5:064x}").source is None


# --------------------------------------------------------------------------------------------
# Thread safety (both stores, through one connector)


@pytest.fixture(params=("host", "disk"))
def any_store(request, tmp_path):
    return HostStore(1 << 24) if request.param == "host" else DiskStore(tmp_path / "kv")


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
# DiskStore: persistence, atomic writes, eviction


def test_disk_store_capacity_must_be_positive_or_none(tmp_path):
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="capacity_bytes"):
            DiskStore(tmp_path, capacity_bytes=bad)
    DiskStore(tmp_path, capacity_bytes=None)


def test_disk_store_persists_across_instances(tmp_path):
    src = random_mha_pool(size=128, layer_num=2)
    slots = np.arange(5, 69)
    tokens = token_seq(3, blocks=4)
    conn = KVConnector(src, DiskStore(tmp_path))
    assert conn.store(src, np.concatenate([tokens, [1, 2, 3]]), np.arange(5, 72)) == 4
    files = _files(tmp_path)
    assert len(files) == 4 and all(f.endswith(".kvb") for f in files)

    reopened = DiskStore(tmp_path)  # a restart: nothing but the folder
    assert len(reopened) == 4
    assert reopened.nbytes == sum(os.path.getsize(tmp_path / f) for f in files)
    dst = MHAPool.create(size=128, dtype=np.float32, head_num=1, head_dim=2, layer_num=2)
    conn2 = KVConnector(dst, reopened)
    assert conn2.lookup(tokens) == 64
    dst_slots = np.arange(65, 129)
    dst, n = conn2.load(dst, tokens, dst_slots)
    assert n == 64
    assert_rows(dst, dst_slots, raw_rows(src, slots))
    assert conn2.store(src, tokens, slots) == 0  # already on disk


_WRITER = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from helpers import random_mha_pool, token_seq
from jaxkv.connector import DiskStore, KVConnector
src = random_mha_pool(seed=5, size=128, layer_num=2)
conn = KVConnector(src, DiskStore(sys.argv[1]))
print(conn.store(src, token_seq(9, blocks=3), np.arange(10, 58)))
"""


def test_disk_store_persists_across_processes(tmp_path):
    early = DiskStore(tmp_path)  # open before the other process writes
    proc = run_python("-c", _WRITER.format(tests=str(REPO / "tests")), str(tmp_path), timeout=120)
    assert proc.stdout.split() == ["3"]
    src = random_mha_pool(seed=5, size=128, layer_num=2)
    want = raw_rows(src, np.arange(10, 58))
    tokens = token_seq(9, blocks=3)
    for store in (early, DiskStore(tmp_path)):
        dst = MHAPool.create(size=128, dtype=np.float32, head_num=1, head_dim=2, layer_num=2)
        conn = KVConnector(dst, store)
        assert conn.lookup(tokens) == 48
        dst_slots = np.arange(70, 118)
        dst, n = conn.load(dst, tokens, dst_slots)
        assert n == 48
        assert_rows(dst, dst_slots, want)


def test_disk_store_writes_leave_no_temporary_files(tmp_path):
    src = random_mha_pool()
    conn = KVConnector(src, DiskStore(tmp_path))
    for i in range(5):
        conn.store(src, token_seq(i, blocks=2), np.arange(1, 33))
    files = _files(tmp_path)
    assert len(files) == 10
    assert all(f.endswith(".kvb") and ".tmp" not in f for f in files)


def test_disk_store_failed_write_leaves_nothing(tmp_path, monkeypatch):
    src = random_mha_pool()
    store = DiskStore(tmp_path)
    conn = KVConnector(src, store)

    def failing_replace(self, src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(disk_module.FileOps, "replace", failing_replace)
    assert conn.store(src, token_seq(0), np.arange(1, 17)) == 0
    monkeypatch.undo()
    assert _files(tmp_path) == []
    assert store.stats()["io_errors"] == 1 and len(store) == 0
    assert conn.lookup(token_seq(0)) == 0
    assert conn.store(src, token_seq(0), np.arange(1, 17)) == 1  # works again once the disk does


def test_disk_store_cleans_stale_temporary_files_on_open_and_keeps_live_writers(tmp_path):
    src = random_mha_pool()
    conn = KVConnector(src, DiskStore(tmp_path))
    conn.store(src, token_seq(0), np.arange(1, 17))
    key = conn.block_hashes(token_seq(0))[0]
    final = _record_path(tmp_path, key)
    dead = run_python("-c", "import os; print(os.getpid())", timeout=60)
    dead_pid = int(dead.stdout)
    other = os.path.join(tmp_path, "ab", "f" * 64 + ".kvb")
    stale = [
        f"{final}.{disk_module._HOST}-{dead_pid}.deadbeef.tmp",  # its writer died before the rename
        other + ".99.1.cafe0000.tmp",  # unknown owner, older than the stale age
    ]
    live = [
        f"{final}.{disk_module._HOST}-{os.getppid()}.0123abcd.tmp",  # a live process is writing it
        f"{other}.00000000-{dead_pid}.0123abcd.tmp",  # another machine's writer: too young
    ]
    os.makedirs(os.path.dirname(other), exist_ok=True)
    for path in stale + live:
        with open(path, "wb") as f:
            f.write(b"half a record")
    old = time.time() - disk_module.STALE_TMP_SECONDS - 60
    os.utime(stale[1], (old, old))
    store = DiskStore(tmp_path)
    assert [os.path.exists(p) for p in stale + live] == [False, False, True, True]
    assert os.path.exists(final) and len(store) == 1


def test_disk_store_evicts_least_recently_used_past_capacity(tmp_path):
    src = random_mha_pool()
    slots = np.arange(1, 17)
    probe = tmp_path / "probe"
    KVConnector(src, DiskStore(probe)).store(src, token_seq(0), slots)
    file_size = os.path.getsize(probe / _files(probe)[0])

    root = tmp_path / "kv"
    store = DiskStore(root, capacity_bytes=3 * file_size + file_size // 2)
    conn = KVConnector(src, store)
    a, b, c, d, e = (token_seq(i) for i in range(5))
    for seq in (a, b, c):
        assert conn.store(src, seq, slots) == 1
    assert conn.lookup(a) == BS  # order b, c, a
    assert conn.store(src, d, slots) == 1  # evicts b
    dst = random_mha_pool(1)
    dst, n = conn.load(dst, c, slots)  # order a, d, c
    assert n == BS
    assert conn.store(src, e, slots) == 1  # evicts a
    held = {name: conn.lookup(seq) == BS for name, seq in dict(a=a, b=b, c=c, d=d, e=e).items()}
    assert held == {"a": False, "b": False, "c": True, "d": True, "e": True}
    assert len(_files(root)) == 3
    st = store.stats()
    assert st["evictions"] == 2 and st["blocks"] == 3 and st["bytes"] <= store.capacity_bytes


def test_disk_store_stats_counters(tmp_path):
    src = random_mha_pool()
    store = DiskStore(tmp_path)
    conn = KVConnector(src, store)
    conn.store(src, token_seq(0, blocks=2), np.arange(1, 33))
    dst = random_mha_pool(1)
    dst, n = conn.load(dst, token_seq(0, blocks=3), np.arange(1, 49))
    assert n == 32
    st = store.stats()
    want = {
        "hits": 2,
        "misses": 1,
        "blocks_stored": 2,
        "bytes_stored": 512,
        "blocks_loaded": 2,
        "bytes_loaded": 512,
        "verification_failures": 0,
        "evictions": 0,
        "io_errors": 0,
        "blocks": 2,
        "bytes": sum(os.path.getsize(tmp_path / f) for f in _files(tmp_path)),
    }
    assert {k: st[k] for k in want} == want


def test_disk_lookup_changes_no_files(tmp_path):
    src = random_mha_pool()
    store = DiskStore(tmp_path)
    conn = KVConnector(src, store)
    conn.store(src, token_seq(0, blocks=3), np.arange(1, 49))
    snapshot = {f: (tmp_path / f).read_bytes() for f in _files(tmp_path)}
    for _ in range(2):
        assert conn.lookup(token_seq(0, blocks=3)) == 48
        assert conn.lookup(token_seq(1, blocks=3)) == 0
    assert {f: (tmp_path / f).read_bytes() for f in _files(tmp_path)} == snapshot
    assert store.stats()["blocks_stored"] == 3


# --------------------------------------------------------------------------------------------
# DiskStore: corruption is never loaded


@pytest.fixture
def two_blocks(tmp_path):
    """A DiskStore holding two blocks of one sequence; the second block's file bytes."""
    src = random_mha_pool()
    store = DiskStore(tmp_path)
    conn = KVConnector(src, store)
    tokens, slots = token_seq(1, blocks=2), np.arange(1, 33)
    assert conn.store(src, tokens, slots) == 2
    path = _record_path(tmp_path, conn.block_hashes(tokens)[1])
    with open(path, "rb") as f:
        good = f.read()
    return conn, store, tokens, raw_rows(src, slots), path, good


def _load_after_tampering(conn, store, tokens, want, path, data, dst):
    """Writes `data` as the second block's file and loads; asserts the load either returns the
    original data or stops before that block (removing and counting the bad file)."""
    with open(path, "wb") as f:
        f.write(data)
    failures = store.stats()["verification_failures"]
    slots = np.arange(33, 65)
    dst, n = conn.load(dst, tokens, slots)
    if n == 2 * BS:
        assert_rows(dst, slots, want)
        return dst, False
    assert n == BS, n
    assert_rows(dst, slots[:BS], want[:, :BS])
    assert not os.path.exists(path)
    assert store.stats()["verification_failures"] == failures + 1
    return dst, True


def test_disk_store_every_single_byte_flip_is_caught(two_blocks):
    conn, store, tokens, want, path, good = two_blocks
    assert len(good) < 2000  # small enough to try every offset
    dst = random_mha_pool(2)
    caught = 0
    for offset in range(len(good)):
        for mask in (0xFF, 0x01, 0x80):
            bad = bytearray(good)
            bad[offset] ^= mask
            dst, hit = _load_after_tampering(conn, store, tokens, want, path, bytes(bad), dst)
            caught += hit
    assert caught == 3 * len(good)  # a CRC catches every single-byte error
    dst, hit = _load_after_tampering(conn, store, tokens, want, path, good, dst)
    assert not hit  # the intact file still loads


def test_disk_store_truncated_records_are_caught(two_blocks):
    conn, store, tokens, want, path, good = two_blocks
    dst = random_mha_pool(2)
    for length in range(len(good)):
        dst, hit = _load_after_tampering(conn, store, tokens, want, path, good[:length], dst)
        assert hit
    extended = good + b"\0"
    dst, hit = _load_after_tampering(conn, store, tokens, want, path, extended, dst)
    assert hit


def test_disk_store_rejects_a_record_under_another_blocks_name(two_blocks, tmp_path):
    conn, store, tokens, want, path, good = two_blocks
    first = _record_path(tmp_path, conn.block_hashes(tokens)[0])
    with open(first, "rb") as f:
        first_bytes = f.read()
    dst = random_mha_pool(2)
    _, hit = _load_after_tampering(conn, store, tokens, want, path, first_bytes, dst)
    assert hit
    # Also a whole record of an unrelated sequence, copied over block 0's name.
    other = token_seq(7)
    src = random_mha_pool()
    conn.store(src, other, np.arange(1, 17))
    shutil.copyfile(_record_path(tmp_path, conn.block_hashes(other)[0]), first)
    before = store.stats()["verification_failures"]
    dst = random_mha_pool(3)
    raw = raw_rows(dst, np.arange(33, 65))
    dst, n = conn.load(dst, tokens, np.arange(33, 65))
    assert n == 0
    assert_rows(dst, np.arange(33, 65), raw)
    assert not os.path.exists(first)
    assert store.stats()["verification_failures"] == before + 1


def test_disk_store_ignores_foreign_files(tmp_path):
    (tmp_path / "README").write_text("not a block")
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.txt").write_text("nor this")
    store = DiskStore(tmp_path)
    assert len(store) == 0
    assert (tmp_path / "README").exists() and (tmp_path / "ab" / "notes.txt").exists()


# --------------------------------------------------------------------------------------------
# DiskStore: only plain files are opened, no link inside the folder is followed

# Generous: these calls take milliseconds; the bound only turns a hang into a failure.
_HANG_S = 30.0


def _returns(call, *args, unblock=None):
    """`call(*args)`'s result, run in a thread; fails the test when the call has not returned
    within `_HANG_S` (it hangs), after `unblock()` has released the thread."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call(*args)), daemon=True)
    thread.start()
    thread.join(_HANG_S)
    if thread.is_alive():
        if unblock is not None:
            unblock()
        pytest.fail(f"{getattr(call, '__name__', call)} did not return: it blocks")
    assert out, "the call raised (see the thread's traceback above)"
    return out[0]


def _release_fifo_reader(path):
    """Opens the FIFO `path` for writing (and closes it), which returns a reader blocked
    opening it."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _key(i: int) -> str:
    return f"{i:064x}"


def _disk_record(i: int) -> BlockRecord:
    return _record(_key(i), float(i))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_disk_store_never_blocks_on_a_fifo_under_a_block_name(tmp_path):
    store = DiskStore(tmp_path)
    fifos = {}
    for i in (1, 2, 3):
        fifos[i] = _record_path(tmp_path, _key(i))
        os.makedirs(os.path.dirname(fifos[i]), exist_ok=True)
        os.mkfifo(fifos[i])
    assert (
        _returns(store.contains, _key(1), unblock=lambda: _release_fifo_reader(fifos[1])) is False
    )
    assert _returns(store.get, _key(2), unblock=lambda: _release_fifo_reader(fifos[2])) is None
    # A put over it: the name is found damaged, and the record written in its place.
    assert _returns(store.put, _disk_record(3), unblock=lambda: _release_fifo_reader(fifos[3]))
    assert not os.path.exists(fifos[1]) and not os.path.exists(fifos[2])
    assert os.path.isfile(fifos[3]) and store.get(_key(3)).key == _key(3)
    st = store.stats()
    assert st["verification_failures"] == 3 and st["io_errors"] == 0
    assert (st["hits"], st["misses"]) == (1, 1)


def test_disk_store_never_follows_a_link_to_a_record_elsewhere(tmp_path):
    other = DiskStore(tmp_path / "other")  # another tenant's folder
    assert other.put(_disk_record(1)) and other.put(_disk_record(2))
    store = DiskStore(tmp_path / "mine")
    for i in (1, 2):
        link = _record_path(tmp_path / "mine", _key(i))
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(_record_path(tmp_path / "other", _key(i)), link)
    assert store.contains(_key(1)) is False
    assert store.get(_key(2)) is None
    for i in (1, 2):  # the links are gone, their targets are not
        assert not os.path.lexists(_record_path(tmp_path / "mine", _key(i)))
        assert other.get(_key(i)).key == _key(i)
    assert store.stats()["verification_failures"] == 2 and store.stats()["hits"] == 0


def test_disk_store_never_follows_a_linked_subfolder(tmp_path):
    other = DiskStore(tmp_path / "other")
    records = [_disk_record(i) for i in (0x10, 0x11)]  # keys in subfolder "00"
    assert other.put_many(records) == [True, True]
    sub = os.path.dirname(_record_path(tmp_path / "mine", records[0].key))
    os.makedirs(os.path.dirname(sub))
    os.symlink(os.path.dirname(_record_path(tmp_path / "other", records[0].key)), sub)
    size = os.path.getsize(_record_path(tmp_path / "other", records[0].key))
    # The rescan indexes nothing through the link (nor would eviction remove anything there).
    store = DiskStore(tmp_path / "mine", capacity_bytes=size + size // 2)
    assert len(store) == 0 and not os.path.lexists(sub)
    assert store.stats()["verification_failures"] == 1
    os.symlink(os.path.dirname(_record_path(tmp_path / "other", records[0].key)), sub)
    assert store.get(records[0].key) is None and not os.path.lexists(sub)
    os.symlink(os.path.dirname(_record_path(tmp_path / "other", records[0].key)), sub)
    assert store.contains(records[1].key) is False and not os.path.lexists(sub)
    # A write makes a real subfolder; eviction (room for one file) stays in this folder.
    assert store.put(_disk_record(0x12)) and os.path.isdir(sub) and not os.path.islink(sub)
    assert store.put(_disk_record(0x13)) and store.stats()["evictions"] == 1
    assert store.stats()["verification_failures"] == 3
    assert [other.get(r.key).key for r in records] == [r.key for r in records]


def test_disk_store_removes_sockets_devices_and_links_under_block_names(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    made = []
    sock_path = _record_path(tmp_path, _key(1))
    os.makedirs(os.path.dirname(sock_path), exist_ok=True)
    if hasattr(socket, "AF_UNIX"):
        monkeypatch.chdir(os.path.dirname(sock_path))  # a socket's name must be short
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(os.path.basename(sock_path))  # opening it fails (ENXIO): a damaged name
        sock.close()
        made.append(_key(1))
    if os.path.exists(os.devnull) and hasattr(os, "symlink"):
        os.symlink(os.devnull, _record_path(tmp_path, _key(2)))
        made.append(_key(2))
    try:
        os.mknod(_record_path(tmp_path, _key(3)), 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        made.append(_key(3))
    except (AttributeError, OSError):
        pass  # making device nodes needs privileges
    if not made:
        pytest.skip("cannot make sockets, links or devices here")
    assert [_returns(store.contains, k) for k in made] == [False] * len(made)
    assert not any(os.path.lexists(_record_path(tmp_path, k)) for k in made)
    st = store.stats()
    assert st["verification_failures"] == len(made) and st["io_errors"] == 0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_disk_store_rescan_skips_and_removes_what_is_not_a_plain_file(tmp_path):
    good = DiskStore(tmp_path)
    assert good.put(_disk_record(1))
    elsewhere = DiskStore(tmp_path / "elsewhere")
    assert elsewhere.put(_disk_record(2))
    fifo, link = _record_path(tmp_path, _key(3)), _record_path(tmp_path, _key(2))
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.mkfifo(fifo)
    os.symlink(_record_path(tmp_path / "elsewhere", _key(2)), link)
    store = _returns(DiskStore, tmp_path, unblock=lambda: _release_fifo_reader(fifo))
    assert len(store) == 1 and store.contains(_key(1))
    assert not os.path.lexists(fifo) and not os.path.lexists(link)
    assert store.stats()["verification_failures"] == 2
    assert elsewhere.get(_key(2)) is not None


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's read counter")
def test_disk_store_never_reads_a_file_longer_than_its_record_whole(tmp_path):
    store = DiskStore(tmp_path)
    assert store.put(_disk_record(1))
    path = _record_path(tmp_path, _key(1))
    extra = 64 << 20
    with open(path, "r+b") as f:  # a sparse tail: costs no disk, would cost a read
        f.truncate(os.path.getsize(path) + extra)
    before = _bytes_read()
    assert store.get(_key(1)) is None
    assert _bytes_read() - before < extra // 4
    assert not os.path.exists(path) and store.stats()["verification_failures"] == 1


def test_disk_store_keys_and_names_match_whole(tmp_path):
    store = DiskStore(tmp_path)
    for call in (store.contains, store.get, store.discard):
        with pytest.raises(ValueError, match="key"):
            call(_key(1) + "\n")


def test_disk_store_removes_a_temporary_file_whose_pid_cannot_be(tmp_path):
    name = f"{_key(1)}.kvb.{disk_module._HOST}-{'9' * 30}.0123abcd.tmp"
    tmp = os.path.join(tmp_path, _key(1)[:2], name)
    os.makedirs(os.path.dirname(tmp))
    with open(tmp, "wb") as f:
        f.write(b"half a record")
    store = DiskStore(tmp_path)
    assert not os.path.exists(tmp) and len(store) == 0


def test_disk_store_serves_what_contains_promised_or_removes_it(tmp_path):
    """`contains` checks a file's header and size, not its checksum: a payload bit flip is
    still promised until a read, which then removes it, so that the next put repairs it."""
    store = DiskStore(tmp_path)
    record = _disk_record(5)
    assert store.put(record)
    path = _record_path(tmp_path, record.key)
    raw = bytearray(Path(path).read_bytes())
    raw[-8] ^= 0x04  # in the payload
    Path(path).write_bytes(bytes(raw))
    assert store.contains(record.key) is True
    assert store.get(record.key) is None and not os.path.exists(path)
    assert store.contains(record.key) is False
    assert store.put(record) is True
    got = store.get(record.key)
    np.testing.assert_array_equal(got.parts["k"], record.parts["k"])
    assert store.stats()["verification_failures"] == 1


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
                call([_key(1)], stop_at_miss=bad)


def test_store_flags_take_numpy_bools(tmp_path):
    store = DiskStore(tmp_path, strict=np.True_, fsync=np.bool_(True))
    assert store.strict is True and store.fsync is True
    store.strict = np.False_
    assert store.strict is False


@pytest.mark.parametrize("bad", [None, 3, b"/tmp/x", ["a"]])
def test_disk_store_path_must_be_a_str_or_pathlike(bad):
    with pytest.raises(TypeError, match="path"):
        DiskStore(bad)


def test_disk_store_path_must_not_be_empty():
    with pytest.raises(ValueError, match="path"):
        DiskStore("")


# --------------------------------------------------------------------------------------------
# discard: a record a caller found wrong


def test_host_store_discard_removes_and_keeps_a_readers_record_intact():
    store = HostStore(2 * 16, preallocate_bytes=0)  # two 16-byte records
    a, b = _record("a", 1.0), _record("b", 2.0)
    assert store.put(a) and store.put(b)
    held = store.get("a")
    assert store.discard("a") is True and store.discard("a") is False
    assert not store.contains("a") and store.get("a") is None
    assert len(store) == 1 and store.nbytes == 16
    # The reader's record stays intact while new records take the store's memory.
    for i in range(4):
        assert store.put(_record(f"new{i}", 10.0 + i))
    np.testing.assert_array_equal(held.parts["k"], a.parts["k"])
    assert store.memory_bytes <= store.capacity_bytes
    del held
    assert store.put(_record("after", 7.0)) and store.memory_bytes <= store.capacity_bytes
    st = store.stats()
    assert (st["discarded"], st["undiscarded"]) == (1, 0)


def test_disk_store_discard_removes_the_file(tmp_path):
    store = DiskStore(tmp_path)
    assert store.put(_disk_record(1)) and store.put(_disk_record(2))
    assert store.discard(_key(1)) is True
    assert not os.path.exists(_record_path(tmp_path, _key(1)))
    assert not store.contains(_key(1)) and store.get(_key(1)) is None and len(store) == 1
    assert store.discard(_key(1)) is False  # gone already: no error
    assert store.discard(_key(3)) is False
    st = store.stats()
    assert (st["discarded"], st["io_errors"], st["undiscarded"]) == (1, 0, 0)
    assert store.put(_disk_record(1)) is True and store.contains(_key(1))


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
    assert store.discard(_key(1)) is False
    assert store.stats()["undiscarded"] == 1 and store.stats()["discarded"] == 0


def test_disk_store_path_cannot_be_reassigned(tmp_path):
    store = DiskStore(tmp_path / "a")
    with pytest.raises(AttributeError):
        store.path = str(tmp_path / "b")
    assert store.path == str(tmp_path / "a")
