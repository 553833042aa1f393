"""`RadixTree`: the device tier of the prefix cache, SGLang 0.5.23's `RadixCache` tree.

The tree maps token-id prefixes, cut to whole pages of the allocator's page size, to the pool
slots holding their KV. Each node holds one edge: the token ids of a run of pages, as the
bytes of their native uint32 ids, and the slots of those pages (an int64 numpy array). A
prompt is turned into bytes once per call; one step down the tree is then a dictionary look-up
keyed by the bytes of the next page, and a whole edge is compared by one `bytes.startswith`
(a `memcmp`). Only the edge where a match ends is compared token by token, in numpy, to find
the page where it ends. The nodes at the top of the tree are keyed by their salt as well:
tenants never share a node.

Recency, locks and eviction are SGLang's: a call stamps the nodes it walks with one time, and
the nodes it creates (a split's upper half, a new leaf) with later ones; locked paths are
protected; `evict` frees the least recently used unlocked leaves first. The evictable leaves
wait in a heap whose entries are checked when popped (a node re-stamped, locked, given a child
or gone is skipped), so no call scans the tree.

This tier knows nothing of stores: `jaxkv.RadixCache` extends it with the connector's tier,
as SGLang's `HiRadixCache` extends its `RadixCache`, through its steps: walk a prompt without
changing anything (`_walk`), commit a match (`_found`) or an insert (`_plan_insert`, then
`_commit_insert`), take the least recently used leaves out (`_detach_lru`), then free their
slots (`_release`) or put them back (`_reattach`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Any, NamedTuple

import numpy as np

from jaxkv._checks import int_arg, int_vector, text_arg, token_array
from jaxkv._page_ledger import PageLedger, Pages
from jaxkv.allocators import PagedAllocator, TokenAllocator

__all__ = ["InsertPlan", "Node", "PrefixMatch", "RadixTree"]

_ID_BYTES = 4  # a token id is a native uint32 in a node's key


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


class Node:
    """One edge of the tree: the token ids `key` (bytes, `size` tokens) and the slots `value`
    of whole pages.

    `first` is the node's key in its parent's `children` (its first page's bytes, with the salt
    at the top level); `end` is the prefix length, in tokens, up to the node's last token, which
    a split never changes for the node that keeps its object (the lower half), so handles stay
    valid. `lock_ref` counts the locks on the node and below it (a lock on a node is a lock on
    every node above it, so a parent's is never below a child's); `locks` counts only the
    `inc_lock_ref` calls made on this node's handle, which a `dec_lock_ref` of it must match.
    """

    __slots__ = (
        "key",
        "size",
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

    def __init__(self, owner, key: bytes, value: np.ndarray, parent, first, end: int, salt, stamp):
        self.owner = owner
        self.key = key
        self.size: int = value.size
        self.value = value
        self.children: dict = {}
        self.parent: Node | None = parent
        self.first = first
        self.end = end
        self.salt: bytes | None = salt
        self.lock_ref = 0
        self.locks = 0
        self.stamp: int = stamp
        self.alive = True

    def __repr__(self) -> str:
        if self.parent is None:
            return "<RadixCache root>"
        state = "" if self.alive else ", evicted"
        return f"<RadixCache node: prefix end {self.end}, locks {self.locks}{state}>"


def salt_key(salt) -> bytes | None:
    """The tenant a salt names: `None` is its own tenant (distinct from `""`), a `str` is its
    UTF-8 bytes, `bytes` themselves; anything else is refused rather than coerced."""
    if salt is None or isinstance(salt, bytes):
        return salt
    if isinstance(salt, str):
        return text_arg("salt", salt).encode()
    raise TypeError(f"salt: expected a str, bytes or None, got {type(salt).__name__}")


class InsertPlan(NamedTuple):
    """An insert checked and walked, not yet committed (`RadixTree._plan_insert`)."""

    tokens: np.ndarray  # the whole pages of token ids, uint32
    ids: bytes  # their bytes
    salt: bytes | None
    path: list[Node]
    cut: int
    matched: int  # leading tokens cached already
    new: np.ndarray  # the slots of the tokens after them, int64
    pages: Pages  # and their pages


class RadixTree:
    """The device tier of `jaxkv.RadixCache`: SGLang's tree over a jaxkv allocator.

    Args:
        allocator: a `TokenAllocator` or `PagedAllocator`; the tree's page size is its page
            size, and evicted slots go back to it with `free`.

    Raises:
        TypeError: an allocator that is neither a `TokenAllocator` nor a `PagedAllocator`.
    """

    def __init__(self, allocator: TokenAllocator | PagedAllocator):
        if not isinstance(allocator, (TokenAllocator, PagedAllocator)):
            raise TypeError(
                "allocator: expected a jaxkv.TokenAllocator or jaxkv.PagedAllocator, got "
                f"{type(allocator).__name__}"
            )
        self.allocator = allocator
        self.page_size: int = allocator.page_size
        self._page_bytes = _ID_BYTES * self.page_size
        self._ledger = PageLedger(self.page_size, allocator.num_pages)
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._root = Node(self, b"", np.zeros(0, np.int64), None, None, 0, None, 0)
        self._heap: list[tuple[int, int, Node]] = []  # (stamp, push order, leaf)
        self._nodes = 0
        self._evictable = 0
        self._protected = 0
        self._total = 0

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

    # ---- walking ------------------------------------------------------------------------------

    def _prompt(self, token_ids, salt) -> tuple[np.ndarray, bytes, bytes | None]:
        """The whole pages of `token_ids` (uint32), their bytes, and the tenant `salt` names."""
        tokens = token_array(token_ids)
        tokens = tokens[: tokens.size // self.page_size * self.page_size]
        return tokens, tokens.tobytes(), salt_key(salt)

    def _walk(self, ids: bytes, salt) -> tuple[list[Node], int, int]:
        """The nodes the prompt of bytes `ids` (whole pages) runs through, changing nothing:
        `(path, cut, matched)`, where the last node's first `cut` tokens match (fewer than its
        size when the match ends inside it) and `matched` tokens match in all."""
        path: list[Node] = []
        step, end, pos = self._page_bytes, len(ids), 0
        child = self._root.children.get((salt, ids[:step])) if end else None
        while child is not None:
            path.append(child)
            key = child.key
            if not ids.startswith(key, pos):
                cut = self._common(key, ids, pos)
                return path, cut, pos // _ID_BYTES + cut
            pos += len(key)
            if pos == end:
                break
            child = child.children.get(ids[pos : pos + step])
        return path, path[-1].size if path else 0, pos // _ID_BYTES

    def _common(self, key: bytes, ids: bytes, pos: int) -> int:
        """Leading tokens of the edge `key` equal to `ids` from byte `pos` on, in whole pages;
        the first page is known to match (the child was found by it)."""
        n = min(len(key), len(ids) - pos) // _ID_BYTES
        differ = np.frombuffer(key, np.uint32, n) != np.frombuffer(ids, np.uint32, n, pos)
        first = int(differ.argmax())
        if not differ[first]:  # the edge runs past the prompt
            return n
        return first // self.page_size * self.page_size

    def _stamp(self, path: list[Node], cut: int) -> Node:
        """Stamps the walked nodes with one time, splits the last one where the match ends
        inside it, and returns the node ending at the match (the root for an empty path)."""
        if not path:
            return self._root
        now = next(self._clock)
        for node in path:
            node.stamp = now
        last = path[-1]
        self._push_if_evictable(last)  # its stamp changed (only the last can be a leaf)
        return self._split(last, cut) if cut < last.size else last

    def _split(self, node: Node, k: int) -> Node:
        """Cuts `node` after its first `k` tokens; the new upper half takes its place, the
        lower half keeps the object (handles keep naming the same prefix end) and its stamp.
        The upper half is created now, so its stamp is newer than the walk's."""
        parent = node.parent
        assert parent is not None  # only nodes below the root are split
        cut = k * _ID_BYTES
        upper = Node(
            self,
            node.key[:cut],
            node.value[:k],
            parent,
            node.first,
            node.end - node.size + k,
            node.salt,
            next(self._clock),
        )
        upper.lock_ref = node.lock_ref
        parent.children[node.first] = upper
        node.key, node.value, node.size = node.key[cut:], node.value[k:], node.size - k
        node.first = node.key[: self._page_bytes]
        node.parent = upper
        upper.children[node.first] = node
        self._nodes += 1
        return upper

    @staticmethod
    def _path_slots(path: list[Node], cut: int) -> np.ndarray:
        """The slots of a walk's match (a new array)."""
        if len(path) < 2:
            return path[0].value[:cut].copy() if path else np.zeros(0, np.int64)
        parts = [n.value for n in path]
        parts[-1] = parts[-1][:cut]
        return np.concatenate(parts)

    def _prefix_of(self, node: Node) -> tuple[np.ndarray, np.ndarray]:
        """The token ids and slots from the root to the end of `node` (detached or not: the
        parent links of an evicted node still lead to the root)."""
        chain = []
        while node.parent is not None:
            chain.append(node)
            node = node.parent
        chain.reverse()
        if not chain:
            return np.zeros(0, np.uint32), np.zeros(0, np.int64)
        ids = np.frombuffer(b"".join(n.key for n in chain), np.uint32)
        return ids, np.concatenate([n.value for n in chain])

    # ---- the eviction heap --------------------------------------------------------------------

    def _push_if_evictable(self, node: Node) -> None:
        if node.parent is None or node.children or node.lock_ref or not node.alive:
            return
        heapq.heappush(self._heap, (node.stamp, next(self._seq), node))
        if len(self._heap) > 2 * self._nodes + 64:
            self._compact()

    @staticmethod
    def _valid(entry: tuple[int, int, Node]) -> bool:
        """Whether a heap entry still names an evictable leaf at that leaf's current stamp."""
        stamp, _, node = entry
        return node.alive and not node.children and not node.lock_ref and node.stamp == stamp

    def _compact(self) -> None:
        """Drops stale heap entries (amortised: the heap is rebuilt only once it holds more
        than twice as many entries as the tree has nodes)."""
        live = {id(e[2]): e for e in self._heap if self._valid(e)}
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    # ---- match and insert ---------------------------------------------------------------------

    def match_prefix(self, token_ids, *, salt=None) -> PrefixMatch:
        """The longest cached prefix of `token_ids` (see `jaxkv.RadixCache.match_prefix`)."""
        _, ids, salt = self._prompt(token_ids, salt)
        path, cut, _ = self._walk(ids, salt)
        return self._found(path, cut, 0)

    def _found(self, path: list[Node], cut: int, stored: int) -> PrefixMatch:
        """The match of a walk: its slots, then its handle once stamped (and split)."""
        slots = self._path_slots(path, cut)
        return PrefixMatch(slots, self._stamp(path, cut), stored)

    def insert(self, token_ids, slots, *, salt=None) -> int:
        """Caches `token_ids` at `slots` (see `jaxkv.RadixCache.insert`)."""
        plan = self._plan_insert(token_ids, slots, salt)
        self._commit_insert(plan)
        return plan.matched

    def _plan_insert(self, token_ids, slots, salt) -> InsertPlan:
        """An insert's arguments checked and its prompt walked, nothing changed yet."""
        tokens = token_array(token_ids)
        slot_arr = int_vector("slots", slots, "slots")
        if slot_arr.size != tokens.size:
            raise ValueError(
                f"slots: expected one slot per token id, shape ({tokens.size},), got "
                f"{slot_arr.shape}"
            )
        n = tokens.size // self.page_size * self.page_size
        tokens = tokens[:n]
        salt = salt_key(salt)
        ids = tokens.tobytes()
        path, cut, matched = self._walk(ids, salt)
        new, pages = self._ledger.new_pages(slot_arr[matched:n])
        return InsertPlan(tokens, ids, salt, path, cut, matched, new, pages)

    def _plan_loaded(self, tokens: np.ndarray, salt, slots: np.ndarray, first: int) -> InsertPlan:
        """The insert of `tokens` whose token `first + i` was loaded into `slots[i]`, slots
        fresh from the allocator; the tokens the tree holds already keep the tree's slots."""
        ids = tokens.tobytes()
        path, cut, matched = self._walk(ids, salt)
        new = slots[matched - first :]
        return InsertPlan(tokens, ids, salt, path, cut, matched, new, self._ledger.pages(new))

    def _commit_insert(self, plan: InsertPlan) -> Node:
        """Commits a planned insert: stamps the path, splits, adds the leaf of the new slots.
        Returns the node ending at the prompt's end (the root for an empty prompt)."""
        _, ids, salt, path, cut, matched, new, pages = plan
        if not ids:
            return self._root
        parent = self._stamp(path, cut)
        if not new.size:
            return parent
        at = matched * _ID_BYTES
        first = ids[at : at + self._page_bytes]
        leaf = Node(
            self,
            ids[at:],
            new.copy(),
            parent,
            (salt, first) if parent is self._root else first,
            len(ids) // _ID_BYTES,
            salt,
            next(self._clock),
        )
        parent.children[leaf.first] = leaf
        self._nodes += 1
        self._evictable += leaf.size
        self._total += leaf.size
        self._ledger.hold(pages)
        self._push_if_evictable(leaf)
        return leaf

    # ---- locks --------------------------------------------------------------------------------

    def _own(self, node, name: str = "node") -> Node:
        if not isinstance(node, Node) or node.owner is not self:
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
                delta -= node.size
            node.lock_ref += 1
            node = node.parent
        self._evictable += delta
        self._protected -= delta
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
                delta += node.size
            node.lock_ref -= 1
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        self._push_if_evictable(first)  # only the first node can be a leaf
        return delta

    # ---- eviction -----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` cached tokens, least recently used unlocked leaves
        first (see `jaxkv.RadixCache.evict`); returns the tokens freed."""
        num_tokens = int_arg("num_tokens", num_tokens, low=0)
        victims = self._detach_lru(num_tokens)
        self._release(victims)
        return sum(v.size for v in victims)

    def _detach_lru(self, num_tokens: int) -> list[Node]:
        """Takes least recently used evictable leaves out of the tree until `num_tokens`
        tokens are out, keeping their slots (see `_release`, `_reattach`)."""
        victims: list[Node] = []
        freed = 0
        while freed < num_tokens and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._valid(entry):
                continue
            node = entry[2]
            parent = node.parent
            assert parent is not None  # the root is never in the heap
            del parent.children[node.first]
            node.alive = False
            self._nodes -= 1
            self._evictable -= node.size
            self._total -= node.size
            victims.append(node)
            freed += node.size
            if not parent.children:  # a leaf now (only a leaf can enter the heap)
                self._push_if_evictable(parent)
        return victims

    def _reattach(self, victims: list[Node]) -> None:
        """Puts detached leaves back, last first, as they were (an eviction that failed)."""
        for node in reversed(victims):
            assert node.parent is not None  # victims are leaves below the root
            node.parent.children[node.first] = node
            node.alive = True
            self._nodes += 1
            self._evictable += node.size
            self._total += node.size
            self._ledger.hold(self._ledger.pages(node.value))
            self._push_if_evictable(node)

    def _release(self, victims: list[Node]) -> None:
        """Gives the detached leaves' slots back to the allocator (one call, pages sorted as
        SGLang's per-leaf frees leave them once merged)."""
        if not victims:
            return
        if len(victims) == 1:
            values = victims[0].value
        else:
            values = np.concatenate([v.value for v in victims])
        self._ledger.release(self._ledger.pages(values))
        self.allocator.free(values)
