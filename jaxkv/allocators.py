"""Host-side slot and page allocators with SGLang's semantics, vectorised in numpy.

Slot `s` lives in page `s // page_size`; page 0 is the padding sink and is never handed out.
Freed pages wait in a release list and are merged into the free list, sorted, at the moments
SGLang's `need_sort` allocator merges them (`alloc` short of pages, `alloc_extend` when its upper
bound on new pages exceeds the free list, `alloc_decode` when the batch does), so a scheduler
ported from SGLang sees the same slots in the same order. Unlike SGLang, a page freed twice is
never listed twice. The release list is kept as the arrays each `free` released, joined only
when it is merged or snapshotted: its order never matters (a merge sorts it), and a `free`
then costs what it frees, not what waits.

Example:
    >>> a = PagedAllocator(size=16, page_size=4)
    >>> a.alloc_extend(prefix_lens=[0, 0], seq_lens=[5, 2], last_loc=[-1, -1])
    array([ 4,  5,  6,  7,  8, 12, 13])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxkv._checks import int_arg, is_int
from jaxkv.errors import ConsumedPoolError

__all__ = ["TokenAllocator", "PagedAllocator", "ReqToTokenPool"]

# What `backup_state` returns: copies of the free list, the release list and the free flags.
AllocatorState = tuple[np.ndarray, np.ndarray, np.ndarray]


def _index(name: str, value) -> int:
    """A Python or numpy integer (not a bool, float or array) as an int."""
    if not is_int(value):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r:.40}")
    return int(value)


def _as_array(name: str, x) -> np.ndarray:
    """`np.asarray(x)`, with numpy's complaints about ragged or odd input naming `name`."""
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as err:
        raise TypeError(f"{name}: expected a 1-D sequence of ints, got {err}") from None


def _int_vector(name: str, x) -> np.ndarray:
    """`x` as a 1-D int64 vector (a scalar is one element), to be read only: an int64 array
    comes back as itself. Refuses what would change meaning on the way: floats, bools, arrays
    of two or more dimensions, and values past int64 (a uint64 above 2**63 - 1 would wrap to
    a negative)."""
    arr = _as_array(name, x)
    if arr.ndim > 1:
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: expected values below 2**63, got {arr.max()}")
    return arr.reshape(-1).astype(np.int64, copy=False)


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


