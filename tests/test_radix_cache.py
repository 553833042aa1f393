"""`RadixCache` tests: the documented behaviour call by call, a property test against a plain
Python model of the semantics, and the store tier over a real `KVConnector` and `HostStore`.

The model (`_Model`) keeps the tree as SGLang describes it, without a tree: a dict from every
cached page prefix to that page's slots, and a dict from every prefix where a node ends to the
node's stamp and lock count. A node's parent is the longest shorter node end; its size is the
difference of their lengths; eviction scans every node for the unlocked leaf with the oldest
stamp. It shares no code with the cache.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_mha_pool, raw_rows, same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import MHAPool, PagedAllocator, PrefixMatch, RadixCache, TokenAllocator
from jaxkv.connector import HostStore, KVConnector

# --------------------------------------------------------------------------------------------
# Helpers


def _alloc(page: int, size: int = 64):
    return TokenAllocator(size) if page == 1 else PagedAllocator(size, page)


def _state(alloc) -> list[list[int]]:
    """The allocator's free lists as plain lists (comparable)."""
    return [a.tolist() for a in alloc.backup_state()]


def _sizes(cache) -> tuple[int, int, int]:
    return cache.evictable_size(), cache.protected_size(), cache.total_size()


def _trace(cache, pool=None) -> list:
    """Evicts one token at a time until nothing is evictable; each step's tokens evicted and
    the allocator's free lists after it. Two caches built alike give equal traces exactly when
    their trees (node boundaries, stamps, locks, slots) are alike."""
    steps = [_sizes(cache)]
    while n := cache.evict(1, pool=pool):
        steps.append((n, _state(cache.allocator)))
    return steps + [_sizes(cache)]


class _Recording(PagedAllocator):
    """A `PagedAllocator` that records the slots each `free` call is given."""

    def __init__(self, size, page_size):
        super().__init__(size, page_size)
        self.freed: list[int] = []

    def free(self, free_index):
        self.freed.extend(np.asarray(free_index).tolist())
        super().free(free_index)


# --------------------------------------------------------------------------------------------
# The tree


def test_construction_checks_its_arguments():
    with pytest.raises(TypeError, match="allocator"):
        RadixCache(object())
    with pytest.raises(ValueError, match="write_policy"):
        RadixCache(TokenAllocator(8), write_policy="lru")
    with pytest.raises(TypeError, match="connector"):
        RadixCache(TokenAllocator(8), connector=object())
    pool = random_mha_pool(size=16)
    conn = KVConnector(pool, HostStore(1 << 20), block_size=2)
    with pytest.raises(ValueError, match="connector: expected a block_size"):
        RadixCache(PagedAllocator(16, 4), connector=conn)


@pytest.mark.parametrize("page", [1, 4])
def test_empty_and_sub_page_prompts(page):
    alloc = _alloc(page)
    cache = RadixCache(alloc)
    cache.insert(np.arange(2 * page), alloc.alloc(2 * page))
    before = _sizes(cache)
    for prompt in ([], np.arange(page - 1)):
        m = cache.match_prefix(prompt)
        assert m.slots.dtype.kind == "i" and m.slots.shape == (0,)
        assert m.stored_tokens == 0
        assert cache.inc_lock_ref(m.node) == 0
        assert _sizes(cache) == before
        assert cache.dec_lock_ref(m.node) == 0
        assert cache.dec_lock_ref(m.node) == 0  # the root holds no count to unbalance
        assert cache.insert(prompt, np.zeros(len(prompt), int)) == 0
        assert _sizes(cache) == before
    # The root is the handle of every empty match.
    assert cache.match_prefix([]).node is cache.match_prefix([99] * page).node


def test_partial_tail_pages_are_dropped_by_insert_and_ignored_by_match():
    alloc = PagedAllocator(64, 4)
    cache = RadixCache(alloc)
    slots = alloc.alloc(12)
    assert cache.insert(np.arange(10), slots[:10]) == 0
    assert cache.total_size() == 8
    np.testing.assert_array_equal(cache.match_prefix(np.arange(11)).slots, slots[:8])
    np.testing.assert_array_equal(cache.match_prefix(np.arange(7)).slots, slots[:4])
    # The tail page stays the caller's: evicting everything frees only the cached pages.
    free_before = alloc.available_size()
    assert cache.evict(100) == 8
    assert alloc.available_size() == free_before + 8


