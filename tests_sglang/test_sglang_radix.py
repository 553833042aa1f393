"""`jaxkv.RadixCache` against SGLang 0.5.23's `RadixCache`, driven by the same operation streams.

SGLang's tree is built with `RadixCache.create_simulated(mock_allocator=..., page_size=P)`; its
mock allocator records the slots `evict` frees (`free_segment`), and jaxkv's allocator records
the slots its cache frees, so each eviction is compared slot for slot, in order. Both trees get
the same token ids and the same slots (handed out by a jaxkv allocator; the slots an insert
does not take go back to it, as `cache_finished_req` does), and every answer is compared:
matched slots (SGLang's `path_device_indices` of its last node), insert returns, lock deltas,
tokens evicted and which, and the three sizes after every call.

Recency: SGLang stamps nodes with `time.monotonic()`, one reading per call for the nodes it
walks and one per node it creates. Two readings can be equal on a coarse clock, and then the
heap's order between two leaves is an accident of the heap. The `clock` fixture replaces the
`time` module SGLang's radix_cache module sees with one whose `monotonic()` counts 1, 2, 3...
(`perf_counter`, used only for its metrics, is the real one): every reading is then distinct
and increasing, which is what a fine clock gives, and the eviction order is determined. jaxkv
keeps such a counter of its own.

Locks are balanced, as a scheduler uses them: a request matches and locks its prefix, and
releases that lock later, while other calls (evictions included) run between. Salts are `None`
and a non-empty string (SGLang's `cache_salt`); SGLang treats `""` as no salt, jaxkv does not
(see `test_where_jaxkv_differs`).
"""

from __future__ import annotations

import itertools
import time
import types
from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache import radix_cache as sgl_radix
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

import jaxkv

PAGES = (1, 4, 16)


@pytest.fixture
def clock(monkeypatch):
    """SGLang's radix cache reads a counter instead of `time.monotonic()` (module docstring)."""
    ticks = itertools.count(1)
    fake = types.SimpleNamespace(
        monotonic=lambda: float(next(ticks)), perf_counter=time.perf_counter
    )
    monkeypatch.setattr(sgl_radix, "time", fake)


class _MockAllocator:
    """What SGLang's simulated cache needs of an allocator: a device and `free_segment`."""

    device = "cpu"

    def __init__(self):
        self.freed: list[int] = []

    def free_segment(self, values, start_pos=0):
        self.freed.extend(values.tolist())


class _Recording(jaxkv.PagedAllocator):
    """jaxkv's allocator, recording the slots each `free` is given."""

    def __init__(self, size, page_size):
        super().__init__(size, page_size)
        self.freed: list[int] = []

    def free(self, free_index):
        self.freed.extend(np.asarray(free_index).tolist())
        super().free(free_index)


class _Pair:
    """Both caches, fed the same calls; every answer compared."""

    def __init__(self, page: int, size: int):
        self.page = page
        self.alloc = _Recording(size, page)
        self.ours = jaxkv.RadixCache(self.alloc)
        self.mock = _MockAllocator()
        self.theirs = sgl_radix.RadixCache.create_simulated(
            mock_allocator=self.mock, page_size=page
        )

    @staticmethod
    def _key(tokens, salt):
        return sgl_radix.RadixKey(array("q", list(tokens)), cache_salt=salt)

    def check_sizes(self) -> None:
        ours = (self.ours.evictable_size(), self.ours.protected_size(), self.ours.total_size())
        theirs = (
            self.theirs.evictable_size(),
            self.theirs.protected_size(),
            self.theirs.total_size(),
        )
        assert ours == theirs

    def insert(self, tokens, salt=None) -> int | None:
        """Inserts `tokens` at fresh slots (None when the allocator is short)."""
        n = len(tokens) // self.page * self.page
        slots = self.alloc.alloc(n)
        if slots is None:
            return None
        slots = np.concatenate([slots, np.zeros(len(tokens) - n, np.int64)])
        ours = self.ours.insert(tokens, slots, salt=salt)
        theirs = self.theirs.insert(
            InsertParams(key=self._key(tokens, salt), value=torch.from_numpy(slots.copy()))
        ).prefix_len
        assert ours == theirs
        self.alloc.free(slots[:ours])  # the slots insert did not take are the caller's
        return ours

    def match(self, tokens, salt=None):
        ours = self.ours.match_prefix(tokens, salt=salt)
        theirs = self.theirs.match_prefix(MatchPrefixParams(key=self._key(tokens, salt)))
        slots = self.theirs.path_device_indices(theirs.last_device_node).tolist()
        assert ours.slots.tolist() == slots
        assert theirs.device_prefix_len == len(slots)
        return ours.node, theirs.last_device_node

    def lock(self, handle) -> int:
        ours, theirs = self.ours.inc_lock_ref(handle[0]), self.theirs.inc_lock_ref(handle[1]).delta
        assert ours == theirs
        return ours

    def unlock(self, handle) -> int:
        ours, theirs = self.ours.dec_lock_ref(handle[0]), self.theirs.dec_lock_ref(handle[1]).delta
        assert ours == theirs
        return ours

    def evict(self, n: int) -> int:
        self.alloc.freed.clear()
        self.mock.freed.clear()
        ours = self.ours.evict(n)
        theirs = self.theirs.evict(EvictParams(num_tokens=n)).num_tokens_evicted
        assert ours == theirs
        assert self.alloc.freed == self.mock.freed
        return ours


