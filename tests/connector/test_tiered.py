"""`TieredStore` over host and disk tiers: reads in order with promotion (counted only when a
faster tier stored the copy), write-through, the leading-run walk across tiers, discard from
every tier, per-tier stats, and the connector on a stack."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_rows, random_mha_pool, raw_rows, token_seq

from jaxkv.connector import (
    BlockRecord,
    BlockStore,
    DiskStore,
    HostStore,
    KVConnector,
    TieredStore,
)


def _record(i: int) -> BlockRecord:
    key = f"{i:064x}"
    return BlockRecord(key, "layout", "tokens", {"k": np.full((1, 4), i, np.float32)})


def _stack(tmp_path):
    return TieredStore(HostStore(1 << 20), DiskStore(tmp_path / "disk"))


def test_writes_go_to_every_tier(tmp_path):
    stack = _stack(tmp_path)
    assert stack.put_many([_record(1), _record(2)]).values == [True, True]
    assert [len(t) for t in stack.tiers] == [2, 2]
    assert stack.put(_record(1)) is False  # held by every tier
    stats = stack.stats()
    assert stats["blocks_stored"] == 2 and [t["blocks_stored"] for t in stats["tiers"]] == [2, 2]


def test_a_hit_in_a_slower_tier_is_promoted(tmp_path):
    host, disk = HostStore(1 << 20), DiskStore(tmp_path / "disk")
    disk.put(_record(7))
    stack = TieredStore(host, disk)
    record = stack.get(_record(7).key)
    np.testing.assert_array_equal(record.parts["k"], _record(7).parts["k"])
    assert host.contains(_record(7).key)
    stack.get(_record(7).key)
    stats = stack.stats()
    assert stats["promotions"] == 1 and stats["hits"] == 2
    assert [t["hits"] for t in stats["tiers"]] == [1, 1]


def test_the_leading_run_follows_keys_from_tier_to_tier(tmp_path):
    host, disk = HostStore(1 << 20), DiskStore(tmp_path / "disk")
    records = [_record(i) for i in range(6)]
    host.put_many([records[i] for i in (0, 2)])
    disk.put_many([records[i] for i in (1, 3)])  # 4 is nowhere, 5 is on disk past the gap
    disk.put(records[5])
    stack = TieredStore(host, disk)
    keys = [r.key for r in records]
    assert stack.contains_many(keys, stop_at_miss=True).values == [True] * 4 + [False] * 2
    assert stack.contains_many(keys).values == [True] * 4 + [False, True]
    got = stack.get_many(keys, stop_at_miss=True).values
    assert [r is not None for r in got] == [True] * 4 + [False] * 2
    assert all(r.key == k for r, k in zip(got[:4], keys))
    assert len(host) == 4  # 1 and 3 promoted, 5 (past the gap) not read


def test_stats_sum_the_tiers_failures(tmp_path):
    stack = _stack(tmp_path)
    stack.put(_record(3))
    path = tmp_path / "disk" / _record(3).key[:2] / (_record(3).key + ".kvb")
    path.write_bytes(b"not a record")
    assert TieredStore(HostStore(1 << 20), stack.tiers[1]).get(_record(3).key) is None
    assert stack.stats()["verification_failures"] == 1


def test_needs_block_stores():
    with pytest.raises(TypeError, match="stores"):
        TieredStore()
    with pytest.raises(TypeError, match=r"stores\[1\]"):
        TieredStore(HostStore(1 << 20), {})


def test_connector_on_a_stack_reloads_from_disk_after_the_host_tier_is_gone(tmp_path):
    pool = random_mha_pool(0)
    tokens, slots = token_seq(1, blocks=3), np.arange(48)
    with KVConnector(pool, _stack(tmp_path)) as conn:
        assert conn.store(pool, tokens, slots) == 3
    want = raw_rows(pool, slots)
    stack = _stack(tmp_path)  # a fresh host tier, the same disk
    conn = KVConnector(pool, stack)
    assert conn.lookup(tokens) == 48
    dst, n = conn.load(random_mha_pool(1), tokens, slots)
    assert n == 48 and len(stack.tiers[0]) == 3
    assert_rows(dst, slots, want)


def test_promotions_count_only_copies_a_faster_tier_stored(tmp_path):
    records = [_record(i) for i in range(5)]
    disk = DiskStore(tmp_path / "disk")
    disk.put_many(records)
    tiny = HostStore(8, preallocate_bytes=0)  # smaller than any record: refuses them all
    stack = TieredStore(tiny, disk)
    got = stack.get_many([r.key for r in records]).values
    assert [g.key for g in got] == [r.key for r in records]
    stats = stack.stats()
    assert stats["promotions"] == 0 and stats["tiers"][0]["rejected"] == 5
    # Two faster tiers: each copy they newly store counts; one already held does not.
    host, middle = HostStore(1 << 20), DiskStore(tmp_path / "middle")
    middle.put(records[0])
    stack = TieredStore(host, middle, disk)
    stack.get_many([r.key for r in records[:3]])
    assert stack.stats()["promotions"] == 1 + 2 * 2  # record 0 into host; 1, 2 into both
    assert len(host) == 3 and len(middle) == 3


def test_discard_removes_a_record_from_every_tier(tmp_path):
    host, disk = HostStore(1 << 20), DiskStore(tmp_path / "disk")
    stack = TieredStore(host, disk)
    stack.put_many([_record(1), _record(2)])
    assert stack.discard(_record(1).key) is True
    assert not host.contains(_record(1).key) and not disk.contains(_record(1).key)
    assert stack.get(_record(1).key) is None and stack.get(_record(2).key) is not None
    disk.put(_record(3))  # in one tier only
    assert stack.discard(_record(3).key) is True and len(disk) == 1
    assert stack.discard(_record(4).key) is False
    stats = stack.stats()
    assert stats["discarded"] == 2
    assert [t["discarded"] for t in stats["tiers"]] == [1, 2]


def test_a_tier_without_discard_is_counted_in_the_stack(tmp_path):
    class Plain(BlockStore):
        """Records in a dict, without a discard of its own."""

        def __init__(self):
            super().__init__()
            self.records = {}

        def contains(self, key):
            return key in self.records

        def get(self, key):
            return self.records.get(key)

        def put(self, record):
            new = record.key not in self.records
            self.records[record.key] = record
            return new

        def __len__(self):
            return len(self.records)

    host = HostStore(1 << 20)
    stack = TieredStore(host, Plain())
    stack.put(_record(1))
    assert stack.discard(_record(1).key) is True  # the host tier removed it
    stats = stack.stats()
    assert (stats["discarded"], stats["undiscarded"]) == (1, 1)
