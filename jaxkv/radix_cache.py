"""`RadixCache`: SGLang's radix-tree prefix cache over a jaxkv allocator, with a store tier.

The device tier, the tree itself (matching, splits, locks, recency and eviction), is
`jaxkv._radix_tree.RadixTree`; the slots it holds are kept in a `jaxkv._page_ledger.PageLedger`.
`RadixCache` extends that tree with the tier below the device, as SGLang's `HiRadixCache`
extends its `RadixCache`: with a connector, pages leaving the device are written to its store
first (`"write_back"`), or every insert is (`"write_through"`); `match_prefix` reports what the
store holds after the device match, and `load_back` brings it back into fresh slots. Without a
connector it is the device tree alone.

The tier asks four things of its connector, the `StoreConnector` protocol: `block_size`,
`lookup`, `store` and `load` (`jaxkv.connector.KVConnector` has them).

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

import inspect
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from jax.typing import ArrayLike

from jaxkv._checks import int_arg, is_int
from jaxkv._radix_tree import Node, PrefixMatch, RadixTree
from jaxkv.allocators import PagedAllocator, TokenAllocator

__all__ = ["PrefixMatch", "RadixCache", "StoreConnector"]

WRITE_POLICIES = ("write_back", "write_through", None)

_NO_POOL = (
    "pool: expected the current pool, got None: a write-back cache stores the pages it evicts "
    "before freeing their slots, which reads them from the pool (pass pool=, or make the cache "
    "with write_policy='write_through' or None)"
)


@runtime_checkable
class StoreConnector(Protocol):
    """What `RadixCache`'s store tier calls on its connector (`jaxkv.connector.KVConnector`
    is one). Token ids come as uint32 numpy arrays of whole pages, slots as int64 ones, salts
    as `bytes` or `None`."""

    @property
    def block_size(self) -> int:
        """Tokens per stored block, a multiple of the cache's page size."""
        ...

    def lookup(self, token_ids: np.ndarray, *, salt: bytes | None = None, start: int = 0) -> int:
        """Tokens from `start` (a block boundary) on whose blocks are all stored."""
        ...

    def store(
        self, pool: Any, token_ids: np.ndarray, slots: np.ndarray, *, salt: bytes | None = None
    ) -> int:
        """Stores the full blocks of `token_ids`, read from `pool` at `slots`."""
        ...

    def load(
        self,
        pool: Any,
        token_ids: np.ndarray,
        slots: np.ndarray,
        *,
        salt: bytes | None = None,
        start: int = 0,
    ) -> tuple[Any, int]:
        """Loads the stored blocks of `token_ids` from `start` on into `slots`: `(pool, n)`,
        `n` the tokens loaded."""
        ...


def _connector_faults(connector: object) -> list[str]:
    """What `connector` lacks of `StoreConnector`: each member it does not have, and each
    method that is not callable."""
    faults = []
    for name, member in vars(StoreConnector).items():
        if name.startswith("_"):
            continue
        if not hasattr(connector, name):
            faults.append(f"without {name}")
        elif inspect.isfunction(member) and not callable(getattr(connector, name)):
            faults.append(f"with a {name} that is not callable")
    return faults