@pytest.mark.parametrize("page", [1, 4])
def test_insert_returns_the_cached_length_and_takes_only_new_slots(page):
    alloc = _alloc(page)
    cache = RadixCache(alloc)
    first = alloc.alloc(2 * page)
    assert cache.insert(np.arange(2 * page), first) == 0
    second = alloc.alloc(3 * page)
    tokens = np.arange(3 * page)
    assert cache.insert(tokens, second) == 2 * page
    assert cache.total_size() == 3 * page
    want = np.concatenate([first, second[2 * page :]])
    np.testing.assert_array_equal(cache.match_prefix(tokens).slots, want)
    # The slots insert did not take are the caller's to free; the cache never frees them.
    alloc.free(second[: 2 * page])
    available = alloc.available_size()
    assert cache.evict(10**6) == 3 * page
    assert alloc.available_size() == available + 3 * page
    assert alloc.available_size() == alloc.size


@pytest.mark.parametrize("page", [1, 4])
def test_handles_keep_naming_their_prefix_end_across_splits(page):
    alloc = _alloc(page, 128)
    cache = RadixCache(alloc)
    tokens = np.arange(16 * page)
    slots = alloc.alloc(16 * page)
    cache.insert(tokens, slots)
    h16 = cache.match_prefix(tokens).node
    m8 = cache.match_prefix(tokens[: 8 * page])  # ends inside the edge: split there
    h8 = m8.node
    np.testing.assert_array_equal(m8.slots, slots[: 8 * page])
    # A later split above both handles (a new branch after 4 pages).
    branch = np.concatenate([tokens[: 4 * page], np.full(page, 999)])
    assert cache.insert(branch, np.concatenate([slots[: 4 * page], alloc.alloc(page)])) == 4 * page
    assert cache.match_prefix(tokens[: 8 * page]).node is h8
    assert cache.inc_lock_ref(h8) == -8 * page
    assert cache.protected_size() == 8 * page
    assert cache.inc_lock_ref(h16) == -8 * page  # only the part below h8 was unlocked
    assert cache.protected_size() == 16 * page
    assert cache.dec_lock_ref(h8) == 0  # still locked through h16
    assert cache.dec_lock_ref(h16) == 16 * page
    assert _sizes(cache) == (17 * page, 0, 17 * page)


def test_lock_deltas_nest_and_unbalanced_unlocks_are_refused():
    alloc = TokenAllocator(32)
    cache = RadixCache(alloc)
    cache.insert(np.arange(8), alloc.alloc(8))
    h = cache.match_prefix(np.arange(8)).node
    with pytest.raises(ValueError, match="one more dec_lock_ref than inc_lock_ref"):
        cache.dec_lock_ref(h)
    assert _sizes(cache) == (8, 0, 8)
    assert cache.inc_lock_ref(h) == -8
    assert cache.inc_lock_ref(h) == 0
    assert cache.dec_lock_ref(h) == 0
    assert cache.dec_lock_ref(h) == 8
    with pytest.raises(ValueError, match="one more dec_lock_ref"):
        cache.dec_lock_ref(h)
    # A lock taken through a longer prefix is not the shorter handle's to release.
    upper = cache.match_prefix(np.arange(4)).node
    cache.inc_lock_ref(h)
    with pytest.raises(ValueError, match="one more dec_lock_ref"):
        cache.dec_lock_ref(upper)
    assert _sizes(cache) == (0, 8, 8)
    assert cache.dec_lock_ref(h) == 8


def test_handles_of_evicted_or_other_caches_are_refused():
    alloc = TokenAllocator(32)
    cache, other = RadixCache(alloc), RadixCache(TokenAllocator(8))
    cache.insert(np.arange(4), alloc.alloc(4))
    h = cache.match_prefix(np.arange(4)).node
    with pytest.raises(TypeError, match="node"):
        other.inc_lock_ref(h)
    with pytest.raises(TypeError, match="node"):
        cache.inc_lock_ref(object())
    assert cache.evict(4) == 4
    with pytest.raises(ValueError, match="evicted"):
        cache.inc_lock_ref(h)
    assert _sizes(cache) == (0, 0, 0)


def test_evict_with_everything_locked_frees_nothing():
    alloc = TokenAllocator(32)
    cache = RadixCache(alloc)
    for start in (0, 100):
        tokens = np.arange(start, start + 6)
        cache.insert(tokens, alloc.alloc(6))
        cache.inc_lock_ref(cache.match_prefix(tokens).node)
    free = _state(alloc)
    assert cache.evict(5) == 0
    assert cache.evict(0) == 0
    assert _sizes(cache) == (0, 12, 12)
    assert _state(alloc) == free


