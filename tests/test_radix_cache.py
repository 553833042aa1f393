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
from helpers import random_mha_pool, raw_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import MHAPool, PagedAllocator, PrefixMatch, RadixCache, TokenAllocator, testing
from jaxkv.connector import HostStore, KVConnector
from jaxkv.radix_cache import StoreConnector

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


# --------------------------------------------------------------------------------------------
# The store tier, over a real connector and HostStore


def _pool(page: int, size: int = 64, seed: int = 0) -> MHAPool:
    """An MHA pool (2 layers) whose every row holds random values."""
    if page == 1:
        return random_mha_pool(seed, size=size, head_dim=4, layer_num=2)
    pool = MHAPool.create(
        size=size, page_size=page, dtype=np.float32, head_num=1, head_dim=4, layer_num=2
    )
    return _scribble(pool, np.arange(pool.size + page), seed)


def _scribble(pool, slots, seed: int):
    """`pool` with new random values in rows `slots` of every layer."""
    rng = np.random.default_rng(seed + 1000)
    shape = (len(slots), pool.head_num, pool.head_dim)
    for layer in range(pool.layer_num):
        k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        pool = pool.set_kv(layer, np.asarray(slots), k, v)
    return pool


class _Faulty(KVConnector):
    """A `KVConnector` whose `lookup`, `store` or `load` raise while named in `failing`, and
    whose `load` finds only the first block asked for while `"short"` is named there (as if
    the store had lost the others since `lookup`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failing: set[str] = set()

    def _check(self, name: str) -> None:
        if name in self.failing:
            raise OSError(f"injected {name} failure")

    def lookup(self, *args, **kwargs):
        self._check("lookup")
        return super().lookup(*args, **kwargs)

    def store(self, *args, **kwargs):
        self._check("store")
        return super().store(*args, **kwargs)

    def load(self, pool, token_ids, slots, *, salt=None, start=0):
        self._check("load")
        if "short" in self.failing:
            end = start + self.block_size
            token_ids, slots = token_ids[:end], slots[: self.block_size]
        return super().load(pool, token_ids, slots, salt=salt, start=start)


def _tiered(page=1, size=64, block=4, policy="write_back", seed=0):
    pool = _pool(page, size, seed)
    conn = _Faulty(pool, HostStore(1 << 22), block_size=block)
    alloc = _alloc(page, size)
    return RadixCache(alloc, connector=conn, write_policy=policy), alloc, pool, conn


@pytest.mark.parametrize("page, block, n", [(1, 4, 26), (4, 8, 28)])
def test_an_evicted_prefix_is_found_in_the_store_and_loaded_back_bit_exact(page, block, n):
    cache, alloc, pool, conn = _tiered(page, block=block)
    tokens = np.arange(n) + 7
    slots = alloc.alloc(n)
    cache.insert(tokens, slots)
    stored = n // block * block  # the tail of a partial block is not storable
    want = raw_rows(pool, slots[:stored])
    assert cache.evict(10**6, pool=pool) == n
    assert conn.lookup(tokens) == stored
    pool = _scribble(pool, slots, seed=5)  # the freed rows now hold other data
    m = cache.match_prefix(np.concatenate([tokens, [1, 2, 3]]))
    assert m.slots.size == 0 and m.stored_tokens == stored
    free = alloc.available_size()
    pool, got = cache.load_back(pool, tokens, m)
    assert isinstance(got, PrefixMatch)
    assert got.slots.size == stored and got.stored_tokens == 0
    testing.assert_bits_equal(raw_rows(pool, got.slots), want)
    assert alloc.available_size() == free - stored
    again = cache.match_prefix(tokens)
    np.testing.assert_array_equal(again.slots, got.slots)
    assert again.node is got.node
    assert _sizes(cache) == (stored, 0, stored)


def test_write_back_eviction_needs_the_pool():
    cache, alloc, _, _ = _tiered()
    cache.insert(np.arange(8), alloc.alloc(8))
    free = _state(alloc)
    with pytest.raises(ValueError, match="pool: expected the current pool"):
        cache.evict(8)
    assert _sizes(cache) == (8, 0, 8) and _state(alloc) == free


def test_load_back_starts_at_the_block_holding_the_device_match_end():
    """Device match of 6 tokens, blocks of 4: the store is asked from token 4 on, only tokens
    past 6 count as stored, and the slots loaded for tokens 4..5 go back to the allocator."""
    cache, alloc, pool, conn = _tiered(block=4)
    tokens = np.arange(12) + 3
    slots = alloc.alloc(12)
    cache.insert(tokens, slots)
    want = raw_rows(pool, slots)
    cache.evict(12, pool=pool)
    pool = _scribble(pool, slots, seed=7)
    head = alloc.alloc(6)
    cache.insert(tokens[:6], head)
    m = cache.match_prefix(tokens)
    np.testing.assert_array_equal(m.slots, head)
    assert m.stored_tokens == 6
    free = alloc.available_size()
    pool, got = cache.load_back(pool, tokens, m)
    assert alloc.available_size() == free - 6
    np.testing.assert_array_equal(got.slots[:6], head)
    testing.assert_bits_equal(raw_rows(pool, got.slots[6:]), want[:, 6:])
    assert cache.total_size() == 12


def test_load_back_evicts_when_the_allocator_is_short_but_never_the_match():
    cache, alloc, pool, conn = _tiered(size=16, block=4)
    x, y = np.arange(12), np.arange(50, 62)
    slots = alloc.alloc(12)
    cache.insert(x, slots)
    want = raw_rows(pool, slots)
    cache.evict(12, pool=pool)
    pool = _scribble(pool, slots, seed=3)
    cache.insert(y, alloc.alloc(12))
    head = alloc.alloc(4)
    cache.insert(x[:4], head)  # newer than y: without the lock, it would be evicted after y
    cache.match_prefix(y)  # y is now the most recent: only the lock keeps x[:4] on the device
    m = cache.match_prefix(x)
    assert alloc.available_size() == 0 and m.stored_tokens == 8
    pool, got = cache.load_back(pool, x, m)
    np.testing.assert_array_equal(got.slots[:4], head)
    testing.assert_bits_equal(raw_rows(pool, got.slots[4:]), want[:, 4:])
    assert cache.match_prefix(y).slots.size == 0  # evicted for room, and written back
    assert conn.lookup(y) == 12
    assert _sizes(cache) == (12, 0, 12) and alloc.available_size() == 4


def test_load_back_gives_back_the_slots_it_could_not_fill():
    cache, alloc, pool, conn = _tiered(block=4)
    tokens = np.arange(12)
    slots = alloc.alloc(12)
    cache.insert(tokens, slots)
    cache.evict(12, pool=pool)
    m = cache.match_prefix(tokens)
    assert m.stored_tokens == 12
    conn.failing.add("short")
    free = alloc.available_size()
    pool, got = cache.load_back(pool, tokens, m)
    assert got.slots.size == 4 and got.stored_tokens == 0
    assert alloc.available_size() == free - 4
    assert _sizes(cache) == (4, 0, 4)


def test_load_back_without_anything_to_load_returns_the_match():
    cache, alloc, pool, _ = _tiered()
    m = cache.match_prefix(np.arange(8))
    assert m.stored_tokens == 0
    out_pool, got = cache.load_back(pool, np.arange(8), m)
    assert got is m and out_pool is pool
    plain = RadixCache(TokenAllocator(8))
    m = plain.match_prefix([1, 2])
    assert plain.load_back(pool, [1, 2], m) == (pool, m)


def test_load_back_checks_its_match():
    cache, alloc, pool, _ = _tiered(block=4)
    tokens = np.arange(8)
    cache.insert(tokens, alloc.alloc(8))
    m = cache.match_prefix(tokens)
    with pytest.raises(TypeError, match="match"):
        cache.load_back(pool, tokens, (m.slots, m.node))
    with pytest.raises(ValueError, match="match: expected the match of these token_ids"):
        cache.load_back(pool, np.arange(100, 108), m)
    with pytest.raises(ValueError, match="match: expected the match of these token_ids"):
        cache.load_back(pool, tokens, m, salt="other")
    cache.evict(8, pool=pool)
    with pytest.raises(ValueError, match="still cached"):
        cache.load_back(pool, tokens, m)


def test_a_locked_prefix_is_never_evicted_nor_written():
    cache, alloc, pool, conn = _tiered(block=4)
    a, b = np.arange(8), np.arange(100, 112)
    a_slots = alloc.alloc(8)
    cache.insert(a, a_slots)
    cache.insert(b, alloc.alloc(12))
    cache.inc_lock_ref(cache.match_prefix(a).node)
    assert cache.evict(10**6, pool=pool) == 12
    np.testing.assert_array_equal(cache.match_prefix(a).slots, a_slots)
    assert conn.lookup(a) == 0 and conn.lookup(b) == 12
    assert _sizes(cache) == (0, 8, 8)


def test_a_salted_prefix_never_matches_under_another_salt_in_the_tree_or_the_store():
    cache, alloc, pool, conn = _tiered(block=4)
    tokens = np.arange(12)
    slots = alloc.alloc(12)
    cache.insert(tokens, slots, salt="t1")
    want = raw_rows(pool, slots)
    for other in ("t2", None, ""):
        m = cache.match_prefix(tokens, salt=other)
        assert m.slots.size == 0 and m.stored_tokens == 0
    cache.evict(12, pool=pool)
    pool = _scribble(pool, slots, seed=9)
    for other in ("t2", None, ""):
        m = cache.match_prefix(tokens, salt=other)
        assert m.slots.size == 0 and m.stored_tokens == 0
        assert cache.load_back(pool, tokens, m, salt=other)[1] is m
    m = cache.match_prefix(tokens, salt=b"t1")
    assert m.stored_tokens == 12
    pool, got = cache.load_back(pool, tokens, m, salt="t1")
    testing.assert_bits_equal(raw_rows(pool, got.slots), want)
    assert cache.match_prefix(tokens).slots.size == 0


class _Wrapped:
    """A connector that is no `KVConnector`: the four members of `StoreConnector`, passed on
    to a real one, each call recorded."""

    def __init__(self, conn):
        self.conn, self.calls = conn, []

    @property
    def block_size(self):
        return self.conn.block_size

    def lookup(self, token_ids, *, salt=None, start=0):
        self.calls.append("lookup")
        return self.conn.lookup(token_ids, salt=salt, start=start)

    def store(self, pool, token_ids, slots, *, salt=None):
        self.calls.append("store")
        return self.conn.store(pool, token_ids, slots, salt=salt)

    def load(self, pool, token_ids, slots, *, salt=None, start=0):
        self.calls.append("load")
        return self.conn.load(pool, token_ids, slots, salt=salt, start=start)


def test_the_connector_is_any_object_with_the_four_members_the_tier_calls():
    pool = _pool(1)
    conn = _Wrapped(KVConnector(pool, HostStore(1 << 22), block_size=4))
    assert isinstance(conn, StoreConnector)
    assert isinstance(KVConnector(pool, HostStore(1 << 20), block_size=4), StoreConnector)
    alloc = _alloc(1)
    cache = RadixCache(alloc, connector=conn)
    tokens = np.arange(8)
    slots = alloc.alloc(8)
    cache.insert(tokens, slots)
    want = raw_rows(pool, slots)
    assert cache.evict(8, pool=pool) == 8
    m = cache.match_prefix(tokens)
    assert m.stored_tokens == 8
    pool, got = cache.load_back(pool, tokens, m)
    testing.assert_bits_equal(raw_rows(pool, got.slots), want)
    assert conn.calls == ["store", "lookup", "load"]


@pytest.mark.parametrize("missing", ["block_size", "lookup", "store", "load"])
def test_a_connector_without_a_member_is_refused_naming_it(missing):
    members = {
        name: (lambda *a, **k: 0) if name != "block_size" else 4
        for name in ("block_size", "lookup", "store", "load")
        if name != missing
    }
    duck = type("Duck", (), members)()
    with pytest.raises(TypeError, match=rf"connector: expected .* got Duck without {missing}$"):
        RadixCache(TokenAllocator(8), connector=duck)


def test_a_connector_whose_method_is_not_callable_is_refused():
    duck = type("Duck", (), {"block_size": 4, "lookup": None, "store": len, "load": len})()
    with pytest.raises(TypeError, match="connector: .* with a lookup that is not callable"):
        RadixCache(TokenAllocator(8), connector=duck)


def test_write_through_stores_at_insert_and_needs_the_pool():
    cache, alloc, pool, conn = _tiered(block=4, policy="write_through")
    tokens = np.arange(10)
    slots = alloc.alloc(10)
    with pytest.raises(ValueError, match="pool: expected the current pool"):
        cache.insert(tokens, slots)
    assert cache.total_size() == 0
    assert cache.insert(tokens, slots, pool=pool) == 0
    assert conn.lookup(tokens) == 8
    longer = np.arange(14)
    more = alloc.alloc(4)
    assert cache.insert(longer, np.concatenate([slots, more]), pool=pool) == 10
    assert conn.lookup(longer) == 12
    assert cache.evict(10**6) == 14  # nothing left to write: no pool needed
    assert cache.match_prefix(longer).stored_tokens == 12


def test_without_a_write_policy_the_store_is_only_read():
    cache, alloc, pool, conn = _tiered(block=4, policy=None)
    tokens = np.arange(8)
    slots = alloc.alloc(8)
    cache.insert(tokens, slots, pool=pool)
    assert cache.evict(8) == 8
    assert conn.lookup(tokens) == 0
    assert conn.store(pool, tokens, alloc.alloc(8)) == 2  # another writer fills the store
    assert cache.match_prefix(tokens).stored_tokens == 8


# ---- all or nothing, with failures injected -------------------------------------------------


def _twins(build):
    """Two caches set up by `build(cache, alloc, pool)` alike, with their pools."""
    out = []
    for _ in range(2):
        cache, alloc, pool, conn = _tiered(size=32, block=4)
        out.append((cache, alloc, build(cache, alloc, pool), conn))
    return out


def _two_prompts(cache, alloc, pool):
    cache.insert(np.arange(12), alloc.alloc(12))
    cache.insert(np.arange(100, 108), alloc.alloc(8))
    return pool


def test_a_failing_lookup_leaves_the_tree_as_it_was():
    (a, _, pool_a, conn_a), (b, _, pool_b, _) = _twins(_two_prompts)
    conn_a.failing.add("lookup")
    with pytest.raises(OSError, match="injected"):
        # Matched, it would split [0..11] after 6 tokens and stamp it newer than [100..107].
        a.match_prefix(np.r_[0:6, 50:56])
    conn_a.failing.clear()
    assert _trace(a, pool_a) == _trace(b, pool_b)


def test_a_failing_write_back_evicts_nothing():
    (a, alloc_a, pool_a, conn_a), (b, _, pool_b, _) = _twins(_two_prompts)
    free = _state(alloc_a)
    conn_a.failing.add("store")
    with pytest.raises(OSError, match="injected"):
        a.evict(20, pool=pool_a)
    assert _state(alloc_a) == free
    conn_a.failing.clear()
    assert _trace(a, pool_a) == _trace(b, pool_b)


def test_a_failing_write_through_caches_nothing():
    cache, alloc, pool, conn = _tiered(block=4, policy="write_through")
    slots = alloc.alloc(8)
    free = _state(alloc)
    conn.failing.add("store")
    with pytest.raises(OSError, match="injected"):
        cache.insert(np.arange(8), slots, pool=pool)
    assert _sizes(cache) == (0, 0, 0) and _state(alloc) == free
    assert cache.match_prefix(np.arange(8)).slots.size == 0


def _short_of_room(cache, alloc, pool):
    """x = [0..11] in the store only, its first 4 tokens on the device, and the allocator
    full: a load_back of x must evict [100..127] first."""
    x = np.arange(12)
    slots = alloc.alloc(12)
    cache.insert(x, slots)
    cache.evict(12, pool=pool)
    cache.insert(np.arange(100, 128), alloc.alloc(28))
    cache.insert(x[:4], alloc.alloc(4))
    cache.match_prefix(np.arange(100, 128))
    return pool


@pytest.mark.parametrize("failing", ["load", "store"])
def test_a_failing_load_back_leaves_tree_allocator_and_locks_as_they_were(failing):
    (a, alloc_a, pool_a, conn_a), (b, _, pool_b, _) = _twins(_short_of_room)
    m = a.match_prefix(np.arange(12))
    b.match_prefix(np.arange(12))
    assert m.stored_tokens == 8 and alloc_a.available_size() == 0
    free, sizes = _state(alloc_a), _sizes(a)
    conn_a.failing.add(failing)  # the load, or the write-back of the eviction before it
    with pytest.raises(OSError, match="injected"):
        a.load_back(pool_a, np.arange(12), m)
    assert _state(alloc_a) == free and _sizes(a) == sizes
    with pytest.raises(ValueError, match="one more dec_lock_ref"):
        a.dec_lock_ref(m.node)  # the lock load_back took is released
    conn_a.failing.clear()
    assert _trace(a, pool_a) == _trace(b, pool_b)


@pytest.mark.parametrize("page", [1, 4])
def test_insert_checks_new_pages_in_any_order(page):
    """Whole, distinct pages the tree does not hold are taken in any order (not only the
    ascending order allocators hand them out); a fault anywhere among them is refused,
    named, and changes nothing."""
    alloc = _alloc(page, 128)
    cache = RadixCache(alloc)
    held = alloc.alloc(2 * page)
    cache.insert(np.arange(2 * page), held)
    fresh = alloc.alloc(6 * page).reshape(6, page)
    shuffled = fresh[[4, 0, 5, 2, 1, 3]].reshape(-1)
    tokens = np.arange(100, 100 + 6 * page)
    bad = {
        "does not hold": np.concatenate([shuffled[: 5 * page], held[:page]]),
        "distinct pages": np.concatenate([shuffled[: 5 * page], shuffled[2 * page : 3 * page]]),
        "allocator's slots": np.concatenate([shuffled[: 5 * page], np.arange(page)]),  # page 0
    }
    if page > 1:
        bad["whole pages"] = np.concatenate([shuffled[: 5 * page], shuffled[-page:] + 1])
    before, free = _sizes(cache), _state(alloc)
    for why, slots in bad.items():
        with pytest.raises(ValueError, match=why):
            cache.insert(tokens, slots)
        assert _sizes(cache) == before and _state(alloc) == free
    assert cache.insert(tokens, shuffled) == 0
    np.testing.assert_array_equal(cache.match_prefix(tokens).slots, shuffled)
    with pytest.raises(ValueError, match="does not hold"):  # now the tree's
        cache.insert(np.arange(200, 200 + page), fresh[3])


def _takes(slots: list[int], page: int, num_pages: int, held: set[int]) -> bool:
    """The rule for new slots, written plainly: the allocator's slots, in whole pages (each
    page's slots in order), each page once, none the cache holds."""
    if any(s < page or s >= (num_pages + 1) * page for s in slots):
        return False
    groups = [slots[i : i + page] for i in range(0, len(slots), page)]
    if any(g[0] % page or g != list(range(g[0], g[0] + page)) for g in groups):
        return False
    pages = [g[0] // page for g in groups]
    return len(set(pages)) == len(pages) and not set(pages) & held


@pytest.mark.parametrize("page", [1, 4])
@settings(max_examples=4 * settings.default.max_examples, deadline=None)
@given(data=st.data())
def test_new_slots_are_taken_exactly_when_they_are_whole_free_pages(page, data):
    """Runs of pages, pages in any order, repeated, out of range or held, and single slots
    moved: insert takes the slots exactly when the plain rule does, and else changes nothing."""
    num_pages = 12
    alloc = PagedAllocator(num_pages * page, page)
    cache = RadixCache(alloc)
    held_slots = alloc.alloc(3 * page)
    cache.insert(np.arange(3 * page), held_slots)
    held = {int(s) // page for s in held_slots}
    k = data.draw(st.integers(1, 5))
    if data.draw(st.booleans()):  # a run, as allocators hand out
        first = data.draw(st.integers(0, num_pages + 1))
        pages = list(range(first, first + k))
    else:
        pages = data.draw(st.lists(st.integers(0, num_pages + 1), min_size=k, max_size=k))
    slots = [p * page + o for p in pages for o in range(page)]
    if data.draw(st.booleans()):  # one slot moved
        i = data.draw(st.integers(0, len(slots) - 1))
        slots[i] += data.draw(st.sampled_from([-page, -1, 1, page]))
    tokens = np.arange(1000, 1000 + len(slots))
    before, free = _sizes(cache), _state(alloc)
    if _takes(slots, page, num_pages, held):
        assert cache.insert(tokens, np.array(slots)) == 0
        np.testing.assert_array_equal(cache.match_prefix(tokens).slots, slots)
        assert cache.total_size() == before[2] + len(slots)
    else:
        with pytest.raises(ValueError, match="slots: expected"):
            cache.insert(tokens, np.array(slots))
        assert _sizes(cache) == before and _state(alloc) == free


def test_insert_refuses_pages_out_of_alignment_at_either_end():
    """A run of slots that starts mid-page is not whole pages, even when it is in order."""
    alloc = PagedAllocator(64, 4)
    cache = RadixCache(alloc)
    alloc.alloc(4)  # page 1: one slot before the run is still the allocator's
    slots = alloc.alloc(12)
    for shifted in (slots + 1, slots - 1):
        with pytest.raises(ValueError, match="whole pages"):
            cache.insert(np.arange(12), shifted)
    assert cache.insert(np.arange(12), slots) == 0


@pytest.mark.parametrize(
    "tokens, ok",
    [
        (np.array([0, 255], np.uint8), True),
        (np.array([2**32 - 1], np.uint32), True),
        (np.array([2**32 - 1], np.uint64), True),
        (np.array([2**32], np.uint64), False),
        (np.array([-1], np.int8), False),
        (np.array([2**31 - 1], np.int32), True),
        (np.array([2**32], np.int64), False),
        (np.array([-1], np.int64), False),
    ],
)
def test_token_ids_are_checked_in_every_integer_dtype(tokens, ok):
    cache = RadixCache(TokenAllocator(8))
    if ok:
        assert cache.match_prefix(tokens).slots.size == 0
    else:
        with pytest.raises(ValueError, match=r"token_ids: expected ids in \[0, 2\*\*32\)"):
            cache.match_prefix(tokens)


def test_a_uint64_slot_past_int64_is_reported_as_given():
    alloc = TokenAllocator(8)
    cache = RadixCache(alloc)
    slots = np.array([1, 2**63 + 5], np.uint64)
    with pytest.raises(ValueError, match=f"got {2**63 + 5}$"):
        cache.insert([1, 2], slots)
    assert cache.total_size() == 0
    assert cache.insert([1, 2], np.array([1, 2], np.uint64)) == 0