@pytest.mark.usefixtures("clock")
@pytest.mark.parametrize("page", PAGES)
def test_recency_example(page):
    """Insert [0..7], then [0..3, 9..12] (in pages): the second insert walks the first node,
    splits it and creates a leaf, so the walked half [4..7] goes first."""
    pair = _Pair(page, 64 * page)
    first = np.repeat(np.arange(8), page)
    pair.insert(first)
    assert pair.insert(np.repeat([0, 1, 2, 3, 9, 10, 11, 12], page)) == 4 * page
    assert pair.evict(1) == 4 * page
    pair.check_sizes()
    pair.match(first)  # [0..3] is left, in both
    assert pair.evict(10**6) == 8 * page
    pair.check_sizes()


def _streams(page: int):
    """Prompts sharing prefixes (each a cut of an earlier one plus a few tokens of a 3-letter
    alphabet, so that matches end inside edges, at their ends and at page boundaries) and a
    stream of calls over them."""
    letters = st.integers(0, 2)

    @st.composite
    def build(draw):
        prompts = [draw(st.lists(letters, min_size=2 * page, max_size=8 * page))]
        for _ in range(draw(st.integers(2, 6))):
            parent = prompts[draw(st.integers(0, len(prompts) - 1))]
            cut = draw(st.integers(0, len(parent)))
            prompts.append(parent[:cut] + draw(st.lists(letters, min_size=1, max_size=3 * page)))
        ops = draw(
            st.lists(
                st.tuples(
                    st.sampled_from(
                        ["insert", "insert", "reinsert", "match", "request", "finish", "evict"]
                    ),
                    st.integers(0, 40),
                    st.sampled_from([None, "tenant"]),
                ),
                min_size=8,
                max_size=60,
            )
        )
        return prompts, ops

    return build()


@pytest.mark.usefixtures("clock")
@pytest.mark.parametrize("page", PAGES)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_same_answers_as_sglang(page, data):
    prompts, ops = data.draw(_streams(page))
    pair = _Pair(page, 48 * page)
    inserted: list[tuple] = []  # (prompt, salt) pairs inserted, for re-inserts
    running: list[tuple] = []  # the handles of requests holding a lock
    for kind, arg, salt in ops:
        prompt = prompts[arg % len(prompts)]
        if kind == "insert":
            if pair.insert(prompt, salt) is not None:
                inserted.append((prompt, salt))
        elif kind == "reinsert" and inserted:
            pair.insert(*inserted[arg % len(inserted)])  # a cached prefix, or its remains
        elif kind == "match":
            pair.match(prompt, salt)
        elif kind == "request":  # a request matches its prompt and holds the prefix
            handle = pair.match(prompt, salt)
            pair.lock(handle)
            running.append(handle)
        elif kind == "finish" and running:
            pair.unlock(running.pop(arg % len(running)))
        elif kind == "evict":
            pair.evict(arg % 3 * page + arg % 5)  # 0 included, and counts off the page size
        pair.check_sizes()
    while running:
        pair.unlock(running.pop())
        pair.check_sizes()
    pair.evict(10**6)
    pair.check_sizes()
    assert pair.ours.total_size() == 0


@pytest.mark.usefixtures("clock")
def test_where_jaxkv_differs():
    """SGLang lets an unmatched `dec_lock_ref` drive a node's count to -1 (jaxkv refuses it,
    changing nothing), and its `cache_salt` treats `""` as no salt (jaxkv's `""` is a tenant
    of its own, as the connector's keys are)."""
    pair = _Pair(1, 64)
    tokens = list(range(8))
    pair.insert(tokens)
    ours, theirs = pair.match(tokens)
    assert pair.theirs.dec_lock_ref(theirs).delta == 0
    assert theirs.lock_ref == -1
    with pytest.raises(ValueError, match="one more dec_lock_ref"):
        pair.ours.dec_lock_ref(ours)
    # "" as a salt: SGLang finds the unsalted prefix, jaxkv does not.
    empty = sgl_radix.RadixKey(array("q", tokens), cache_salt="")
    assert pair.theirs.match_prefix(MatchPrefixParams(key=empty)).device_prefix_len == 8
    assert pair.ours.match_prefix(tokens, salt="").slots.size == 0


@pytest.mark.usefixtures("clock")
def test_the_bench_streams_answer_alike():
    """The bench's stream shapes (`jaxkv.bench._radix.STREAMS`) at toy sizes, both page
    sizes: every matched length, insert return and eviction of the two trees must agree (the
    section raises otherwise), so each row carries a ratio."""
    from jaxkv.bench import TINY, Setting, _radix

    res = _radix.measure(Setting(TINY, "cpu"))
    assert res["skipped"] is None
    assert {(r["shared"], r["page_size"]) for r in res["rows"]} == {
        (s, p) for s in _radix.STREAMS for p in _radix.PAGES
    }
    assert all(r["SGLang/jaxkv"] > 0 for r in res["rows"])
