"""`RadixCache`: SGLang's radix-tree prefix cache over a jaxkv allocator, with a store tier.

The tree maps token-id prefixes, cut to whole pages of the allocator's page size, to the pool
slots holding their KV. Each node holds one edge: the token ids and slots of a run of pages
(numpy arrays); its children are keyed by the bytes of their first page, so one step down is one
dictionary look-up, and a whole edge is compared in a few vectorised numpy comparisons. The
nodes at the top of the tree are keyed by their salt as well: tenants never share a node.

Recency, locks and eviction are SGLang 0.5.23's: a call stamps the nodes it walks with one
time, and the nodes it creates (a split's upper half, a new leaf) with later ones; locked paths
are protected; `evict` frees the least recently used unlocked leaves first. The evictable leaves
wait in a heap whose entries are checked when popped (a node re-stamped, locked, given a child
or gone is skipped), so no call scans the tree.

With a connector, pages leaving the device are written to its store first (`"write_back"`),
or every insert is (`"write_through"`); `match_prefix` reports what the store holds after the
device match, and `load_back` brings it back into fresh slots.

Example:
    >>> import numpy as np
    >>> from jaxkv import PagedAllocator, RadixCache
    >>> alloc = PagedAllocator(64, page_size=4)
    >>> cache = RadixCache(alloc)
    >>> slots = alloc.alloc(8)
    >>> cache.insert(np.arange(10), np.concatenate([slots, [0, 0]]))  # the 2-token tail is dropped
    0
    >>> m = cache.match_prefix([0, 1, 2, 3, 4, 5, 9])
    >>> m.slots
    array([4, 5, 6, 7])
    >>> cache.inc_lock_ref(m.node), cache.evictable_size(), cache.protected_size()
    (-4, 4, 4)
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.typing import ArrayLike

from jaxkv._checks import int_arg, int_vector, is_int, text_arg, token_array
from jaxkv.allocators import PagedAllocator, TokenAllocator

__all__ = ["RadixCache", "PrefixMatch"]

WRITE_POLICIES = ("write_back", "write_through", None)

# Tokens compared in the first vectorised step along an edge, doubled at each further step: a
# walk costs O(tokens matched) however long the edge it stops in. A step's Python overhead
# outweighs comparing a few KiB, so the first step takes a whole prompt's worth.
_FIRST_COMPARE = 1024

_NO_POOL = (
    "pool: expected the current pool, got None: a write-back cache stores the pages it evicts "
    "before freeing their slots, which reads them from the pool (pass pool=, or make the cache "
    "with write_policy='write_through' or None)"
)


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixMatch:
    """What `RadixCache.match_prefix` found (compared by identity: its slots are an array).

    Attributes:
        slots: int64 numpy array, the device slots of the longest cached prefix (a multiple of
            the page size long); its own copy, so changing it changes nothing in the cache.
        node: a handle on the end of that prefix, for `inc_lock_ref` / `dec_lock_ref` and
            `load_back` (the root handle when nothing matched). It keeps naming the same prefix
            end when the tree splits the node later; it stops being valid once the prefix is
            evicted.
        stored_tokens: tokens after the device match that the connector's store holds (up to
            the end of a whole connector block); 0 without a connector.
    """

    slots: np.ndarray
    node: Any
    stored_tokens: int = 0


class _Node:
    """One edge of the tree: the token ids `key` and the slots `value` of whole pages.

    `first` is the node's key in its parent's `children` (its first page's bytes, with the salt
    at the top level); `end` is the prefix length, in tokens, up to the node's last token, which
    a split never changes for the node that keeps its object (the lower half), so handles stay
    valid. `lock_ref` counts the locks on the node and below it (a lock on a node is a lock on
    every node above it, so a parent's is never below a child's); `locks` counts only the
    `inc_lock_ref` calls made on this node's handle, which a `dec_lock_ref` of it must match.
    """

    __slots__ = (
        "key",
        "value",
        "children",
        "parent",
        "first",
        "end",
        "salt",
        "lock_ref",
        "locks",
        "stamp",
        "alive",
        "owner",
    )

    def __init__(self, owner, key, value, parent, first, end: int, salt, stamp: int):
        self.owner = owner
        self.key: np.ndarray = key
        self.value: np.ndarray = value
        self.children: dict = {}
        self.parent: _Node | None = parent
        self.first = first
        self.end = end
        self.salt: bytes | None = salt
        self.lock_ref = 0
        self.locks = 0
        self.stamp = stamp
        self.alive = True

    def __repr__(self) -> str:
        if self.parent is None:
            return "<RadixCache root>"
        state = "" if self.alive else ", evicted"
        return f"<RadixCache node: prefix end {self.end}, locks {self.locks}{state}>"


def _salt_key(salt) -> bytes | None:
    """The tenant a salt names: `None` is its own tenant (distinct from `""`), a `str` is its
    UTF-8 bytes, `bytes` themselves; anything else is refused rather than coerced."""
    if salt is None or isinstance(salt, bytes):
        return salt
    if isinstance(salt, str):
        return text_arg("salt", salt).encode()
    raise TypeError(f"salt: expected a str, bytes or None, got {type(salt).__name__}")


_INT64_MAX = np.iinfo(np.int64).max


def _matched(edge: np.ndarray, tokens: np.ndarray, page: int) -> int:
    """Leading tokens of `edge` equal to `tokens`, in whole pages; the first page is known to
    match (the child was found by it). Compares in doubling chunks, so the cost follows the
    match, not the edge; a chunk is compared as bytes first, the usual outcome on a walk being
    a whole edge that matches."""
    n = min(edge.size, tokens.size)
    done, step = page, _FIRST_COMPARE
    while done < n:
        hi = min(n, done + step)
        a, b = edge[done:hi], tokens[done:hi]
        if a.tobytes() != b.tobytes():
            return done + int(np.argmax(a != b)) // page * page
        done, step = hi, 2 * step
    return n


class RadixCache:
    """SGLang's `RadixCache` over a jaxkv allocator: a prefix tree of token ids to pool slots.

    Args:
        allocator: a `TokenAllocator` or `PagedAllocator`; the tree's page size is its page
            size, evicted slots go back to it with `free`, and `load_back` takes slots from it.
        connector: an optional `jaxkv.connector.KVConnector` whose store is the tier below the
            device; its `block_size` must be a multiple of the page size.
        write_policy: when pages reach the connector's store: `"write_back"` (when they are
            evicted, which then needs `pool=`), `"write_through"` (at `insert`, which then
            needs `pool=`) or `None` (never: the store is only read).

    Raises:
        TypeError: an allocator that is neither a `TokenAllocator` nor a `PagedAllocator`, or
            a connector without `block_size`, `lookup`, `load` and `store`.
        ValueError: an unknown `write_policy`, or a connector block size that is not a
            multiple of the page size.

    The cache holds the slots of every cached prefix: free them only through `evict` (a slot
    freed behind its back would be handed out twice). It is not thread-safe, like SGLang's.
    """

    def __init__(
        self,
        allocator: TokenAllocator | PagedAllocator,
        *,
        connector: Any = None,
        write_policy: str | None = "write_back",
    ):
        if not isinstance(allocator, (TokenAllocator, PagedAllocator)):
            raise TypeError(
                "allocator: expected a jaxkv.TokenAllocator or jaxkv.PagedAllocator, got "
                f"{type(allocator).__name__}"
            )
        if write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy: expected one of {WRITE_POLICIES}, got {write_policy!r}"
            )
        self.allocator = allocator
        self.page_size: int = allocator.page_size
        if connector is not None:
            missing = [
                a for a in ("block_size", "lookup", "load", "store") if not hasattr(connector, a)
            ]
            if missing:
                raise TypeError(
                    "connector: expected a jaxkv.connector.KVConnector, got "
                    f"{type(connector).__name__} without {', '.join(missing)}"
                )
            bs = connector.block_size
            if not is_int(bs) or bs <= 0 or bs % self.page_size:
                raise ValueError(
                    f"connector: expected a block_size that is a multiple of the page size "
                    f"{self.page_size}, got {bs!r}"
                )
        self.connector = connector
        self.write_policy = write_policy
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._root = _Node(
            self, np.zeros(0, np.uint32), np.zeros(0, np.int64), None, None, 0, None, 0
        )
        self._heap: list[tuple[int, int, _Node]] = []  # (stamp, push order, leaf)
        self._nodes = 0
        self._evictable = 0
        self._protected = 0
        self._total = 0
        # Pages the tree holds: insert refuses one twice, so no slot is ever handed out twice.
        self._held = np.zeros(allocator.num_pages + 1, bool)
        self._in_page = np.arange(self.page_size, dtype=np.int64)  # a page's slot offsets
        self._offsets = self._in_page  # the offsets of the slots of consecutive pages

    # ---- sizes --------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (what `evict` can free)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    def total_size(self) -> int:
        """Tokens the tree holds (`evictable_size() + protected_size()`)."""
        return self._total

    # ---- walking --------------------------------------------------------------------------

    def _aligned(self, token_ids) -> np.ndarray:
        tokens = token_array(token_ids)
        return tokens[: tokens.size // self.page_size * self.page_size]

    def _child_key(self, parent: _Node, page: bytes, salt):
        return (salt, page) if parent is self._root else page

    def _walk(self, tokens: np.ndarray, salt) -> tuple[list[_Node], int, int]:
        """The nodes `tokens` (page-aligned) runs through, without changing anything: `(path,
        cut, matched)`, where the last node's first `cut` tokens match (fewer than its length
        when the match ends inside it) and `matched` tokens match in all."""
        page = self.page_size
        node, path, pos, cut = self._root, [], 0, 0
        while pos < tokens.size:
            child = node.children.get(
                self._child_key(node, tokens[pos : pos + page].tobytes(), salt)
            )
            if child is None:
                break
            cut = _matched(child.key, tokens[pos:], page)
            path.append(child)
            pos += cut
            if cut < child.key.size:
                break
            node = child
        return path, cut, pos

    def _stamp(self, path: list[_Node], cut: int) -> _Node:
        """Stamps the walked nodes with one time, splits the last one where the match ends
        inside it, and returns the node ending at the match (the root for an empty path)."""
        if not path:
            return self._root
        now = next(self._clock)
        for node in path:
            node.stamp = now
        last = path[-1]
        self._push_if_evictable(last)  # its stamp changed (only the last can be a leaf)
        return self._split(last, cut) if cut < last.key.size else last

    def _split(self, node: _Node, k: int) -> _Node:
        """Cuts `node` after its first `k` tokens; the new upper half takes its place, the
        lower half keeps the object (handles keep naming the same prefix end) and its stamp.
        The upper half is created now, so its stamp is newer than the walk's."""
        parent = node.parent
        assert parent is not None  # only nodes below the root are split
        upper = _Node(
            self,
            node.key[:k],
            node.value[:k],
            parent,
            node.first,
            node.end - node.key.size + k,
            node.salt,
            next(self._clock),
        )
        upper.lock_ref = node.lock_ref
        parent.children[node.first] = upper
        node.key, node.value = node.key[k:], node.value[k:]
        node.first = node.key[: self.page_size].tobytes()
        node.parent = upper
        upper.children[node.first] = node
        self._nodes += 1
        return upper

    @staticmethod
    def _path_slots(path: list[_Node], cut: int) -> np.ndarray:
        parts = [n.value for n in path[:-1]]
        if path:
            parts.append(path[-1].value[:cut])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _prefix_of(self, node: _Node) -> tuple[np.ndarray, np.ndarray]:
        """The token ids and slots from the root to the end of `node` (detached or not: the
        parent links of an evicted node still lead to the root)."""
        chain = []
        while node.parent is not None:
            chain.append(node)
            node = node.parent
        chain.reverse()
        if not chain:
            return np.zeros(0, np.uint32), np.zeros(0, np.int64)
        return np.concatenate([n.key for n in chain]), np.concatenate([n.value for n in chain])

    # ---- the eviction heap ------------------------------------------------------------------

    def _push_if_evictable(self, node: _Node) -> None:
        if node.parent is None or node.children or node.lock_ref or not node.alive:
            return
        heapq.heappush(self._heap, (node.stamp, next(self._seq), node))
        if len(self._heap) > 2 * self._nodes + 64:
            self._compact()

    @staticmethod
    def _valid(entry: tuple[int, int, _Node]) -> bool:
        """Whether a heap entry still names an evictable leaf at that leaf's current stamp."""
        stamp, _, node = entry
        return node.alive and not node.children and not node.lock_ref and node.stamp == stamp

    def _compact(self) -> None:
        """Drops stale heap entries (amortised: the heap is rebuilt only once it holds more
        than twice as many entries as the tree has nodes)."""
        live = {id(e[2]): e for e in self._heap if self._valid(e)}
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    # ---- public calls -----------------------------------------------------------------------

    def match_prefix(
        self, token_ids: ArrayLike | Sequence[int], *, salt: str | bytes | None = None
    ) -> PrefixMatch:
        """The longest cached prefix of `token_ids` (whole pages), and what the store holds
        after it.

        Stamps the nodes on the path (one time for the call) and, where the match ends inside
        a node, splits it so that the returned handle ends exactly at the match. It reads no
        device memory; with a connector it asks the store (`lookup`) about the blocks after
        the match, before changing anything, so a store that raises leaves the tree as it was.

        Args:
            token_ids: 1-D integer token ids in `[0, 2**32)`; a partial tail page is ignored.
            salt: the tenant (`str`, `bytes` or `None`); only prefixes inserted under it match.

        Returns:
            A `PrefixMatch`; an empty or sub-page prompt gives no slots and the root handle.

        Raises:
            TypeError, ValueError: `token_ids` that are not 1-D integers in range, or a `salt`
                that is neither `str`, `bytes` nor `None`.
            OSError: the connector's store failed, only when the connector is strict.
        """
        tokens = self._aligned(token_ids)
        salt = _salt_key(salt)
        path, cut, matched = self._walk(tokens, salt)
        stored = self._stored_after(tokens, matched, salt)
        slots = self._path_slots(path, cut)
        return PrefixMatch(slots, self._stamp(path, cut), stored)

    def _stored_after(self, tokens: np.ndarray, matched: int, salt) -> int:
        """Tokens after `matched` that the store holds, up to the end of a whole block: the
        blocks are asked for from the one holding token `matched` on."""
        if self.connector is None:
            return 0
        bs = self.connector.block_size
        start = matched // bs * bs
        if tokens.size - start < bs:
            return 0
        found = self.connector.lookup(tokens, salt=salt, start=start)
        return max(0, start + found - matched)

    def insert(
        self,
        token_ids: ArrayLike | Sequence[int],
        slots: ArrayLike | Sequence[int],
        *,
        salt: str | bytes | None = None,
        pool: Any = None,
    ) -> int:
        """Caches `token_ids` (whole pages; a partial tail page is dropped) at `slots`.

        The tokens already cached keep the cache's slots: their entries in `slots` are not
        taken, and the caller frees the ones it holds (SGLang's `cache_finished_req` does the
        same). The slots of the new tokens now belong to the cache, until it evicts them.

        Args:
            token_ids: 1-D integer token ids in `[0, 2**32)`.
            slots: `slots[t]` holds token `t`; `len(slots) == len(token_ids)`. The new pages'
                slots must be whole allocator pages (slot `page * page_size + offset`, in
                order) that the cache does not hold already.
            salt: the tenant (`str`, `bytes` or `None`).
            pool: the current pool; required by `write_policy="write_through"`, whose store
                of the prefix's full connector blocks reads it.

        Returns:
            The number of leading tokens that were cached already (a multiple of the page
            size).

        Raises:
            TypeError, ValueError: bad `token_ids`, `slots` or `salt`; `slots` of another
                length; new slots outside the allocator's pages, not whole pages in order,
                repeated, or held by the cache already; a write-through cache without `pool`.
            OSError: the store failed, only when the connector is strict (nothing is cached
                then).
        """
        tokens = token_array(token_ids)
        slot_arr = int_vector("slots", slots, "slots")
        if slot_arr.size != tokens.size:
            raise ValueError(
                f"slots: expected one slot per token id, shape ({tokens.size},), got "
                f"{slot_arr.shape}"
            )
        n = tokens.size // self.page_size * self.page_size
        tokens, slot_arr = tokens[:n], slot_arr[:n]
        salt = _salt_key(salt)
        through = self.connector is not None and self.write_policy == "write_through"
        if through and pool is None:
            raise ValueError(
                "pool: expected the current pool, got None: a write-through cache stores what "
                "it caches at insert, reading it from the pool"
            )
        path, cut, matched = self._walk(tokens, salt)
        new = slot_arr[matched:]
        if new.dtype.kind == "u" and new.size and new.max() > _INT64_MAX:
            self._diagnose_new_slots(new)  # names the value given, before a cast wraps it
        new = new.astype(np.int64, copy=False)
        pages = self._check_new_slots(new)
        if through and n:
            held = self._path_slots(path, cut)
            self.connector.store(pool, tokens, np.concatenate([held, new]), salt=salt)
        self._add(tokens, new, pages, path, cut, matched, salt)
        return matched

    def _pages(self, slots: np.ndarray) -> np.ndarray:
        """The page of each whole page of `slots` (their first slots, divided)."""
        page = self.page_size
        return slots[::page] // page if page > 1 else slots

    def _slots_of(self, pages: np.ndarray) -> np.ndarray:
        """The slots of `pages`, page by page, in order (int64)."""
        n = pages.size * self.page_size
        if self._offsets.size < n:  # grown to the longest insert so far, doubling
            self._offsets = np.tile(self._in_page, max(n, 2 * self._offsets.size) // self.page_size)
        return np.repeat(pages * self.page_size, self.page_size) + self._offsets[:n]

    def _check_new_slots(self, new: np.ndarray) -> np.ndarray:
        """The pages of `new`, refused unless they are whole allocator pages, distinct and not
        held by the tree: any fault would let one slot hold two prefixes. Pages in ascending
        order (as allocators hand them out) are checked in a few vectorised steps over the
        pages; anything else is examined in full, which names the first fault."""
        pages = self._pages(new)
        if not pages.size:
            return pages
        page = self.page_size
        if not (
            (pages.size == 1 or (pages[1:] > pages[:-1]).all())  # ascending: distinct
            and 1 <= pages[0]
            and pages[-1] <= self.allocator.num_pages
            and (page == 1 or self._slots_of(pages).tobytes() == new.tobytes())
            and not self._held[pages].any()
        ):
            self._diagnose_new_slots(new)
        return pages

    def _diagnose_new_slots(self, new: np.ndarray) -> None:
        """`_check_new_slots` in full: raises naming the first fault, or returns when the
        pages are valid (distinct, in another order)."""
        page = self.page_size
        low, high = page, (self.allocator.num_pages + 1) * page
        if new.min() < low or new.max() >= high:
            bad = int(new[(new < low) | (new >= high)][0])
            raise ValueError(
                f"slots: expected the allocator's slots [{low}, {high}) for the tokens not yet "
                f"cached, got {bad}"
            )
        starts = new[::page]
        if page > 1:
            off = new.reshape(-1, page) - starts[:, None]
            odd = np.flatnonzero((starts % page != 0) | np.any(off != self._in_page, axis=1))
            if odd.size:
                got = new[odd[0] * page : (odd[0] + 1) * page].tolist()
                raise ValueError(
                    f"slots: expected whole pages for the tokens not yet cached (a page's "
                    f"{page} slots are page * {page} + 0..{page - 1}, in order), got {got}"
                )
        pages = starts // page
        if np.unique(pages).size != pages.size:
            raise ValueError(
                "slots: expected distinct pages for the tokens not yet cached, got a page twice"
            )
        if self._held[pages].any():
            bad = int(pages[self._held[pages]][0]) * page
            raise ValueError(
                f"slots: expected slots the cache does not hold, got slot {bad}, which holds "
                "another cached prefix (free only slots insert did not take)"
            )

    def _add(self, tokens, new, pages, path, cut, matched, salt) -> _Node:
        """Commits an insert checked by the caller: stamps the path, splits, adds the leaf of
        the `new` slots (of `pages`)."""
        if not tokens.size:
            return self._root
        parent = self._stamp(path, cut)
        if not new.size:
            return parent
        leaf = _Node(
            self,
            tokens[matched:].copy(),
            new.copy(),
            parent,
            self._child_key(parent, tokens[matched : matched + self.page_size].tobytes(), salt),
            tokens.size,
            salt,
            next(self._clock),
        )
        parent.children[leaf.first] = leaf
        self._nodes += 1
        self._evictable += new.size
        self._total += new.size
        self._held[pages] = True
        self._push_if_evictable(leaf)
        return leaf

    def _own(self, node, name: str = "node") -> _Node:
        if not isinstance(node, _Node) or node.owner is not self:
            raise TypeError(
                f"{name}: expected a handle from this cache's match_prefix, got "
                f"{type(node).__name__}"
            )
        return node

    def inc_lock_ref(self, node: Any) -> int:
        """Protects the path from the root to `node` from eviction (nested calls count).

        Args:
            node: a handle (`PrefixMatch.node`) of this cache.

        Returns:
            SGLang's delta: minus the tokens that became protected (0 when the path was locked
            already, and for the root).

        Raises:
            TypeError: `node` is not a handle of this cache.
            ValueError: the handle's prefix was evicted since it was matched.
        """
        node = self._own(node)
        if not node.alive:
            raise ValueError(
                f"node: expected a handle of a cached prefix, got {node!r} (match the prompt "
                "again and lock the new handle before using its slots)"
            )
        delta = 0
        if node.parent is not None:
            node.locks += 1
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= node.key.size
                self._protected += node.key.size
                delta -= node.key.size
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: Any) -> int:
        """Releases one `inc_lock_ref` of `node`.

        Args:
            node: a handle this cache locked with `inc_lock_ref`.

        Returns:
            SGLang's delta: the tokens that became evictable again (0 while the path is still
            locked, and for the root).

        Raises:
            TypeError: `node` is not a handle of this cache.
            ValueError: `node`'s handle holds no lock (a release without a matching
                `inc_lock_ref` of that handle; a lock of a longer prefix does not count);
                nothing changes then. SGLang lets its count go negative there.
        """
        node = self._own(node)
        if node.parent is not None and node.locks == 0:
            raise ValueError(
                f"node: expected a handle locked by inc_lock_ref, got {node!r} (one more "
                "dec_lock_ref than inc_lock_ref)"
            )
        first, delta = node, 0
        if node.parent is not None:
            node.locks -= 1
        while node.parent is not None:
            if node.lock_ref == 1:
                self._evictable += node.key.size
                self._protected -= node.key.size
                delta += node.key.size
            node.lock_ref -= 1
            node = node.parent
        self._push_if_evictable(first)  # only the first node can be a leaf
        return delta

    def evict(self, num_tokens: int, *, pool: Any = None) -> int:
        """Frees at least `num_tokens` cached tokens, least recently used unlocked leaves first
        (a parent whose last child goes becomes a leaf and competes by its own stamp), or all
        that are evictable.

        With a connector and `write_policy="write_back"`, each evicted leaf's prefix (its full
        connector blocks, from the root to the leaf's end) is stored before any slot is freed;
        blocks the store holds already are skipped.

        Args:
            num_tokens: tokens wanted, an int >= 0.
            pool: the current pool; required by a write-back cache with a connector.

        Returns:
            Tokens evicted (0 when nothing is evictable); their slots are back in the
            allocator.

        Raises:
            ValueError: a negative or non-integer `num_tokens`, or no `pool` where one is
                required.
            OSError: the store failed, only when the connector is strict (nothing is evicted
                then).
        """
        num_tokens = int_arg("num_tokens", num_tokens, low=0)
        if self._writes_back() and pool is None:
            raise ValueError(_NO_POOL)
        victims = self._detach_lru(num_tokens)
        try:
            if self._writes_back():
                self._write_back(victims, pool)
        except BaseException:
            self._reattach(victims)
            raise
        self._release(victims)
        return sum(v.key.size for v in victims)

    def _writes_back(self) -> bool:
        return self.connector is not None and self.write_policy == "write_back"

    def _detach_lru(self, num_tokens: int) -> list[_Node]:
        """Takes least recently used evictable leaves out of the tree until `num_tokens`
        tokens are out, keeping their slots (see `_release`, `_reattach`)."""
        victims, freed = [], 0
        while freed < num_tokens and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._valid(entry):
                continue
            node, parent = entry[2], entry[2].parent
            assert parent is not None  # the root is never in the heap
            del parent.children[node.first]
            node.alive = False
            self._nodes -= 1
            self._evictable -= node.key.size
            self._total -= node.key.size
            victims.append(node)
            freed += node.key.size
            self._push_if_evictable(parent)
        return victims

    def _reattach(self, victims: list[_Node]) -> None:
        """Puts detached leaves back, last first, as they were (an eviction that failed)."""
        for node in reversed(victims):
            assert node.parent is not None  # victims are leaves below the root
            node.parent.children[node.first] = node
            node.alive = True
            self._nodes += 1
            self._evictable += node.key.size
            self._total += node.key.size
            self._held[self._pages(node.value)] = True
            self._push_if_evictable(node)

    def _release(self, victims: list[_Node]) -> None:
        """Gives the detached leaves' slots back to the allocator (one call, pages sorted as
        SGLang's per-leaf frees leave them once merged)."""
        if not victims:
            return
        values = np.concatenate([v.value for v in victims])
        self._held[self._pages(values)] = False
        self.allocator.free(values)

    def _write_back(self, victims: list[_Node], pool) -> None:
        """Stores the full connector blocks of each victim's prefix. A victim evicted after
        one of its children in the same call needs nothing more: the child's prefix held all
        of its blocks."""
        bs = self.connector.block_size
        covered: set[int] = set()
        for node in victims:
            start = node.end - node.key.size
            if id(node) not in covered:
                if node.end // bs * bs <= start:
                    continue  # its pages end no block: nothing of it can be stored
                tokens, slots = self._prefix_of(node)
                self.connector.store(pool, tokens, slots, salt=node.salt)
            covered.add(id(node.parent))

    def load_back(
        self,
        pool: Any,
        token_ids: ArrayLike | Sequence[int],
        match: PrefixMatch,
        *,
        salt: str | bytes | None = None,
    ) -> tuple[Any, PrefixMatch]:
        """Loads what `match_prefix` found in the store back into the pool and the tree.

        Takes slots for the blocks after the device match (evicting first when the allocator
        is short, never the matched prefix itself), loads them through the connector from the
        block holding the match's end on, caches the new tokens and returns the longer match.
        Slots it could not fill (the store held fewer blocks than promised, or the part of the
        first block that was on the device already) go back to the allocator.

        Args:
            pool: the current pool; consumed as by `KVConnector.load` (use the returned one).
            token_ids: the prompt `match` was matched for.
            match: what `match_prefix(token_ids, salt=salt)` returned, its prefix still cached.
            salt: the salt of that match.

        Returns:
            `(pool, match)`: the new pool and the match after loading (`match` itself and the
            same pool when there was nothing to load or no room for a block).

        Raises:
            TypeError, ValueError: bad arguments; a `match` that is not this prompt's, or whose
                prefix was evicted since.
            OSError: the store failed, only when the connector is strict. A call that raises
                leaves the tree, the allocator and the locks as they were.
        """
        tokens = self._aligned(token_ids)
        salt = _salt_key(salt)
        if not isinstance(match, PrefixMatch):
            raise TypeError(f"match: expected a PrefixMatch, got {type(match).__name__}")
        node = self._checked_match(tokens, match, salt)
        stored = match.stored_tokens
        if self.connector is None or stored == 0:
            return pool, match
        bs = self.connector.block_size
        d = node.end
        start = d // bs * bs
        if (d + stored) % bs or d + stored > tokens.size:
            raise ValueError(
                f"match: expected stored_tokens ending at a whole block of {bs} tokens within "
                f"token_ids, got {stored} after {d} cached tokens of {tokens.size}"
            )
        want = d + stored - start
        self.inc_lock_ref(node)  # the matched prefix must survive the evictions below
        try:
            pool, longer = self._load(pool, tokens, node, match.slots, salt, start, want)
        finally:
            self.dec_lock_ref(node)
        return pool, match if longer is None else longer

    def _checked_match(self, tokens: np.ndarray, match: PrefixMatch, salt) -> _Node:
        node = self._own(match.node, "match.node")
        stored = match.stored_tokens
        if not is_int(stored) or stored < 0:
            raise ValueError(f"match: expected stored_tokens an int >= 0, got {stored!r}")
        d = np.shape(match.slots)[0] if np.ndim(match.slots) == 1 else -1
        if not node.alive or d != node.end:
            raise ValueError(
                f"match: expected a match whose prefix is still cached, got {node!r} with "
                f"{d} slots (match the prompt again)"
            )
        path, cut, matched = self._walk(tokens[:d], salt)
        last = path[-1] if path else self._root
        if matched < d or last is not node or (path and cut < last.key.size):
            raise ValueError(
                "match: expected the match of these token_ids and salt, got one of another prefix"
            )
        return node

    def _load(self, pool, tokens, node: _Node, held: np.ndarray, salt, start: int, want: int):
        """`load_back` once its arguments are checked and the matched path is locked: the
        new pool and match, or `(pool, None)` when not one block fits."""
        bs, d = self.connector.block_size, node.end
        room = self.allocator.available_size()
        if room + self._evictable < bs:  # no room for one block, even after evicting
            return pool, None
        state = self.allocator.backup_state()
        victims: list[_Node] = []
        try:
            if room < want:
                victims = self._detach_lru(want - room)
                if self._writes_back():
                    self._write_back(victims, pool)
                self._release(victims)
            k = min(want, self.allocator.available_size() // bs * bs)
            slots = self.allocator.alloc(k)
            assert slots is not None  # k is at most what is free
            pool, n = self.connector.load(pool, tokens[: start + k], slots, salt=salt, start=start)
        except BaseException:
            self.allocator.restore_state(state)
            self._reattach(victims)
            raise
        end = start + n
        if end <= d:  # the store no longer held the blocks it promised
            self.allocator.free(slots)
            return pool, PrefixMatch(held.copy(), node, 0)
        new = slots[d - start : n]
        path, cut, matched = self._walk(tokens[:end], salt)
        taken = new[matched - d :]  # the tree may have gained some of these tokens meanwhile
        leaf = self._add(tokens[:end], taken, self._pages(taken), path, cut, matched, salt)
        self.allocator.free(np.concatenate([slots[: matched - start], slots[n:]]))
        left = 0 if n < k else want - k
        return pool, PrefixMatch(self._prefix_of(leaf)[1], leaf, left)