class RadixCache(RadixTree):
    """SGLang's `RadixCache` over a jaxkv allocator: a prefix tree of token ids to pool slots,
    with an optional store tier below it.

    Args:
        allocator: a `TokenAllocator` or `PagedAllocator`; the tree's page size is its page
            size, evicted slots go back to it with `free`, and `load_back` takes slots from it.
        connector: an optional connector (a `jaxkv.connector.KVConnector`, or any
            `StoreConnector`) whose store is the tier below the device; its `block_size` must
            be a multiple of the page size.
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
        connector: StoreConnector | None = None,
        write_policy: str | None = "write_back",
    ):
        super().__init__(allocator)
        if write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy: expected one of {WRITE_POLICIES}, got {write_policy!r}"
            )
        if connector is not None:
            if not isinstance(connector, StoreConnector):
                faults = ", ".join(_connector_faults(connector)) or "that is not one"
                raise TypeError(
                    "connector: expected a jaxkv.connector.KVConnector (or a StoreConnector: "
                    f"block_size, lookup, store and load), got {type(connector).__name__} "
                    f"{faults}"
                )
            bs = connector.block_size
            if not is_int(bs) or bs <= 0 or bs % self.page_size:
                raise ValueError(
                    f"connector: expected a block_size that is a multiple of the page size "
                    f"{self.page_size}, got {bs!r}"
                )
        self.connector = connector
        self.write_policy = write_policy
        # The policy, chosen once: the connector each kind of write goes to, or None.
        self._through = connector if write_policy == "write_through" else None
        self._back = connector if write_policy == "write_back" else None

    # ---- match --------------------------------------------------------------------------------

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
        conn = self.connector
        if conn is None:
            return super().match_prefix(token_ids, salt=salt)
        tokens, ids, key = self._prompt(token_ids, salt)
        path, cut, matched = self._walk(ids, key)
        return self._found(path, cut, self._stored_after(conn, tokens, matched, key))

    @staticmethod
    def _stored_after(conn: StoreConnector, tokens: np.ndarray, matched: int, salt) -> int:
        """Tokens after `matched` that the store holds, up to the end of a whole block: the
        blocks are asked for from the one holding token `matched` on."""
        bs = conn.block_size
        start = matched // bs * bs
        if tokens.size - start < bs:
            return 0
        found = conn.lookup(tokens, salt=salt, start=start)
        return max(0, start + found - matched)

    # ---- insert -------------------------------------------------------------------------------

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
        conn = self._through
        if conn is None:
            return super().insert(token_ids, slots, salt=salt)
        if pool is None:
            raise ValueError(
                "pool: expected the current pool, got None: a write-through cache stores what "
                "it caches at insert, reading it from the pool"
            )
        plan = self._plan_insert(token_ids, slots, salt)
        if plan.tokens.size:
            held = self._path_slots(plan.path, plan.cut)
            conn.store(pool, plan.tokens, np.concatenate([held, plan.new]), salt=plan.salt)
        self._commit_insert(plan)
        return plan.matched

    # ---- evict --------------------------------------------------------------------------------

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
        conn = self._back
        if conn is None:
            return super().evict(num_tokens)
        num_tokens = int_arg("num_tokens", num_tokens, low=0)
        if pool is None:
            raise ValueError(_NO_POOL)
        victims = self._detach_lru(num_tokens)
        try:
            self._write_back(conn, victims, pool)
        except BaseException:
            self._reattach(victims)
            raise
        self._release(victims)
        return sum(v.size for v in victims)

    def _write_back(self, conn: StoreConnector, victims: list[Node], pool) -> None:
        """Stores the full connector blocks of each victim's prefix. A victim evicted after
        one of its children in the same call needs nothing more: the child's prefix held all
        of its blocks."""
        bs = conn.block_size
        covered: set[int] = set()
        for node in victims:
            start = node.end - node.size
            if id(node) not in covered:
                if node.end // bs * bs <= start:
                    continue  # its pages end no block: nothing of it can be stored
                tokens, slots = self._prefix_of(node)
                conn.store(pool, tokens, slots, salt=node.salt)
            covered.add(id(node.parent))

    # ---- load back ----------------------------------------------------------------------------

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
        tokens, _, key = self._prompt(token_ids, salt)
        if not isinstance(match, PrefixMatch):
            raise TypeError(f"match: expected a PrefixMatch, got {type(match).__name__}")
        node = self._checked_match(tokens, match, key)
        stored = match.stored_tokens
        conn = self.connector
        if conn is None or stored == 0:
            return pool, match
        bs = conn.block_size
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
            pool, longer = self._load(conn, pool, tokens, node, match.slots, key, start, want)
        finally:
            self.dec_lock_ref(node)
        return pool, match if longer is None else longer

    def _checked_match(self, tokens: np.ndarray, match: PrefixMatch, salt) -> Node:
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
        path, cut, matched = self._walk(tokens[:d].tobytes(), salt)
        last = path[-1] if path else self._root
        if matched < d or last is not node or (path and cut < last.size):
            raise ValueError(
                "match: expected the match of these token_ids and salt, got one of another prefix"
            )
        return node

    def _load(
        self,
        conn: StoreConnector,
        pool,
        tokens: np.ndarray,
        node: Node,
        held: np.ndarray,
        salt,
        start: int,
        want: int,
    ):
        """`load_back` once its arguments are checked and the matched path is locked: the
        new pool and match, or `(pool, None)` when not one block fits."""
        bs, d = conn.block_size, node.end
        room = self.allocator.available_size()
        if room + self._evictable < bs:  # no room for one block, even after evicting
            return pool, None
        state = self.allocator.backup_state()
        victims: list[Node] = []
        try:
            if room < want:
                victims = self._detach_lru(want - room)
                if self._back is not None:
                    self._write_back(self._back, victims, pool)
                self._release(victims)
            k = min(want, self.allocator.available_size() // bs * bs)
            slots = self.allocator.alloc(k)
            assert slots is not None  # k is at most what is free
            pool, n = conn.load(pool, tokens[: start + k], slots, salt=salt, start=start)
        except BaseException:
            self.allocator.restore_state(state)
            self._reattach(victims)
            raise
        end = start + n
        if end <= d:  # the store no longer held the blocks it promised
            self.allocator.free(slots)
            return pool, PrefixMatch(held.copy(), node, 0)
        # The tree may have gained some of these tokens meanwhile: it keeps its own slots.
        plan = self._plan_loaded(tokens[:end], salt, slots[:n], start)
        leaf = self._commit_insert(plan)
        self.allocator.free(np.concatenate([slots[: plan.matched - start], slots[n:]]))
        left = 0 if n < k else want - k
        return pool, PrefixMatch(self._prefix_of(leaf)[1], leaf, left)
