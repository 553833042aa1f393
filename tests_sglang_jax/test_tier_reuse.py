"""The persistent tier at its defaults, as a restarted or busy server meets it: a match waits
for a prefetch while the store makes progress (a whole prefix from a slow but healthy store, a
hung store costing one stall window), and a prefix found in host memory or the store is loaded
even when the device is full of other cached prefixes (evicting them, as SGLang's HiCache
does)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import sgljax_trees as st

from jaxkv.connector import BlockRecord, BlockStore, DiskStore
from jaxkv.connector._block_kernels import scatter_donated
from jaxkv.integrations.sglang_jax import storage
from jaxkv.integrations.sglang_jax._store_sides import STALL_S, ReadAhead, TierCounters


class _Slow(BlockStore):
    """A store whose reads take `delay_s` per call (or block while `hang` is set)."""

    def __init__(self, store: BlockStore, delay_s: float = 0.0):
        super().__init__()
        self.store, self.delay_s = store, delay_s
        self.hang = threading.Event()
        self.resume = threading.Event()
        self.reads = 0

    def contains(self, key):
        return self.store.contains(key)

    def get(self, key):
        return self.get_many([key]).values[0]

    def get_many(self, keys, *, stop_at_miss=False, strict=None):
        self.reads += 1
        if self.hang.is_set():
            self.resume.wait(10)
        time.sleep(self.delay_s)
        return self.store.get_many(keys, stop_at_miss=stop_at_miss, strict=strict)

    def put(self, record):
        return self.store.put(record)

    def discard(self, key):
        return self.store.discard(key)

    def __len__(self):
        return len(self.store)


def _records(n: int) -> list[BlockRecord]:
    return [
        BlockRecord(
            key=f"{i:064x}", layout="L", tokens="T", parts={"k": np.full((4,), i, np.float32)}
        )
        for i in range(n)
    ]


def _ahead(store: BlockStore) -> ReadAhead:
    return ReadAhead(store, 1 << 20, 1024, TierCounters("test"), missing=lambda keys: None)


def test_a_match_waits_for_a_slow_store_while_blocks_land():
    # Six batches of 16 blocks at 0.25 s each: 1.5 s in all, each batch within the stall
    # window.
    records = _records(96)
    slow = _Slow(_Memory(records), delay_s=0.25)
    ahead = _ahead(slow)
    try:
        job = ahead.fetch([[r.key for r in records]], "prompt")
        waited = ahead.wait(job, 5.0)
        assert job.done.is_set() and waited > 2 * STALL_S
        assert len(ahead.cache) == 96
    finally:
        ahead.close()


def test_a_hung_store_costs_one_stall_window_then_nothing_until_it_answers():
    records = _records(16)
    slow = _Slow(_Memory(records))
    slow.hang.set()
    ahead = _ahead(slow)
    try:
        job = ahead.fetch([[r.key for r in records]], "a")
        began = time.monotonic()
        assert STALL_S <= ahead.wait(job, 5.0) < STALL_S + 0.5
        other = ahead.fetch([[r.key for r in records[:4]]], "b")
        assert ahead.wait(other, 5.0) < 0.05  # stalled: no second wait
        assert time.monotonic() - began < STALL_S + 1.0
        slow.hang.clear()
        slow.resume.set()
        job.done.wait(5)
        third = ahead.fetch([[r.key for r in records[:8]]], "c")
        ahead.wait(third, 5.0)
        assert third.done.is_set() and len(ahead.cache) == 16  # the store answers again
    finally:
        ahead.close()


def test_the_hard_bound_ends_a_wait_on_a_store_that_keeps_trickling():
    records = _records(160)
    slow = _Slow(_Memory(records), delay_s=0.05)
    ahead = _ahead(slow)
    try:
        job = ahead.fetch([[r.key for r in records]], "prompt")
        assert 0.1 <= ahead.wait(job, 0.12) < 0.3
        assert not job.done.is_set()
    finally:
        ahead.close()


class _Memory(BlockStore):
    """Records in a dict."""

    def __init__(self, records=()):
        super().__init__()
        self.records = {r.key: r for r in records}

    def contains(self, key):
        return key in self.records

    def get(self, key):
        return self.records.get(key)

    def put(self, record):
        new = record.key not in self.records
        self.records[record.key] = record
        return new

    def discard(self, key):
        return self.records.pop(key, None) is not None

    def __len__(self):
        return len(self.records)


# ---- through sglang-jax's tree ------------------------------------------------------------


@pytest.fixture
def trees():
    made: list[st.Tree] = []
    yield made
    for t in made:
        t.tree.jaxkv.close()


def test_the_first_request_after_a_restart_gets_its_prefix_at_the_default_wait(
    trees, tmp_path, rng
):
    # A store that takes 60 ms a read: three times what a round once waited (20 ms), well
    # within what a match waits for a store that makes progress.
    cfg = st.CONFIGS["mha-f32-p1"]
    disk = DiskStore(tmp_path / "blocks")
    first = st.build(cfg, rng, store=disk)
    trees.append(first)
    tokens = rng.integers(0, 50_000, size=120)
    want = st.rows(first, st.insert(first, tokens))
    st.settle(first)
    first.tree.jaxkv.close()

    slow = _Slow(DiskStore(tmp_path / "blocks"), delay_s=0.06)
    restarted = st.build(cfg, np.random.default_rng(1), store=slow)  # default settings
    trees.append(restarted)
    assert restarted.tree.jaxkv.wait_s == storage.StoreSettings(store="host:1").wait_s
    compiled = scatter_donated._cache_size()
    prefix, match = st.serve(restarted, tokens)
    # The load ran a transfer the tier compiled when it was built, not on the request's path.
    assert scatter_donated._cache_size() == compiled
    assert restarted.tree.jaxkv.stats()["errors"] == 0
    n = len(tokens) // 16 * 16
    assert match.host_hit_length == n and len(prefix) == n
    np.testing.assert_array_equal(st.rows(restarted, prefix), want[:, :n])


def _fill_device(t: st.Tree, rng, keep_free: int) -> list[np.ndarray]:
    """Caches other prompts until at most `keep_free` device slots are free; each is cached
    and unlocked (evictable), as a busy server's device is."""
    others = []
    while t.allocator.available_size(0) > keep_free:
        n = min(16, t.allocator.available_size(0) - keep_free) // t.cfg.page_size
        tokens = rng.integers(0, 50_000, size=max(1, n) * t.cfg.page_size)
        st.insert(t, tokens)
        others.append(tokens)
    st.settle(t)
    return others


@pytest.mark.parametrize("where", ["store", "host"])
def test_a_full_device_evicts_cached_prefixes_to_load_a_prefix_back(trees, tmp_path, rng, where):
    cfg = st.CONFIGS["mha-bf16-p4"]
    t = st.build(cfg, rng, store=DiskStore(tmp_path / "blocks"))
    trees.append(t)
    tokens = rng.integers(0, 50_000, size=40)
    want = st.rows(t, st.insert(t, tokens))
    st.settle(t)
    t.tree.evict(st.EvictParams(num_tokens=cfg.size, dp_rank=0))  # off the device
    if where == "store":
        t.tree.evict_host(cfg.size)  # and out of host memory: the store alone holds it
    _fill_device(t, rng, keep_free=8)
    assert t.allocator.available_size(0) <= 8 < len(tokens)

    prefix, match = st.serve(t, tokens)

    assert len(prefix) >= 0.9 * len(tokens)
    np.testing.assert_array_equal(st.rows(t, prefix), want[:, : len(prefix)])
    assert st.balanced(t)