def test_evict_checks_num_tokens():
    cache = RadixCache(TokenAllocator(8))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_tokens"):
            cache.evict(bad)


def test_recency_walked_nodes_are_older_than_created_ones():
    """SGLang's example: insert [0..7], then [0..3, 9..12]. The second insert walks the first
    node (stamped with the call's time), splits it (the upper half [0..3] is created, newer) and
    adds [9..12] (created, newer): `evict(1)` frees [4..7] first."""
    alloc = _Recording(64, 1)
    cache = RadixCache(alloc)
    a, b = alloc.alloc(8), alloc.alloc(4)
    cache.insert(np.arange(8), a)
    cache.insert([0, 1, 2, 3, 9, 10, 11, 12], np.concatenate([a[:4], b]))
    assert cache.evict(1) == 4
    assert alloc.freed == a[4:].tolist()
    assert cache.evict(1) == 4
    assert alloc.freed[4:] == b.tolist()
    assert cache.evict(1) == 4  # [0..3], a leaf now
    assert alloc.freed[8:] == a[:4].tolist()


def test_match_refreshes_recency_and_parents_compete_by_their_own_stamp():
    alloc = _Recording(64, 1)
    cache = RadixCache(alloc)
    x, y, z = alloc.alloc(4), alloc.alloc(4), alloc.alloc(4)
    cache.insert([1, 2, 3, 4], x)
    cache.insert([5, 6, 7, 8], y)
    cache.insert([1, 2, 3, 4, 9, 9, 9, 9], np.concatenate([x, z]))
    cache.match_prefix([1, 2, 3, 4])  # stamps [1..4] after [5..8]; the leaf under it is newer
    assert cache.evict(1) == 4
    assert alloc.freed == y.tolist()
    assert cache.evict(5) == 8  # the leaf, then its parent (a leaf by then)
    assert alloc.freed[4:] == z.tolist() + x.tolist()


def test_salts_are_separate_namespaces():
    alloc = TokenAllocator(64)
    cache = RadixCache(alloc)
    tokens = np.arange(8)
    s_a = alloc.alloc(8)
    assert cache.insert(tokens, s_a, salt="a") == 0
    np.testing.assert_array_equal(cache.match_prefix(tokens, salt=b"a").slots, s_a)
    for other in (None, "", b"b", "A"):
        assert cache.match_prefix(tokens, salt=other).slots.size == 0
    assert cache.insert(tokens, alloc.alloc(8), salt=None) == 0
    assert cache.insert(tokens, alloc.alloc(8), salt="") == 0  # "" is not None
    assert cache.insert(tokens, alloc.alloc(8), salt=b"") == 8  # but b"" is ""
    assert cache.total_size() == 24
    with pytest.raises(TypeError, match="salt"):
        cache.match_prefix(tokens, salt=0)
    with pytest.raises(ValueError, match="salt"):
        cache.match_prefix(tokens, salt="\ud800")


@pytest.mark.parametrize("page", [1, 4])
def test_insert_checks_slots_and_changes_nothing_when_it_refuses(page):
    alloc = _alloc(page)
    cache = RadixCache(alloc)
    held = alloc.alloc(2 * page)
    cache.insert(np.arange(2 * page), held)
    fresh = alloc.alloc(2 * page)
    tokens = np.arange(100, 100 + 2 * page)
    bad = {
        "one slot per token": fresh[:-1],
        "allocator's slots": np.concatenate([fresh[:-1], [10**6]]),
        "does not hold": held,
        "distinct pages": np.concatenate([fresh[:page], fresh[:page]]),
    }
    if page > 1:
        bad["whole pages"] = fresh[::-1]
    before, free = _sizes(cache), _state(alloc)
    for why, slots in bad.items():
        with pytest.raises(ValueError, match=why):
            cache.insert(tokens, slots)
        assert _sizes(cache) == before and _state(alloc) == free
    with pytest.raises(TypeError, match="slots"):
        cache.insert(tokens, fresh.astype(float))
    assert cache.insert(tokens, fresh) == 0


def test_token_ids_are_checked():
    cache = RadixCache(TokenAllocator(8))
    with pytest.raises(ValueError, match="token_ids"):
        cache.match_prefix(np.zeros((2, 2), int))
    with pytest.raises(TypeError, match="token_ids"):
        cache.match_prefix([0.5, 1.0])
    with pytest.raises(ValueError, match="token_ids"):
        cache.match_prefix([-1, 2])
    with pytest.raises(ValueError, match="token_ids"):
        cache.match_prefix([2**32])


