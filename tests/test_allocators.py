"""Allocator tests: the documented allocator API and SGLang's allocator semantics.

The property test drives `PagedAllocator` / `TokenAllocator` against `_Model`, a plain-Python
SGLang allocator (free list + release list, merged and sorted only when the free list runs
short) that places tokens one at a time: token `i` of a request starts a new page when
`i % page_size == 0`, else it takes the slot after the previous token.
"""

from __future__ import annotations

import copy

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BOUNDARY_ERRORS, HOSTILE_ARG, names_an_argument
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv import PagedAllocator, ReqToTokenPool, TokenAllocator
from jaxkv.errors import ConsumedPoolError

# --------------------------------------------------------------------------------------------
# Helpers


def _drain(alloc, page_size: int) -> list[int]:
    """Allocates one page at a time until the allocator is empty; returns the slots in order."""
    out = []
    while (got := alloc.alloc(page_size)) is not None:
        out.extend(got.tolist())
    assert alloc.available_size() == 0
    return out


def _pages(slots, page_size: int) -> list[int]:
    return (np.asarray(slots) // page_size)[::page_size].tolist()


def _paged_with_free_pages(num_pages: int, page_size: int, free_pages) -> PagedAllocator:
    """An allocator of `num_pages` pages, all taken, then `free_pages` freed in the given order
    (public API only): the next allocation merges them, sorted, into the free list."""
    a = PagedAllocator(num_pages * page_size, page_size)
    assert a.alloc(num_pages * page_size) is not None
    for page in free_pages:
        a.free([page * page_size])
    return a


def _twins(make, ops):
    """Two allocators built by `make` with the same `ops` applied."""
    a, b = make(), make()
    for op in ops:
        op(a)
        op(b)
    return a, b


def _assert_same_state(a, b, page_size: int) -> None:
    """`a` and `b` free the same pages in the same future order (drains both)."""
    assert a.available_size() == b.available_size()
    assert _drain(a, page_size) == _drain(b, page_size)


# --------------------------------------------------------------------------------------------
# TokenAllocator


def test_token_allocator_fresh_hands_out_slots_1_to_size():
    a = TokenAllocator(8)
    assert a.available_size() == 8
    got = a.alloc(3)
    assert got.dtype.kind in "iu"
    np.testing.assert_array_equal(got, [1, 2, 3])
    np.testing.assert_array_equal(a.alloc(5), [4, 5, 6, 7, 8])
    assert a.available_size() == 0
    assert a.alloc(1) is None
    np.testing.assert_array_equal(a.alloc(0), np.zeros(0, int))


def test_token_allocator_alloc_returns_none_when_short_and_takes_nothing():
    a = TokenAllocator(10)
    a.alloc(6)
    a.free([4, 2])
    assert a.available_size() == 6
    assert a.alloc(7) is None
    assert a.available_size() == 6
    # As in SGLang, the short call has merged the release list (sorted) into the free list: the
    # same slots are free, now in merged order.
    assert _drain(a, 1) == [2, 4, 7, 8, 9, 10]


def test_token_allocator_free_ignores_page0_out_of_range_negative_and_duplicates():
    a = TokenAllocator(8)
    a.alloc(8)
    a.free([0, 9, 100, -1, -8])
    assert a.available_size() == 0
    a.free(np.array([3, 3, 5, 3]))
    assert a.available_size() == 2
    a.free([])
    assert a.available_size() == 2
    np.testing.assert_array_equal(a.alloc(2), [3, 5])
    assert a.alloc(1) is None


def test_token_allocator_double_free_never_duplicates():
    a = TokenAllocator(6)
    a.alloc(6)
    a.free([2, 5])
    a.free([2])
    a.free([5, 2])
    assert a.available_size() == 2
    got = a.alloc(2)
    np.testing.assert_array_equal(np.sort(got), [2, 5])
    assert a.alloc(1) is None

    # Freeing a slot that was never handed out does not add it twice either.
    b = TokenAllocator(6)
    b.alloc(3)
    b.free([5, 6])
    assert b.available_size() == 3
    slots = _drain(b, 1)
    assert sorted(slots) == [4, 5, 6]


def test_token_allocator_released_slots_come_back_only_when_free_list_runs_short():
    a = TokenAllocator(6)
    np.testing.assert_array_equal(a.alloc(4), [1, 2, 3, 4])
    a.free([3])
    a.free([1])
    np.testing.assert_array_equal(a.alloc(2), [5, 6])  # free list first
    np.testing.assert_array_equal(a.alloc(2), [1, 3])  # then the release list, sorted


def test_token_allocator_backup_restore_is_a_snapshot():
    a = TokenAllocator(8)
    a.alloc(2)
    state = a.backup_state()
    first = a.alloc(3)
    a.free([1, 2])
    a.alloc(4)
    a.restore_state(state)
    assert a.available_size() == 6
    np.testing.assert_array_equal(a.alloc(3), first)
    a.clear()
    a.restore_state(state)  # the snapshot survives restoring and later calls
    assert a.available_size() == 6
    np.testing.assert_array_equal(a.alloc(6), [3, 4, 5, 6, 7, 8])


def test_token_allocator_clear():
    a = TokenAllocator(5)
    a.alloc(4)
    a.free([2, 3])
    a.clear()
    assert a.available_size() == 5
    np.testing.assert_array_equal(a.alloc(5), [1, 2, 3, 4, 5])


@pytest.mark.parametrize("size", [0, -1, -16])
def test_token_allocator_rejects_non_positive_size(size):
    with pytest.raises(ValueError, match="size"):
        TokenAllocator(size)


# --------------------------------------------------------------------------------------------
# PagedAllocator: alloc / free / state


def test_paged_fresh_hands_out_whole_pages_ascending():
    a = PagedAllocator(16, 4)
    assert a.available_size() == 16
    np.testing.assert_array_equal(a.alloc(8), np.arange(4, 12))
    np.testing.assert_array_equal(a.alloc(4), [12, 13, 14, 15])
    np.testing.assert_array_equal(a.alloc(4), [16, 17, 18, 19])
    assert a.alloc(4) is None
    np.testing.assert_array_equal(a.alloc(0), np.zeros(0, int))


def test_paged_size_not_a_multiple_of_page_size_is_refused():
    # A ragged tail would silently hold fewer tokens than asked for (18 -> 16).
    with pytest.raises(ValueError, match=r"size: expected a multiple of page_size=4, got size=18"):
        PagedAllocator(18, 4)


@pytest.mark.parametrize("n", [1, 3, 5, 6])
def test_paged_alloc_needs_a_multiple_of_page_size(n):
    a = PagedAllocator(16, 4)
    with pytest.raises(ValueError, match="page_size"):
        a.alloc(n)
    assert a.available_size() == 16
    np.testing.assert_array_equal(a.alloc(4), [4, 5, 6, 7])


def test_paged_alloc_returns_none_when_short_and_takes_nothing():
    def make():
        return PagedAllocator(24, 4)

    # Free list [4, 5, 6] after this; release list [2]: 4 pages are free.
    ops = [lambda a: a.alloc(12), lambda a: a.free([9])]
    a, b = _twins(make, ops)
    assert a.available_size() == 16
    assert a.alloc(20) is None
    assert a.available_size() == 16
    # As in SGLang, the short call merged the release list: page 2 now comes first.
    np.testing.assert_array_equal(a.alloc(4), [8, 9, 10, 11])
    assert _drain(a, 4) == list(range(16, 28))
    # Its twin, which never made the short call, merges only when it runs short.
    assert _drain(b, 4) == list(range(16, 28)) + [8, 9, 10, 11]


def test_paged_free_is_page_granular():
    a = PagedAllocator(16, 4)
    a.alloc(16)
    a.free([6])  # one slot of page 1 frees the whole page
    assert a.available_size() == 4
    a.free([17, 19, 18])  # page 4, three times
    assert a.available_size() == 8
    np.testing.assert_array_equal(a.alloc(8), [4, 5, 6, 7, 16, 17, 18, 19])


def test_paged_free_ignores_page0_out_of_range_negative_and_duplicates():
    a = PagedAllocator(16, 4)
    a.alloc(16)
    a.free([0, 1, 3, 20, 23, 1000, -1, -4, -5])
    assert a.available_size() == 0
    a.free(np.array([8, 9, 8, 11]))
    assert a.available_size() == 4
    np.testing.assert_array_equal(a.alloc(4), [8, 9, 10, 11])
    assert a.alloc(4) is None


def test_paged_double_free_never_duplicates_a_page():
    a = PagedAllocator(20, 4)
    a.alloc(20)
    a.free([8])
    a.free([9, 10])
    a.free([4, 8])
    a.free(np.arange(4, 12))
    assert a.available_size() == 8
    slots = _drain(a, 4)
    assert slots == list(range(4, 12))
    # A page still in the free list (never handed out) is not listed twice either.
    b = PagedAllocator(16, 4)
    b.alloc(4)
    b.free([12, 13, 19])
    assert b.available_size() == 12
    assert sorted(_pages(_drain(b, 4), 4)) == [2, 3, 4]


def test_paged_freed_pages_merge_sorted_only_when_free_list_runs_short():
    a = PagedAllocator(16, 4)
    np.testing.assert_array_equal(a.alloc(8), np.arange(4, 12))  # pages 1, 2
    a.free([4])  # page 1 waits in the release list
    np.testing.assert_array_equal(a.alloc(4), [12, 13, 14, 15])  # page 3
    np.testing.assert_array_equal(a.alloc(4), [16, 17, 18, 19])  # page 4
    np.testing.assert_array_equal(a.alloc(4), [4, 5, 6, 7])  # page 1, after the merge
    assert a.alloc(4) is None


def test_paged_merge_sorts_release_into_remaining_free_pages():
    a = PagedAllocator(24, 4)  # pages 1..6
    a.alloc(16)  # pages 1..4; free list [5, 6]
    a.free([12])  # page 3
    a.free([4])  # page 1
    # 3 pages > 2 free: merge -> [1, 3, 5, 6], sorted regardless of the freeing order.
    assert _pages(a.alloc(12), 4) == [1, 3, 5]
    assert _pages(a.alloc(4), 4) == [6]


def test_paged_backup_restore_is_a_snapshot():
    a = PagedAllocator(24, 4)
    a.alloc(8)
    a.free([4])  # release list [1], free list [3..6]
    state = a.backup_state()
    first = a.alloc(20)
    assert _pages(first, 4) == [1, 3, 4, 5, 6]
    a.free(first)
    a.alloc(8)  # mutating after the backup must not change the snapshot
    a.restore_state(state)
    assert a.available_size() == 20
    assert _pages(a.alloc(16), 4) == [3, 4, 5, 6]  # release list still unmerged
    a.free(np.arange(4, 28))
    a.restore_state(state)  # restoring twice gives the same state again
    assert a.available_size() == 20
    np.testing.assert_array_equal(a.alloc(20), first)


@pytest.mark.parametrize(
    "make, p",
    [(lambda: TokenAllocator(6), 1), (lambda: PagedAllocator(24, 4), 4)],
    ids=["token", "paged"],
)
def test_backup_state_is_a_snapshot_not_a_reference(make, p):
    a = make()
    a.alloc(p)  # page 1 held
    state = a.backup_state()
    for _ in range(2):  # restoring twice: the first restore must not share state either
        a.alloc(p)  # page 2 taken and page 1 freed after the backup
        a.free([p])
        a.restore_state(state)
        a.free([2 * p])  # page 2 is free in the snapshot: ignored, never listed twice
        assert a.available_size() == 5 * p
        np.testing.assert_array_equal(a.alloc(p), np.arange(2 * p, 3 * p))
    a.restore_state(state)
    assert _pages(_drain(a, p), p) == [2, 3, 4, 5, 6]


def test_paged_clear():
    a = PagedAllocator(16, 4)
    a.alloc(12)
    a.free([8])
    a.clear()
    assert a.available_size() == 16
    assert _pages(_drain(a, 4), 4) == [1, 2, 3, 4]


@pytest.mark.parametrize("size, page_size", [(0, 4), (-4, 4), (16, 0), (16, -4), (0, 0)])
def test_paged_rejects_non_positive_sizes(size, page_size):
    with pytest.raises(ValueError):
        PagedAllocator(size, page_size)


# --------------------------------------------------------------------------------------------
# PagedAllocator.alloc_extend


def test_alloc_extend_reference_example():
    # Pages 1..9 all taken; freeing 9, 7, 8 leaves exactly [7, 8, 9] after the merge. The
    # requests hold pages 2 (last_loc 10) and 4 (last_loc 19).
    a = _paged_with_free_pages(9, 4, [9, 7, 8])
    assert a.available_size() == 12
    got = a.alloc_extend(prefix_lens=[3, 4, 0], seq_lens=[6, 5, 3], last_loc=[10, 19, -1])
    np.testing.assert_array_equal(got, [11, 28, 29, 32, 36, 37, 38])
    assert a.available_size() == 0


def test_alloc_extend_only_fills_the_partial_page():
    a = PagedAllocator(16, 4)
    a.alloc(4)  # page 1 held by the request: prefix tokens at 4, 5
    got = a.alloc_extend([2], [4], [5])
    np.testing.assert_array_equal(got, [6, 7])
    assert a.available_size() == 12  # no page taken
    got = a.alloc_extend([1], [2], [4])
    np.testing.assert_array_equal(got, [5])


def test_alloc_extend_only_whole_pages():
    a = PagedAllocator(32, 4)
    a.alloc(4)  # page 1 full: prefix 4, last_loc 7
    got = a.alloc_extend([4], [12], [7])
    np.testing.assert_array_equal(got, np.arange(8, 16))
    assert a.available_size() == 20
    got = a.alloc_extend([0], [8], [-1])
    np.testing.assert_array_equal(got, np.arange(16, 24))


def test_alloc_extend_only_a_partial_tail_page():
    a = PagedAllocator(16, 4)
    np.testing.assert_array_equal(a.alloc_extend([0], [3], [-1]), [4, 5, 6])
    a.alloc(4)  # page 2
    # Prefix 4 ends page 2 exactly (last_loc 11): the next token starts page 3.
    np.testing.assert_array_equal(a.alloc_extend([4], [5], [11]), [12])
    assert a.available_size() == 4


def test_alloc_extend_all_three_parts():
    a = PagedAllocator(32, 4)
    a.alloc(4)  # page 1: prefix tokens at 4, 5
    got = a.alloc_extend([2], [13], [5])
    # finish page 1 | whole pages 2, 3 | tail on page 4
    np.testing.assert_array_equal(got, [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])
    assert a.available_size() == 16


def test_alloc_extend_prefix_equal_to_seq_allocates_nothing():
    a = PagedAllocator(16, 4)
    a.alloc(4)
    got = a.alloc_extend([3], [3], [6])
    assert got.shape == (0,)
    assert a.available_size() == 12
    got = a.alloc_extend([4, 0, 2], [4, 0, 2], [7, -1, 5])
    assert got.shape == (0,)
    assert a.available_size() == 12
    # Mixed with a request that does need a page.
    got = a.alloc_extend([3, 0], [3, 2], [6, -1])
    np.testing.assert_array_equal(got, [8, 9])
    np.testing.assert_array_equal(a.alloc_extend([], [], []), np.zeros(0, int))


def test_alloc_extend_empty_prefixes_take_pages_request_by_request():
    a = PagedAllocator(64, 4)
    got = a.alloc_extend([0, 0, 0], [5, 2, 8], [-1, -1, -1])
    np.testing.assert_array_equal(got, [4, 5, 6, 7, 8, 12, 13, 16, 17, 18, 19, 20, 21, 22, 23])


def test_alloc_extend_takes_pages_in_free_list_order():
    # Pages 1..8 taken, then 6, 2, 5, 3 freed: the merged free list is [2, 3, 5, 6].
    a = _paged_with_free_pages(8, 4, [6, 2, 5, 3])
    got = a.alloc_extend([0, 0], [5, 8], [-1, -1])
    np.testing.assert_array_equal(got, [8, 9, 10, 11, 12, 20, 21, 22, 23, 24, 25, 26, 27])


def test_alloc_extend_uses_released_pages_only_when_free_list_runs_short():
    a = PagedAllocator(24, 4)  # pages 1..6
    a.alloc(8)
    a.free([4])  # page 1 -> release list; free list [3, 4, 5, 6]
    np.testing.assert_array_equal(a.alloc_extend([0], [5], [-1]), [12, 13, 14, 15, 16])
    # Free list [5, 6] is short of 3 pages: merge -> [1, 5, 6].
    got = a.alloc_extend([0, 0], [4, 8], [-1, -1])
    np.testing.assert_array_equal(got, [4, 5, 6, 7, *range(20, 28)])


def test_alloc_extend_returns_none_and_consumes_nothing_when_short():
    def make():
        return PagedAllocator(24, 4)

    ops = [lambda a: a.alloc(8), lambda a: a.free([5])]  # free [3..6], release [1]
    a, b = _twins(make, ops)
    # 6 new pages wanted, 5 free; the first request alone would fit.
    assert a.alloc_extend([0, 0], [4, 20], [-1, -1]) is None
    assert a.available_size() == 20
    # Nothing taken; as in SGLang, the call's bound (24 // 4 + 2 + 1 pages) exceeded the free
    # list, so it merged the release list: released page 1 now comes first.
    assert _drain(a, 4) == [4, 5, 6, 7, *range(12, 28)]
    assert _drain(b, 4) == [*range(12, 28), 4, 5, 6, 7]


@pytest.mark.parametrize(
    "prefix, seq, last",
    [([0, 0], [1], [-1]), ([0], [1, 2], [-1, -1]), ([0], [1], [-1, -1]), ([], [1], [])],
)
def test_alloc_extend_rejects_mismatched_lengths(prefix, seq, last):
    a = PagedAllocator(16, 4)
    with pytest.raises(ValueError):
        a.alloc_extend(prefix, seq, last)
    assert a.available_size() == 16


@pytest.mark.parametrize(
    "prefix, seq, last",
    [
        ([2], [4], [4]),  # offset 0 but prefix 2 ends at offset 1
        ([2], [4], [6]),  # offset 2
        ([1], [2], [0]),  # right offset, but page 0
        ([3], [4], [-1]),  # a non-empty partial prefix needs its last slot
        ([0, 2], [4, 3], [-1, 8]),  # second request wrong
    ],
)
def test_alloc_extend_rejects_bad_last_loc_and_consumes_nothing(prefix, seq, last):
    def make():
        a = PagedAllocator(32, 4)
        a.alloc(8)  # pages 1, 2 held
        return a

    a, b = _twins(make, [])
    with pytest.raises(ValueError, match="last_loc"):
        a.alloc_extend(prefix, seq, last)
    _assert_same_state(a, b, 4)


def test_alloc_extend_rejects_seq_shorter_than_prefix():
    a = PagedAllocator(16, 4)
    a.alloc(4)
    with pytest.raises(ValueError):
        a.alloc_extend([3], [2], [6])
    with pytest.raises(ValueError):
        a.alloc_extend([-1], [2], [-1])
    assert a.available_size() == 12


def _check_extend(out, prefix, seq, last, page_size, new_pages):
    """Checks `out` token by token: token i of a request starts the next of `new_pages` when
    `i % page_size == 0`, else it sits in the slot after the previous token."""
    n = seq - prefix
    assert out.shape == (int(n.sum()),)
    req = np.repeat(np.arange(seq.size), n)
    first = np.cumsum(n) - n
    tok = prefix[req] + np.arange(out.size) - first[req]
    prev = np.empty_like(out)
    prev[1:] = out[:-1]
    prev[first[n > 0]] = last[n > 0]
    starts = tok % page_size == 0
    np.testing.assert_array_equal(out[~starts], prev[~starts] + 1)
    np.testing.assert_array_equal(out[starts], np.asarray(new_pages) * page_size)
    assert np.all(out % page_size == tok % page_size)
    assert np.all(out >= page_size)


def test_alloc_extend_at_scale_is_vectorised():
    # 256 requests x 4096 tokens (1M slots); finishing at all shows there is no per-token
    # Python loop, and `_check_extend` checks every slot.
    reqs, ctx, p = 256, 4096, 16
    rng = np.random.default_rng(0)
    a = PagedAllocator(reqs * ctx, p)
    prefix = rng.integers(0, ctx, reqs)
    prefix[:8] = [0, 1, p - 1, p, p + 1, ctx - 1, ctx - p, 0]
    zeros = np.zeros(reqs, np.int64)
    got = a.alloc_extend(zeros, prefix, zeros - 1)
    pages0 = -(-prefix // p)
    _check_extend(got, zeros, prefix, zeros - 1, p, np.arange(1, 1 + pages0.sum()))
    ends = np.cumsum(prefix)
    last = np.where(prefix > 0, got[np.maximum(ends - 1, 0)], -1)

    seq = np.full(reqs, ctx)
    out = a.alloc_extend(prefix, seq, last)
    first_page = 1 + pages0.sum()
    _check_extend(out, prefix, seq, last, p, np.arange(first_page, 1 + reqs * ctx // p))
    assert a.available_size() == 0
    assert np.unique(np.concatenate([got, out])).size == reqs * ctx


# --------------------------------------------------------------------------------------------
# PagedAllocator.alloc_decode


def test_alloc_decode_continues_or_starts_a_page():
    a = PagedAllocator(32, 4)
    a.alloc(8)  # pages 1, 2 held: request 0 has tokens at 4, 5; request 1 at 8..11
    # seq 3: token 2 goes after last_loc; seq 5: token 4 starts a page; seq 1: a new request.
    got = a.alloc_decode([3, 5, 1], [5, 11, -1])
    np.testing.assert_array_equal(got, [6, 12, 16])
    assert a.available_size() == 16
    np.testing.assert_array_equal(a.alloc_decode([4, 6, 2], [6, 12, 16]), [7, 13, 17])
    assert a.available_size() == 16


def test_alloc_decode_takes_pages_in_free_list_order():
    a = _paged_with_free_pages(6, 4, [5, 2])  # merged free list [2, 5]
    np.testing.assert_array_equal(a.alloc_decode([9, 2, 1], [7, 12, 17]), [8, 13, 20])


def test_alloc_decode_returns_none_and_consumes_nothing_when_short():
    def make():
        a = PagedAllocator(16, 4)
        a.alloc(8)
        a.free([4])  # free [3, 4], release [1]
        return a

    a, b = _twins(make, [])
    assert a.alloc_decode([1, 5, 9, 1], [-1, 11, 15, -1]) is None
    assert a.available_size() == 12
    # Nothing taken; the batch (4) outnumbered the free pages (2), so as in SGLang the release
    # list was merged: page 1 comes first now.
    assert _drain(a, 4) == [4, 5, 6, 7, *range(12, 20)]
    assert _drain(b, 4) == [*range(12, 20), 4, 5, 6, 7]


def test_alloc_decode_page_size_1_takes_a_slot_per_token():
    a = PagedAllocator(6, 1)
    np.testing.assert_array_equal(a.alloc_decode([5, 1, 9], [-1, -1, -1]), [1, 2, 3])
    a.free([2])
    np.testing.assert_array_equal(a.alloc_decode([2, 2], [3, 1]), [4, 5])
    np.testing.assert_array_equal(a.alloc_decode([3, 3], [4, 5]), [2, 6])
    assert a.alloc_decode([1], [-1]) is None
    np.testing.assert_array_equal(a.alloc_extend([], [], []), np.zeros(0, int))


def test_alloc_extend_page_size_1():
    a = PagedAllocator(8, 1)
    a.alloc(2)
    a.free([1])
    # SGLang's bound (5 tokens // 1 + 2 requests + 1 = 8) exceeds the 6 free pages, so the
    # released slot 1 is merged in first and handed out first.
    np.testing.assert_array_equal(a.alloc_extend([1, 0], [3, 3], [2, -1]), [1, 3, 4, 5, 6])
    np.testing.assert_array_equal(a.alloc_extend([0], [2], [-1]), [7, 8])


def test_alloc_decode_rejects_mismatched_lengths():
    a = PagedAllocator(16, 4)
    with pytest.raises(ValueError):
        a.alloc_decode([1, 1], [-1])
    assert a.available_size() == 16


@pytest.mark.parametrize(
    "seq, last",
    [([3], [4]), ([3], [6]), ([2], [-1]), ([2], [0]), ([1, 4], [-1, 4])],
)
def test_alloc_decode_rejects_bad_last_loc_and_consumes_nothing(seq, last):
    def make():
        a = PagedAllocator(16, 4)
        a.alloc(4)
        return a

    a, b = _twins(make, [])
    with pytest.raises(ValueError, match="last_loc"):
        a.alloc_decode(seq, last)
    _assert_same_state(a, b, 4)


# --------------------------------------------------------------------------------------------
# Property test against a plain-Python model


class _Model:
    """SGLang's paged allocator, one token at a time (see the module docstring)."""

    def __init__(self, size: int, page_size: int):
        self.p = page_size
        self.num_pages = size // page_size
        self.free_list = list(range(1, self.num_pages + 1))
        self.release = []

    def available(self) -> int:
        return (len(self.free_list) + len(self.release)) * self.p

    def take(self, n: int, bound: int | None = None) -> list[int] | None:
        """SGLang: merge the release list (sorted) when the free list holds fewer pages than
        the call's bound (`n` for `alloc`), then take `n` pages or fail."""
        if (n if bound is None else bound) > len(self.free_list):
            self.free_list = sorted(self.free_list + self.release)
            self.release = []
        if n > len(self.free_list):
            return None
        out, self.free_list = self.free_list[:n], self.free_list[n:]
        return out

    def free(self, slots) -> None:
        for s in slots:
            page = s // self.p
            if s >= 0 and 1 <= page <= self.num_pages:
                if page not in self.free_list and page not in self.release:
                    self.release.append(page)

    def alloc(self, n: int) -> list[int] | None:
        pages = self.take(n // self.p)
        return None if pages is None else [q * self.p + o for q in pages for o in range(self.p)]

    def extend(
        self, held: list[list[int]], new: list[int], decode: bool = False
    ) -> list[list[int]] | None:
        """New slots for each request holding `held[i]` slots and getting `new[i]` tokens.

        SGLang's merge bound: `alloc_extend` merges when `sum(new) // p + batch + 1` pages
        exceed the free list, `alloc_decode` when the batch does."""
        starts = sum(
            1
            for h, k in zip(held, new, strict=True)
            for i in range(len(h), len(h) + k)
            if i % self.p == 0
        )
        bound = len(held) if decode else sum(new) // self.p + len(held) + 1
        pages = self.take(starts, bound)
        if pages is None:
            return None
        pages.reverse()
        out = []
        for h, k in zip(held, new, strict=True):
            slots = list(h)
            for i in range(len(h), len(h) + k):
                slots.append(pages.pop() * self.p if i % self.p == 0 else slots[-1] + 1)
            out.append(slots[len(h) :])
        return out


def _check_live(reqs: dict[int, list[int]], model: _Model) -> None:
    live = [s for slots in reqs.values() for s in slots]
    assert len(set(live)) == len(live), "a slot is handed out twice"
    p = model.p
    idle = set(model.free_list) | set(model.release)
    for slots in reqs.values():
        for i, s in enumerate(slots):
            assert 1 <= s // p <= model.num_pages
            assert s % p == i % p
            assert s // p not in idle


@st.composite
def _allocator(draw):
    if draw(st.booleans()):
        size = draw(st.integers(1, 40))
        return TokenAllocator(size), size, 1, True
    p = draw(st.sampled_from([1, 2, 4, 8]))
    size = draw(st.integers(1, 12)) * p
    return PagedAllocator(size, p), size, p, False


@settings(max_examples=25 * settings.default.max_examples, deadline=None)
@given(st.data(), _allocator())
def test_allocators_match_reference_model(data, alloc_spec):
    a, size, p, token_only = alloc_spec
    model = _Model(size, p)
    reqs: dict[int, list[int]] = {}
    next_id = 0
    saved = None
    ops = ["alloc", "free", "free_junk", "backup", "restore", "clear"]
    if not token_only:
        ops += ["extend", "extend", "decode", "decode"] + ["bad_alloc"] * (p > 1)

    for _ in range(data.draw(st.integers(1, 40), label="n_ops")):
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "alloc":
            n = data.draw(st.integers(0, (model.num_pages + 1) * p)) // p * p
            got, want = a.alloc(n), model.alloc(n)
            if want is None:
                assert got is None
            else:
                assert got.tolist() == want
                reqs[next_id] = want
                next_id += 1
        elif op == "bad_alloc":
            n = data.draw(st.integers(0, 3)) * p + data.draw(st.integers(1, p - 1))
            with pytest.raises(ValueError):
                a.alloc(n)
        elif op == "extend":
            ids = data.draw(
                st.lists(st.sampled_from(sorted(reqs)), unique=True, max_size=3)
                if reqs
                else st.just([])
            )
            ids += [None] * data.draw(st.integers(0, 2))
            ids = data.draw(st.permutations(ids))
            new = [data.draw(st.integers(0, 3 * p + 1)) for _ in ids]
            held = [reqs[i] if i is not None else [] for i in ids]
            got = a.alloc_extend(
                [len(h) for h in held],
                [len(h) + k for h, k in zip(held, new, strict=True)],
                [h[-1] if h else -1 for h in held],
            )
            want = model.extend(held, new)
            if want is None:
                assert got is None
            else:
                assert got.tolist() == [s for w in want for s in w]
                for i, w in zip(ids, want, strict=True):
                    if i is None:
                        i, next_id = next_id, next_id + 1
                        reqs[i] = []
                    reqs[i] = reqs[i] + w
        elif op == "decode":
            ids = data.draw(
                st.lists(st.sampled_from(sorted(reqs)), unique=True, max_size=4)
                if reqs
                else st.just([])
            )
            held = [reqs[i] for i in ids]
            got = a.alloc_decode([len(h) + 1 for h in held], [h[-1] if h else -1 for h in held])
            want = model.extend(held, [1] * len(held), decode=True)
            if want is None:
                assert got is None
            else:
                assert got.tolist() == [w[0] for w in want]
                for i, w in zip(ids, want, strict=True):
                    reqs[i] = reqs[i] + w
        elif op == "free" and reqs:
            i = data.draw(st.sampled_from(sorted(reqs)))
            slots = reqs.pop(i)
            slots = data.draw(st.permutations(slots + slots[: data.draw(st.integers(0, 3))]))
            a.free(np.asarray(slots, np.int64))
            model.free(slots)
            if data.draw(st.booleans()):  # double free
                a.free(np.asarray(slots, np.int64))
                model.free(slots)
        elif op == "free_junk":
            idle = model.free_list + model.release
            pool = list(range(-p - 2, p)) + [(model.num_pages + 1) * p + k for k in range(3)]
            pool += [q * p + o for q in idle for o in range(p)]
            junk = data.draw(st.lists(st.sampled_from(pool), max_size=6))
            a.free(np.asarray(junk, np.int64))
            model.free(junk)
        elif op == "backup":
            saved = (a.backup_state(), copy.deepcopy(model), copy.deepcopy(reqs), next_id)
        elif op == "restore" and saved is not None:
            a.restore_state(saved[0])
            model, reqs, next_id = copy.deepcopy(saved[1]), copy.deepcopy(saved[2]), saved[3]
        elif op == "clear":
            a.clear()
            model, reqs = _Model(size, p), {}
        assert a.available_size() == model.available()
        _check_live(reqs, model)


# --------------------------------------------------------------------------------------------
# ReqToTokenPool


def test_req_to_token_pool_table_shape_and_dtype():
    # One more row than requests: row 0 is the padding row padded batches point at.
    pool = ReqToTokenPool(4, 8)
    chex.assert_shape(pool.req_to_token, (5, 8))
    chex.assert_type(pool.req_to_token, jnp.int32)
    assert pool.available_size() == 4


def test_req_to_token_pool_never_hands_out_row_0_and_takes_from_the_tail():
    pool = ReqToTokenPool(4, 8)
    # SGLang pops the last free rows; a freed row goes to the tail and is handed out next.
    assert pool.alloc(2) == [3, 4]
    assert pool.alloc(1) == [2]
    pool.free(3)
    assert pool.alloc(2) == [1, 3]
    assert pool.alloc(1) is None
    pool.free([4, 2])
    pool.clear()
    assert pool.alloc(4) == [1, 2, 3, 4]


def test_req_to_token_pool_alloc_is_all_or_nothing():
    pool = ReqToTokenPool(4, 8)
    rows = pool.alloc(3)
    assert isinstance(rows, list) and len(set(rows)) == 3
    assert all(1 <= r <= 4 for r in rows)
    assert pool.available_size() == 1
    assert pool.alloc(2) is None
    assert pool.available_size() == 1
    (last,) = pool.alloc(1)
    assert sorted([*rows, last]) == [1, 2, 3, 4]
    assert pool.alloc(1) is None
    assert pool.alloc(0) == []


def test_req_to_token_pool_alloc_default_and_free():
    pool = ReqToTokenPool(3, 4)
    (r,) = pool.alloc()
    rows = pool.alloc(2)
    assert pool.available_size() == 0
    pool.free(r)
    assert pool.available_size() == 1
    assert pool.alloc(1) == [r]
    pool.free(rows)
    pool.free(np.int64(r))
    pool.free(r)  # a double free never lists a row twice
    assert pool.available_size() == 3
    assert sorted(pool.alloc(3)) == [1, 2, 3]


def test_req_to_token_pool_rejects_negative_alloc():
    pool = ReqToTokenPool(3, 4)
    with pytest.raises(ValueError):
        pool.alloc(-1)
    assert pool.available_size() == 3


@pytest.mark.parametrize("size, ctx", [(0, 8), (4, 0), (-1, 8), (4, -8)])
def test_req_to_token_pool_rejects_non_positive_sizes(size, ctx):
    with pytest.raises(ValueError):
        ReqToTokenPool(size, ctx)


def test_req_to_token_pool_free_rejects_bad_rows():
    pool = ReqToTokenPool(3, 4)
    pool.alloc(3)
    for bad in (4, -1, 0, [1, 7]):
        with pytest.raises((IndexError, ValueError), match="free_index"):
            pool.free(bad)
    # Row 0 is the padding row: freeing it would hand it to a request.
    assert pool.available_size() == 0


def test_req_to_token_pool_write_sets_the_row_slice():
    pool = ReqToTokenPool(4, 8)
    want = np.asarray(pool.req_to_token).copy()
    writes = [
        (1, 2, [5, 6, 7]),
        (1, 0, [9]),
        (4, 0, np.arange(20, 28)),
        (0, 7, [4]),  # the padding row can be written (padded batches do)
        (2, 3, []),
        (1, 3, np.array([11, 12], np.int64)),
    ]
    for row, start, slots in writes:
        pool = pool.write(row, start, slots)
        want[row, start : start + len(slots)] = slots
        chex.assert_shape(pool.req_to_token, (5, 8))
        chex.assert_type(pool.req_to_token, jnp.int32)
        np.testing.assert_array_equal(np.asarray(pool.req_to_token), want)


_SPENT = r"ReqToTokenPool was consumed by write\(\); use the ReqToTokenPool it returned"


def test_req_to_token_pool_write_consumes_the_old_pool_by_default():
    old = ReqToTokenPool(2, 4)
    new = old.write(1, 1, [3, 4])
    assert isinstance(new, ReqToTokenPool)
    assert old.consumed and not new.consumed
    # jaxkv's own error, naming the object and what to use, whether or not the backend
    # donated the buffer: the object is marked, not its buffer inspected.
    with pytest.raises(ConsumedPoolError, match=rf"ReqToTokenPool\.req_to_token: .*{_SPENT}"):
        np.asarray(old.req_to_token)
    with pytest.raises(ConsumedPoolError, match=rf"ReqToTokenPool\.write\(\): .*{_SPENT}"):
        old.write(1, 0, [9])
    with pytest.raises(ConsumedPoolError, match=_SPENT):  # refused before its arguments
        old.write(99, 0, [9])
    np.testing.assert_array_equal(
        np.asarray(new.req_to_token), [[0, 0, 0, 0], [0, 3, 4, 0], [0, 0, 0, 0]]
    )


def test_req_to_token_pool_rows_stay_shared_through_a_consumed_pool():
    # Row bookkeeping is the chain's, not the table's: an old reference still allocates and
    # frees for all of them (SGLang callers hold the pool across writes).
    old = ReqToTokenPool(3, 4)
    (row,) = old.alloc(1)
    new = old.write(row, 0, [5])
    assert old.consumed
    assert old.available_size() == new.available_size() == 2
    old.free(row)
    assert new.available_size() == 3
    assert new.alloc(1) == [row]
    old.clear()
    assert new.available_size() == 3


def test_req_to_token_pool_donate_false_leaves_the_old_pool_usable():
    old = ReqToTokenPool(2, 4)
    new = old.write(1, 0, [3], donate=False)
    assert not old.consumed
    old.write(2, 0, [4])  # still a live pool: it may be written (and so consumed) itself
    np.testing.assert_array_equal(np.asarray(new.req_to_token)[1:, 0], [3, 0])


def test_req_to_token_pool_refused_write_consumes_nothing():
    pool = ReqToTokenPool(2, 4)
    with pytest.raises(IndexError):
        pool.write(1, 3, [1, 2])
    assert not pool.consumed
    np.testing.assert_array_equal(np.asarray(pool.req_to_token), np.zeros((3, 4)))


def test_req_to_token_pool_write_keeps_the_old_table_with_donate_false():
    old = ReqToTokenPool(2, 4).write(2, 0, [7])
    before = np.asarray(old.req_to_token).copy()
    new = old.write(1, 0, [1, 2, 3, 4], donate=False)
    np.testing.assert_array_equal(np.asarray(old.req_to_token), before)
    want = before.copy()
    want[1] = [1, 2, 3, 4]
    np.testing.assert_array_equal(np.asarray(new.req_to_token), want)


def test_req_to_token_pool_write_shares_row_bookkeeping():
    old = ReqToTokenPool(4, 4)
    rows = old.alloc(1)
    new = old.write(rows[0], 0, [8], donate=False)
    assert new.available_size() == old.available_size() == 3
    got = new.alloc(2)
    assert old.available_size() == 1
    old.free(got)
    assert new.available_size() == 3
    assert sorted(rows + new.alloc(3)) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "row, start, n", [(5, 0, 1), (-1, 0, 1), (1, -1, 1), (1, 6, 3), (1, 9, 0), (1, 0, 9)]
)
def test_req_to_token_pool_write_rejects_bad_row_or_start(row, start, n):
    pool = ReqToTokenPool(4, 8).write(1, 0, [5, 6])
    before = np.asarray(pool.req_to_token).copy()
    with pytest.raises((IndexError, ValueError)):
        pool.write(row, start, np.arange(n))
    # A rejected write neither changes nor donates the table.
    np.testing.assert_array_equal(np.asarray(pool.req_to_token), before)


# --------------------------------------------------------------------------------------------
# The release list across many frees


@pytest.mark.parametrize("p", [1, 4])
def test_many_frees_release_each_page_once_and_merge_sorted(p):
    """Frees of unsorted slots, repeats within and across calls, page 0 and slots past the
    pool leave each page in the release list once; the merge hands them out sorted."""
    a = PagedAllocator(16 * p, p) if p > 1 else TokenAllocator(16)
    a.alloc(16 * p)
    frees = [[9, 3, 9, 14], [3, 0, 17], [12, 7, 12, 7, 5], [], [16, 1, -1, 14]]
    for pages in frees:
        a.free([s * p + p - 1 for s in pages] + [s * p for s in pages])  # both ends of a page
    released = sorted({s for f in frees for s in f if 1 <= s <= 16})
    assert a.available_size() == len(released) * p
    state = a.backup_state()
    assert sorted(state[1].tolist()) == released  # each page listed once
    assert _pages(a.alloc(len(released) * p), p) == released
    a.restore_state(state)  # the joined release list restores as it was
    assert _pages(a.alloc(len(released) * p), p) == released


# --------------------------------------------------------------------------------------------
# Hostile arguments: every call gives the right result, or a ValueError/TypeError/IndexError
# naming the argument, and changes nothing. Hand-picked cases first (each one a bug once), then
# a fuzzer.


def test_paged_allocator_size_must_be_a_multiple_of_page_size():
    with pytest.raises(ValueError, match=r"size: .*page_size=4, got size=10 \(use 8 or 12\)"):
        PagedAllocator(10, 4)
    assert PagedAllocator(np.int64(12), np.int32(4)).available_size() == 12


@pytest.mark.parametrize(
    "row, start, slots, err, name",
    [
        (1.5, 0, [1], TypeError, "row"),
        (1, 1.5, [1], TypeError, "start"),
        (True, 0, [1], TypeError, "row"),
        (1, 0, [[1, 2], [3, 4]], ValueError, "slots"),
        (1, 0, [2**32 + 1], ValueError, "slots"),
        (1, 0, [2**31], ValueError, "slots"),
        (1, 0, np.array([2**63], np.uint64), ValueError, "slots"),
        (1, 0, [1.0], TypeError, "slots"),
        (5, 0, [1], IndexError, "row"),
        (1, 7, [1, 2], IndexError, "start"),
    ],
)
def test_req_to_token_write_refuses_what_would_change_meaning(row, start, slots, err, name):
    pool = ReqToTokenPool(4, 8).write(1, 0, [5, 6])
    before = np.array(pool.req_to_token)
    with pytest.raises(err, match=name):
        pool.write(row, start, slots, donate=False)
    np.testing.assert_array_equal(np.array(pool.req_to_token), before)


def test_req_to_token_write_takes_numpy_ints_and_int32_extremes():
    pool = ReqToTokenPool(4, 8).write(np.int64(2), np.uint8(1), np.array([-1, 2**31 - 1]))
    assert np.array(pool.req_to_token)[2, 1:3].tolist() == [-1, 2**31 - 1]


def test_req_to_token_free_refuses_floats_without_freeing_anything():
    pool = ReqToTokenPool(4, 8)
    rows = pool.alloc(2)
    for bad in (1.5, [rows[0], 2.5], True, [[1]]):
        with pytest.raises((TypeError, ValueError), match="free_index"):
            pool.free(bad)
    assert pool.available_size() == 2
    pool.free(np.int32(rows[0]))
    assert pool.available_size() == 3


def test_allocator_vectors_must_be_one_dimensional():
    a = PagedAllocator(16, 4)
    before = a.backup_state()
    with pytest.raises(ValueError, match="seq_lens"):
        a.alloc_extend([0, 0], [[1, 2]], [-1, -1])
    with pytest.raises(ValueError, match="free_index"):
        a.free([[4, 5]])
    with pytest.raises(ValueError, match="last_loc"):  # past the pool: not a held page
        a.alloc_decode([2], [10**6 * 4])
    for got, want in zip(a.backup_state(), before):
        np.testing.assert_array_equal(got, want)


def _alloc_state(a):
    if isinstance(a, ReqToTokenPool):
        return list(a._rows.free_slots), np.array(a.req_to_token)
    return tuple(x.copy() for x in a.backup_state())


def _same(x, y) -> bool:
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return np.array_equal(x, y)


_CALLS = {
    "alloc": ("need_size",),
    "free": ("free_index",),
    "alloc_extend": ("prefix_lens", "seq_lens", "last_loc"),
    "alloc_decode": ("seq_lens", "last_loc"),
    "write": ("row", "start", "slots"),
}


@settings(
    max_examples=10 * settings.default.max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.data())
def test_fuzz_allocators(data):
    kind = data.draw(st.sampled_from(["token", "paged", "req"]))
    a = {
        "token": lambda: TokenAllocator(12),
        "paged": lambda: PagedAllocator(16, 4),
        "req": lambda: ReqToTokenPool(4, 8),
    }[kind]()
    if kind != "req":
        a.alloc(4)  # something held, so frees and extends have pages to talk about
    method = data.draw(
        st.sampled_from(
            {
                "token": ["alloc", "free"],
                "paged": ["alloc", "free", "alloc_extend", "alloc_decode"],
                "req": ["alloc", "free", "write"],
            }[kind]
        )
    )
    names = _CALLS[method]
    args = [data.draw(HOSTILE_ARG, label=n) for n in names]
    before = _alloc_state(a)
    available = a.available_size()
    try:
        out = getattr(a, method)(*args)
    except BOUNDARY_ERRORS as err:
        assert names_an_argument(err, names), f"{type(err).__name__}: {err}"
        assert _same(_alloc_state(a), before), f"{method} changed state before raising"
        return
    # Accepted: the result is a right one.
    if method == "write":
        assert isinstance(out, ReqToTokenPool)
        return
    if method == "free":
        assert out is None and a.available_size() >= available
        return
    if out is None:  # refused for want of room: nothing taken
        assert _same(_alloc_state(a), before)
        return
    taken = np.asarray(out).reshape(-1)
    if kind == "req":
        assert all(1 <= r <= a.size for r in taken) and len(set(taken)) == len(taken)
    else:
        end = (a.num_pages + 1) * a.page_size
        assert np.all((taken >= a.page_size) & (taken < end)), taken
    assert a.available_size() <= available