class _PageFreeList:
    """Free pages `1..size//page_size` with SGLang's free/release lists."""

    def __init__(self, size: int, page_size: int):
        self.size = int_arg("size", size)
        self.page_size = int_arg("page_size", page_size)
        if self.size % self.page_size:
            # A tail of fewer than page_size slots can never be handed out: say so rather
            # than hold fewer tokens than asked for.
            raise ValueError(
                f"size: expected a multiple of page_size={self.page_size}, got size={self.size} "
                f"(use {self.size // self.page_size * self.page_size} or "
                f"{-(-self.size // self.page_size) * self.page_size})"
            )
        self.num_pages = self.size // self.page_size
        # Scratch for `free`'s de-duplication: read only where the same call wrote it, so it
        # is never reset, copied or restored.
        self._last_seen = np.zeros(self.num_pages + 1, np.int64)
        self.clear()

    def clear(self) -> None:
        """Frees everything: pages are handed out in ascending order again."""
        self._free = np.arange(1, self.num_pages + 1, dtype=np.int64)
        self._set_released(np.zeros(0, np.int64))
        self._is_free = np.ones(self.num_pages + 1, bool)
        self._is_free[0] = False

    def _set_released(self, pages: np.ndarray) -> None:
        """Makes `pages` the whole release list (`_released` holds its parts, in the order
        they were freed; `_n_released` counts their pages)."""
        self._released: list[np.ndarray] = [pages] if pages.size else []
        self._n_released = pages.size

    def _release_list(self) -> np.ndarray:
        """The release list as one array (its parts joined, and kept joined)."""
        if len(self._released) > 1:
            self._released = [np.concatenate(self._released)]
        return self._released[0] if self._released else np.zeros(0, np.int64)

    def available_size(self) -> int:
        """Free tokens (whole free pages times the page size)."""
        return (self._free.size + self._n_released) * self.page_size

    def _merge_if_short(self, bound: int) -> None:
        """SGLang's `merge_and_sort_free`: when the free list holds fewer than `bound` pages,
        released pages are merged into it, sorted. The bound differs per call (see callers);
        matching it is what keeps slot order equal to SGLang's after frees."""
        if bound > self._free.size and self._n_released:
            self._free = np.sort(np.concatenate([self._free, *self._released]))
            self._set_released(np.zeros(0, np.int64))

    def _take_pages(self, n: int, merge_bound: int | None = None) -> np.ndarray | None:
        """The first `n` free pages, merging released pages first when the free list holds
        fewer than `merge_bound` (default `n`); `None`, taking nothing, when short."""
        self._merge_if_short(n if merge_bound is None else merge_bound)
        if n > self._free.size:
            return None
        pages, self._free = self._free[:n], self._free[n:]
        self._is_free[pages] = False
        return pages

    def _pages_to_slots(self, pages: np.ndarray) -> np.ndarray:
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)

    def alloc(self, need_size: int) -> np.ndarray | None:
        """`need_size` unique slots (whole pages, in free-list order), or `None` if short.

        Args:
            need_size: slots wanted, an int >= 0; a multiple of `page_size`.

        Returns:
            An int64 array of `need_size` slots, or `None` (taking nothing) when fewer are
            free.

        Raises:
            ValueError: `need_size` is not an int >= 0, or not a multiple of `page_size`.
        """
        need_size = int_arg("need_size", need_size, low=0)
        if need_size % self.page_size:
            raise ValueError(
                f"need_size: expected a multiple of page_size={self.page_size}, got {need_size}"
            )
        pages = self._take_pages(need_size // self.page_size)
        return None if pages is None else self._pages_to_slots(pages)

    def free(self, free_index: ArrayLike | Sequence[int]) -> None:
        """Frees the pages holding `free_index` slots; page 0, out-of-range slots, duplicates
        and pages already free are ignored.

        Args:
            free_index: a slot, or a 1-D sequence or array of slots.

        Raises:
            TypeError: `free_index` is not integers (floats, bools, ragged nesting).
            ValueError: `free_index` has two or more dimensions, or values past int64.
        """
        slots = _int_vector("free_index", free_index)
        pages = self._ascending_pages(slots)
        if pages is not None:  # each page once, in range: only those already free drop out
            self._release(pages[~self._is_free[pages]])
            return
        pages = slots // self.page_size if self.page_size > 1 else slots
        pages = pages[(pages >= 1) & (pages <= self.num_pages)]
        pages = pages[~self._is_free[pages]]
        if pages.size > 1:
            # Each page once (a page's slots, or a slot given twice), in linear time: of the
            # indices written for a page, one remains, and only at that index is it read back.
            order = np.arange(pages.size)
            self._last_seen[pages] = order
            pages = pages[self._last_seen[pages] == order]
        self._release(pages)

    def _release(self, pages: np.ndarray) -> None:
        if pages.size:
            self._is_free[pages] = True
            self._released.append(pages)
            self._n_released += pages.size

    def _ascending_pages(self, slots: np.ndarray) -> np.ndarray | None:
        """The pages of `slots` when they are whole pages, strictly ascending and in range (as
        `alloc` hands them out), each once; else None (the general path). A few vector steps
        instead of the general path's masks and de-duplication."""
        ps, n = self.page_size, slots.size
        starts = slots[::ps]
        if n == 0 or n % ps or (starts.size > 1 and not (starts[1:] > starts[:-1]).all()):
            return None
        if ps > 1:
            rows = slots.reshape(-1, ps) - starts[:, None]
            if (starts % ps).any() or not (rows == np.arange(ps)).all():
                return None
        pages = starts // ps if ps > 1 else starts
        return pages if 1 <= pages[0] and pages[-1] <= self.num_pages else None

    def backup_state(self) -> AllocatorState:
        """A snapshot of the free lists (a copy: later calls do not change it).

        Returns:
            An opaque state for `restore_state`.
        """
        return (self._free.copy(), self._release_list().copy(), self._is_free.copy())

    def restore_state(self, state: AllocatorState) -> None:
        """Puts back the free lists of a `backup_state` snapshot (copying it, so one snapshot
        can be restored more than once).

        Args:
            state: what `backup_state` returned, on an allocator of the same size.
        """
        free, release, is_free = state
        self._free, self._is_free = free.copy(), is_free.copy()
        self._set_released(release.copy())


class TokenAllocator(_PageFreeList):
    """Token-granular slots `1..size` (SGLang's `TokenToKVPoolAllocator`).

    Args:
        size: slots handed out, a positive int.

    Raises:
        ValueError: `size` is not a positive int.

    Example:
        >>> TokenAllocator(8).alloc(3)
        array([1, 2, 3])
    """

    def __init__(self, size: int):
        super().__init__(size, 1)


class PagedAllocator(_PageFreeList):
    """Pages `1..size//page_size` of `page_size` slots (SGLang's
    `PagedTokenToKVPoolAllocator`), with `alloc_extend` and `alloc_decode`.

    Args:
        size: slots in all pages, a positive multiple of `page_size`.
        page_size: slots per page, a positive int.

    Raises:
        ValueError: `size` or `page_size` is not a positive int, or `size` is not a multiple
            of `page_size` (the message names the nearest valid sizes).
    """

    def alloc_extend(
        self,
        prefix_lens: ArrayLike | Sequence[int],
        seq_lens: ArrayLike | Sequence[int],
        last_loc: ArrayLike | Sequence[int],
    ) -> np.ndarray | None:
        """Slots for extending each request from `prefix_lens[i]` to `seq_lens[i]` tokens.

        Per request, in order: finish the partial page after `last_loc[i]`, then whole new
        pages, then the start of one more page; new pages come from the free list in order.

        Args:
            prefix_lens: tokens each request already holds, shape `(batch,)`.
            seq_lens: tokens each request holds after the call, shape `(batch,)`.
            last_loc: per request, the slot of its last prefix token, in a page it holds
                (`-1` for an empty prefix), shape `(batch,)`.

        Returns:
            The new slots (int64) concatenated in request order, or `None` (consuming
            nothing) when pages run short.

        Raises:
            TypeError: an argument is not integers.
            ValueError: unequal lengths, `prefix_lens[i] < 0` or `seq_lens[i] <
                prefix_lens[i]`, or a `last_loc[i]` that is not at the page offset of the
                request's last prefix token in a real page (when its partial page is used).
        """
        prefix = _int_vector("prefix_lens", prefix_lens)
        seq = _int_vector("seq_lens", seq_lens)
        last = _int_vector("last_loc", last_loc)
        if not prefix.size == seq.size == last.size:
            raise ValueError(
                "prefix_lens, seq_lens, last_loc: expected equal lengths, got "
                f"{prefix.size}, {seq.size}, {last.size}"
            )
        if np.any(prefix < 0) or np.any(seq < prefix):
            i = int(np.flatnonzero((prefix < 0) | (seq < prefix))[0])
            raise ValueError(
                f"seq_lens: expected 0 <= prefix_lens[i] <= seq_lens[i], got prefix_lens[{i}]="
                f"{prefix[i]}, seq_lens[{i}]={seq[i]}"
            )
        p = self.page_size
        held = _ceil_div(prefix, p) * p  # end of the request's last held page
        n_partial = np.minimum(seq, held) - prefix
        self._check_last_loc(last, prefix, n_partial > 0)
        new_pages = _ceil_div(seq, p) - _ceil_div(prefix, p)
        # SGLang merges on an upper bound of the pages needed, not the exact count.
        bound = int((seq - prefix).sum()) // p + seq.size + 1
        pages = self._take_pages(int(new_pages.sum()), merge_bound=bound)
        if pages is None:
            return None
        n_new = seq - prefix
        req = np.repeat(np.arange(seq.size), n_new)
        j = np.arange(req.size) - np.repeat(np.cumsum(n_new) - n_new, n_new)
        k = j - n_partial[req]  # index among the tokens going to new pages
        page_start = np.cumsum(new_pages) - new_pages
        out = last[req] + 1 + j
        m = k >= 0
        out[m] = pages[page_start[req[m]] + k[m] // p] * p + k[m] % p
        return out

    def alloc_decode(
        self, seq_lens: ArrayLike | Sequence[int], last_loc: ArrayLike | Sequence[int]
    ) -> np.ndarray | None:
        """One slot per request for its `seq_lens[i]`-th token: `last_loc[i] + 1`, or the first
        slot of a new page when the token starts one.

        Args:
            seq_lens: tokens each request holds with the new one, shape `(batch,)`, each >= 1.
            last_loc: per request, the slot of its last token before this one, shape
                `(batch,)`.

        Returns:
            One slot per request (int64), or `None` (consuming nothing) when pages run short.

        Raises:
            TypeError: an argument is not integers.
            ValueError: unequal lengths, a `seq_lens[i] < 1`, or a `last_loc[i]` that is not
                the slot before the new token's page offset in a real page (when the new
                token does not start a page).
        """
        seq = _int_vector("seq_lens", seq_lens)
        last = _int_vector("last_loc", last_loc)
        if seq.size != last.size:
            raise ValueError(
                f"seq_lens, last_loc: expected equal lengths, got {seq.size}, {last.size}"
            )
        if np.any(seq < 1):
            i = int(np.flatnonzero(seq < 1)[0])
            raise ValueError(
                f"seq_lens: expected >= 1 (it counts the new token), got seq_lens[{i}]={seq[i]}"
            )
        starts_page = (seq - 1) % self.page_size == 0
        self._check_last_loc(last, seq - 1, ~starts_page)
        # SGLang merges when the batch outnumbers the free pages, whatever the pages needed.
        pages = self._take_pages(int(starts_page.sum()), merge_bound=seq.size)
        if pages is None:
            return None
        out = last + 1
        out[starts_page] = pages * self.page_size
        return out

    def _check_last_loc(self, last: np.ndarray, prefix: np.ndarray, used: np.ndarray) -> None:
        # A request's token i sits at page offset i % page_size, so the slot after last_loc
        # must continue that pattern inside a real page; anything else would hand out a slot
        # of a page the request does not hold.
        end = (self.num_pages + 1) * self.page_size  # one past the last slot of the pool
        bad = used & (
            (last < self.page_size)
            | (last >= end)
            | ((last + 1) % self.page_size != prefix % self.page_size)
        )
        if np.any(bad):
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"last_loc: expected the slot of request {i}'s last prefix token (page offset "
                f"{(prefix[i] - 1) % self.page_size}, in pages 1..{self.num_pages}), got "
                f"last_loc[{i}]={last[i]}"
            )


_INT32 = np.iinfo(np.int32)


def _bucket(n: int) -> int:
    # Slot writes are padded to a power of two so `write` compiles O(log max_context_len) times.
    return 1 << max(0, (n - 1).bit_length())


def _write_row(table, row, cols, slots):
    return table.at[row, cols].set(slots, mode="drop", wrap_negative_indices=False)


_write_row_donated = jax.jit(_write_row, donate_argnums=0)
_write_row_copy = jax.jit(_write_row)


_CONSUMED = (
    "{where}: this ReqToTokenPool was consumed by write(); use the ReqToTokenPool it returned "
    "(or pass donate=False to keep this one readable)"
)
_DELETED = (
    "{where}: this ReqToTokenPool's table was deleted (donated to a jitted call outside "
    "write()); use what that call returned"
)


class _RowFreeList:
    """Free request rows `1..size` (row 0 is the padding row), shared by the `ReqToTokenPool`s
    one `write` chain returns."""

    def __init__(self, size: int):
        self.size = size
        self.clear()

    def clear(self) -> None:
        self.free_slots = list(range(1, self.size + 1))


class ReqToTokenPool:
    """Request rows -> token slots table: `req_to_token` int32 `(size + 1, max_context_len)`.

    Row 0 is a padding row that is never handed out: padded batches point their dummy requests
    at it, as in SGLang. Rows `1..size` are handed out the way SGLang does it: `alloc(n)` takes
    the last `n` free rows, and `free` appends, so a freed row is the next one handed out.
    Row bookkeeping (`alloc`, `free`, `available_size`, `clear`) is host-side and shared by
    every `ReqToTokenPool` of one `write` chain, so it answers the same through any of them
    (a consumed one included: freeing a row through an old reference frees it for all). The
    table itself is a device array updated functionally: an eager `write` (donating, the
    default) consumes this object, whose `req_to_token` and `write` then raise
    `ConsumedPoolError`, as pools do after an eager update.

    Args:
        size: request rows handed out, a positive int.
        max_context_len: token slots per row, a positive int.

    Raises:
        ValueError: `size` or `max_context_len` is not a positive int.

    Example:
        >>> rtt = ReqToTokenPool(size=4, max_context_len=8)
        >>> rtt.alloc(2)
        [3, 4]
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        *,
        _rows: _RowFreeList | None = None,
        _table: jax.Array | None = None,
    ):
        self.size = int_arg("size", size)
        self.max_context_len = int_arg("max_context_len", max_context_len)
        self._rows = _rows if _rows is not None else _RowFreeList(self.size)
        self._table = (
            _table
            if _table is not None
            else jnp.zeros((self.size + 1, self.max_context_len), jnp.int32)
        )
        self._consumed = False

    @property
    def consumed(self) -> bool:
        """Whether a donating `write` handed this object's table to the `ReqToTokenPool` it
        returned; then `req_to_token` and `write` raise `ConsumedPoolError`."""
        return self._consumed

    @property
    def req_to_token(self) -> jax.Array:
        """The table, int32 `(size + 1, max_context_len)`.

        Raises:
            ConsumedPoolError: a donating `write` consumed this object (whether or not XLA
                reused the buffer: the flag never depends on the backend), or its buffer was
                deleted.
        """
        return self._live_table("ReqToTokenPool.req_to_token")

    def _live_table(self, where: str) -> jax.Array:
        if self._consumed:
            raise ConsumedPoolError(_CONSUMED.format(where=where))
        table = self._table
        if not isinstance(table, jax.core.Tracer) and table.is_deleted():
            raise ConsumedPoolError(_DELETED.format(where=where))
        return table

    def available_size(self) -> int:
        """Rows free now."""
        return len(self._rows.free_slots)

    def alloc(self, need_size: int = 1) -> list[int] | None:
        """`need_size` free rows (never row 0), or `None` (taking none) when fewer are free.

        Args:
            need_size: rows wanted, an int >= 0.

        Returns:
            A list of `need_size` rows, or `None` when fewer are free.

        Raises:
            ValueError: `need_size` is not an int >= 0.
        """
        need_size = int_arg("need_size", need_size, low=0)
        free = self._rows.free_slots
        if need_size > len(free):
            return None
        if need_size == 0:
            return []
        out = free[-need_size:]
        del free[-need_size:]
        return out

    def free(self, free_index: int | Iterable[int] | ArrayLike) -> None:
        """Returns a row (int) or rows (iterable) to the free list; rows already free are
        ignored, so a double free never hands one row to two requests.

        Args:
            free_index: a row, or an iterable or 1-D array of rows.

        Raises:
            IndexError: a row outside `[1, size]` (nothing is freed).
            TypeError: rows that are not integers.
            ValueError: an array of two or more dimensions.
        """
        if hasattr(free_index, "__iter__") and not isinstance(free_index, np.ndarray):
            free_index = list(free_index)  # sets, generators: any iterable of rows
        rows = [int(r) for r in _int_vector("free_index", free_index)]
        for r in rows:
            if not 1 <= r <= self.size:
                raise IndexError(
                    f"free_index: expected rows in [1, {self.size}] (row 0 is the padding row), "
                    f"got {r}"
                )
        free = self._rows.free_slots
        listed = set(free)
        for r in rows:
            if r not in listed:
                free.append(r)
                listed.add(r)

    def clear(self) -> None:
        """Frees every row (the table's contents are left as they are)."""
        self._rows.clear()

    def write(
        self, row: int, start: int, slots: ArrayLike | Sequence[int], *, donate: bool = True
    ) -> ReqToTokenPool:
        """A new pool with `req_to_token[row, start:start+len(slots)] = slots`.

        `row` may be any row of the table, the padding row 0 included. By default the old
        table is donated and this object is consumed (use the returned pool from then on: its
        `req_to_token` and `write` raise `ConsumedPoolError`, on every backend); `donate=False`
        keeps it valid at the cost of a full copy. Row bookkeeping stays shared either way.

        Args:
            row: the table row, in `[0, size]`.
            start: the first column written, >= 0.
            slots: the token slots to write, a 1-D sequence of ints in int32's range.
            donate: give the old table's buffer to the new pool and mark this one consumed.

        Returns:
            A `ReqToTokenPool` sharing this one's row bookkeeping, with the new table.

        Raises:
            TypeError: `row` or `start` is not an int, or `slots` is not integers.
            ValueError: `slots` has two or more dimensions, or a value outside int32.
            IndexError: `row` outside `[0, size]`, or `start + len(slots)` past
                `max_context_len` (or a negative `start`).
            ConsumedPoolError: an earlier donating `write` consumed this object.
        """
        table = self._live_table("ReqToTokenPool.write()")  # refused before any argument
        slots = _int_vector("slots", slots)
        row, start = _index("row", row), _index("start", start)
        if slots.size and (slots.min() < _INT32.min or slots.max() > _INT32.max):
            # The table is int32: a larger slot would wrap onto another token's row.
            raise ValueError(
                f"slots: expected values in [{_INT32.min}, {_INT32.max}] (int32), got "
                f"[{slots.min()}, {slots.max()}]"
            )
        if not 0 <= row <= self.size:
            raise IndexError(f"row: expected a row in [0, {self.size}], got {row}")
        if start < 0 or start + slots.size > self.max_context_len:
            raise IndexError(
                f"start: expected 0 <= start and start + len(slots) <= {self.max_context_len}, "
                f"got start={start}, len(slots)={slots.size}"
            )
        n = _bucket(slots.size)
        cols = np.full(n, -1, np.int32)
        cols[: slots.size] = np.arange(start, start + slots.size)
        vals = np.zeros(n, np.int32)
        vals[: slots.size] = slots
        fn = _write_row_donated if donate else _write_row_copy
        new = fn(table, np.int32(row), cols, vals)
        if donate and not isinstance(new, jax.core.Tracer):
            # Spent whether or not XLA could reuse the buffer (some backends copy instead):
            # a read through this object must never return the table as it was.
            self._consumed = True
        return ReqToTokenPool(self.size, self.max_context_len, _rows=self._rows, _table=new)