def test_long_edges_match_to_the_first_differing_page():
    alloc = PagedAllocator(4096, 4)
    cache = RadixCache(alloc)
    tokens = np.arange(4000) % 7
    slots = alloc.alloc(4000)
    cache.insert(tokens, slots)
    for cut in (4, 60, 64, 68, 1000, 3996):
        probe = tokens.copy()
        probe[cut + 1] += 1  # differs inside the page starting at `cut`
        np.testing.assert_array_equal(cache.match_prefix(probe).slots, slots[:cut])


# --------------------------------------------------------------------------------------------
# Property test against a plain model


class _Model:
    """The cache's semantics over dicts of prefixes (see the module docstring)."""

    def __init__(self, page: int):
        self.page = page
        self.pages: dict[tuple, list[int]] = {}  # (salt, prefix ending a page) -> its slots
        self.nodes: dict[tuple, dict] = {}  # (salt, prefix ending a node) -> stamp, locks
        self.clock = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _below(self, key) -> list[tuple]:
        """The node ends at or below `key` (the prefix and every longer one extending it)."""
        salt, toks = key
        return [e for e in self.nodes if e[0] == salt and e[1][: len(toks)] == toks]

    def _parent_len(self, key) -> int:
        salt, toks = key
        for k in range(len(toks) - self.page, 0, -self.page):
            if (salt, toks[:k]) in self.nodes:
                return k
        return 0

    def size(self, key) -> int:
        return len(key[1]) - self._parent_len(key)

    def lock_ref(self, key) -> int:
        return sum(self.nodes[e]["locks"] for e in self._below(key))

    def _path(self, key) -> list[tuple]:
        salt, toks = key
        return [e for e in self.nodes if e[0] == salt and toks[: len(e[1])] == e[1]]

    def _walk(self, toks: tuple, salt):
        m = 0
        while m < len(toks) and (salt, toks[: m + self.page]) in self.pages:
            m += self.page
        if m == 0:
            return 0, None
        now = self._tick()
        for e in self._path((salt, toks[:m])):
            self.nodes[e]["stamp"] = now
        holder = min(self._below((salt, toks[:m])), key=lambda e: len(e[1]))
        self.nodes[holder]["stamp"] = now
        if len(holder[1]) > m:  # split: the upper half is created now
            self.nodes[(salt, toks[:m])] = {"stamp": self._tick(), "locks": 0}
        return m, (salt, toks[:m])

    def match(self, toks, salt):
        toks = tuple(toks[: len(toks) // self.page * self.page])
        m, node = self._walk(toks, salt)
        slots = [
            s for k in range(self.page, m + 1, self.page) for s in self.pages[(salt, toks[:k])]
        ]
        return slots, node

    def insert(self, toks, slots, salt) -> int:
        n = len(toks) // self.page * self.page
        toks = tuple(toks[:n])
        m, _ = self._walk(toks, salt)
        for k in range(m, n, self.page):
            self.pages[(salt, toks[: k + self.page])] = list(slots[k : k + self.page])
        if m < n:
            self.nodes[(salt, toks)] = {"stamp": self._tick(), "locks": 0}
        return m

    def lock(self, key) -> int:
        if key is None:
            return 0
        delta = -sum(self.size(e) for e in self._path(key) if self.lock_ref(e) == 0)
        self.nodes[key]["locks"] += 1
        return delta

    def unlock(self, key) -> int:
        if key is None:
            return 0
        self.nodes[key]["locks"] -= 1
        return sum(self.size(e) for e in self._path(key) if self.lock_ref(e) == 0)

    def evict(self, num: int) -> tuple[list[int], list[tuple]]:
        """The slots freed, in eviction order, and the node ends evicted."""
        freed: list[int] = []
        victims = []
        while len(freed) < num:
            leaves = [e for e in self.nodes if len(self._below(e)) == 1 and not self.lock_ref(e)]
            if not leaves:
                break
            stamps = sorted(self.nodes[e]["stamp"] for e in leaves)
            assert len(stamps) < 2 or stamps[0] < stamps[1], "two leaves share a stamp"
            victim = min(leaves, key=lambda e: self.nodes[e]["stamp"])
            salt, toks = victim
            for k in range(self._parent_len(victim) + self.page, len(toks) + 1, self.page):
                freed += self.pages.pop((salt, toks[:k]))
            del self.nodes[victim]
            victims.append(victim)
        return freed, victims

    def sizes(self) -> tuple[int, int, int]:
        locked = sum(self.size(e) for e in self.nodes if self.lock_ref(e))
        total = len(self.pages) * self.page
        return total - locked, locked, total


def _prompts(page: int):
    """Prompts that share prefixes: each is a cut of an earlier one (or of a base) plus a few
    tokens from a 3-letter alphabet, so matches end inside edges and at their ends."""
    letters = st.integers(0, 2)

    @st.composite
    def build(draw):
        base = draw(st.lists(letters, min_size=2 * page, max_size=8 * page))
        prompts = [base]
        for _ in range(draw(st.integers(2, 5))):
            parent = prompts[draw(st.integers(0, len(prompts) - 1))]
            cut = draw(st.integers(0, len(parent)))
            prompts.append(parent[:cut] + draw(st.lists(letters, min_size=1, max_size=3 * page)))
        return prompts

    return build()


# (operation, argument, salt): the argument picks a prompt or a handle, or is the number of
# tokens to evict (modulo 13). Inserts and matches come twice as often as the rest.
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "match", "match", "lock", "unlock", "evict"]),
        st.integers(0, 30),
        st.sampled_from([None, "t"]),
    ),
    min_size=8,
    max_size=50,
)


