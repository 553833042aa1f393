"""`HostStore`: least-recently-used eviction by bytes, records isolated from their callers,
memory mapped up front and reused (a fresh store copies into touched memory, never into fresh
allocations), segments kept without a copy, capacity bounding all the memory it holds, and
`discard`.
"""

from __future__ import annotations

import copy
import dataclasses
import tracemalloc

import numpy as np
import pytest
from helpers import STORE_BLOCK_SIZE, random_mha_pool, token_seq
from helpers import small_record as _record

from jaxkv.connector import BlockRecord, HostStore, KVConnector
from jaxkv.connector._records import Segment, is_block_of

BS = STORE_BLOCK_SIZE  # the blocks of token_seq


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
    assert store.put_many(records).values == [True, True]
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
    assert store.put_many(records).values == [False, True]  # the first key was already there
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
