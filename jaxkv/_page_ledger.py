"""`PageLedger`: which allocator pages a radix tree holds, and the check of the slots it takes.

A tree owns the slots of every prefix it caches, whole allocator pages at a time. The ledger
keeps one flag per page of the allocator, so that `RadixTree.insert` can refuse slots that are
not whole pages, repeat a page, fall outside the allocator or are held already: any of those
would let one slot hold two prefixes, and the allocator hand it out twice.
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np

__all__ = ["PageLedger", "Pages"]

_INT64_MAX = np.iinfo(np.int64).max

# Pages of the ledger: an array of them, or a slice of consecutive ones (a run of slots).
Pages: TypeAlias = np.ndarray | slice


class PageLedger:
    """The pages `1..num_pages` of one allocator that a tree holds (page 0 is never handed out).

    Args:
        page_size: slots per page (1 for a `TokenAllocator`).
        num_pages: the allocator's pages.
    """

    __slots__ = ("page_size", "num_pages", "_held", "_in_page", "_ramp")

    def __init__(self, page_size: int, num_pages: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self._held = np.zeros(num_pages + 1, bool)
        self._in_page = np.arange(page_size, dtype=np.int64)  # a page's slot offsets
        self._ramp = b""  # see `_is_run`

    def pages(self, slots: np.ndarray) -> np.ndarray:
        """The page of each whole page of `slots` (their first slots, divided)."""
        page = self.page_size
        return slots[::page] // page if page > 1 else slots

    def hold(self, pages: Pages) -> None:
        """Marks `pages` held by the tree (checked by `new_pages` first, or the tree's own)."""
        self._held[pages] = True

    def release(self, pages: np.ndarray) -> None:
        """Marks `pages` no longer held (their slots go back to the allocator)."""
        self._held[pages] = False

    def new_pages(self, slots: np.ndarray) -> tuple[np.ndarray, Pages]:
        """`slots` as int64 and their pages (for `hold`), refused unless they are whole
        allocator pages, distinct and not held.

        Two shapes, as allocators hand pages out, are checked in a few vectorised steps: one
        run of consecutive slots from a page's first, and whole pages in ascending order.
        Anything else is examined in full, which names the first fault.

        Raises:
            ValueError: naming `slots`, the fault and the first slot or page at fault.
        """
        if slots.dtype.kind == "u" and slots.size and slots.max() > _INT64_MAX:
            self._diagnose(slots)  # names the value given, before a cast wraps it
        slots = slots.astype(np.int64, copy=False)
        if not slots.size:
            return slots, slots
        page = self.page_size
        # count_nonzero rather than any/all: the same answer for a fraction of the overhead.
        start, n = int(slots[0]), slots.size
        # A run's ends say so first (two reads), before its slots are compared.
        if start % page == 0 and int(slots[-1]) == start + n - 1 and self._is_run(slots, start):
            low = start // page
            high = low + n // page
            if (
                1 <= low
                and high <= self.num_pages + 1
                and not np.count_nonzero(self._held[low:high])
            ):
                return slots, slice(low, high)
        elif not np.count_nonzero(slots[1:] <= slots[:-1]):  # ascending: distinct pages
            # Each page's `page_size` ascending slots lie between its first slot and the
            # page's last, so they are the page's slots exactly when the last one is that.
            pages = slots[::page] // page if page > 1 else slots
            if (
                page == 1
                or (pages * page + (page - 1)).tobytes() == slots[page - 1 :: page].tobytes()
            ) and self._free_pages(pages):
                return slots, pages
        self._diagnose(slots)
        return slots, self.pages(slots)  # valid pages, in another order

    def _is_run(self, slots: np.ndarray, start: int) -> bool:
        """Whether `slots` are `start, start + 1, ...` (compared as bytes with a kept ramp
        0, 1, 2, ... of int64s, grown by doubling to the longest run so far)."""
        run = (slots - start).tobytes()
        if len(self._ramp) < len(run):
            self._ramp = np.arange(max(2 * len(self._ramp), len(run)) // 8).tobytes()
        return self._ramp.startswith(run)

    def _free_pages(self, pages: np.ndarray) -> bool:
        """Whether ascending `pages` are the allocator's and none is held."""
        return (
            1 <= pages[0]
            and pages[-1] <= self.num_pages
            and not np.count_nonzero(self._held[pages])
        )

    def _diagnose(self, slots: np.ndarray) -> None:
        """`new_pages`' check in full: raises naming the first fault, or returns when the
        pages are valid (distinct, in another order)."""
        page = self.page_size
        low, high = page, (self.num_pages + 1) * page
        if slots.min() < low or slots.max() >= high:
            bad = int(slots[(slots < low) | (slots >= high)][0])
            raise ValueError(
                f"slots: expected the allocator's slots [{low}, {high}) for the tokens not yet "
                f"cached, got {bad}"
            )
        starts = slots[::page]
        if page > 1:
            off = slots.reshape(-1, page) - starts[:, None]
            odd = np.flatnonzero((starts % page != 0) | np.any(off != self._in_page, axis=1))
            if odd.size:
                got = slots[odd[0] * page : (odd[0] + 1) * page].tolist()
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