@pytest.mark.parametrize("page", [1, 4])
@settings(max_examples=10 * settings.default.max_examples, deadline=None)
@given(data=st.data())
def test_matches_the_plain_model(page, data):
    prompts = data.draw(_prompts(page))
    ops = data.draw(_OPS)
    alloc = _Recording(64 * page, page)
    cache, model = RadixCache(alloc), _Model(page)
    # [cache handle, model node end (None: the root), still alive]. A handle dies with its
    # node, and stays dead when the same prefix is cached again later (a new node).
    handles: list[list] = []
    for op in ops:
        if op[0] == "match":
            toks, salt = prompts[op[1] % len(prompts)], op[2]
            got, (slots, key) = cache.match_prefix(toks, salt=salt), model.match(toks, salt)
            assert got.slots.tolist() == slots
            handles.append([got.node, key, True])
        elif op[0] == "insert":
            toks, salt = prompts[op[1] % len(prompts)], op[2]
            n = len(toks) // page * page
            slots = alloc.alloc(n)
            if slots is None:
                continue
            slots = np.concatenate([slots, np.zeros(len(toks) - n, int)])
            m = cache.insert(toks, slots, salt=salt)
            assert m == model.insert(toks, slots.tolist(), salt)
            alloc.free(slots[:m])  # the caller's: insert did not take them
        elif op[0] in ("lock", "unlock") and handles:
            node, key, alive = handles[op[1] % len(handles)]
            if not alive:
                with pytest.raises(ValueError):
                    (cache.inc_lock_ref if op[0] == "lock" else cache.dec_lock_ref)(node)
            elif op[0] == "lock":
                assert cache.inc_lock_ref(node) == model.lock(key)
            elif key is not None and model.nodes[key]["locks"] == 0:
                with pytest.raises(ValueError, match="one more dec_lock_ref"):
                    cache.dec_lock_ref(node)
            else:
                assert cache.dec_lock_ref(node) == model.unlock(key)
        elif op[0] == "evict":
            alloc.freed.clear()
            available = alloc.available_size()
            freed, victims = model.evict(op[1] % 13)
            assert cache.evict(op[1] % 13) == len(freed)
            assert alloc.freed == freed
            assert alloc.available_size() == available + len(freed)  # none was free before
            for h in handles:
                h[2] = h[2] and h[1] not in victims
        evictable, protected, total = _sizes(cache)
        assert (evictable, protected, total) == model.sizes()
        assert evictable + protected == total
        # Every slot is either free or held by the cache, and held once.
        held = [s for v in model.pages.values() for s in v]
        assert len(set(held)) == len(held) == total
        assert alloc.available_size() + total == alloc.size
    for node, key, alive in handles:
        while alive and key is not None and model.nodes[key]["locks"]:
            assert cache.dec_lock_ref(node) == model.unlock(key)
    assert cache.evict(10**6) == len(model.evict(10**6)[0])
    assert _sizes(cache) == (0, 0, 0)
    assert alloc.available_size() == alloc.size
