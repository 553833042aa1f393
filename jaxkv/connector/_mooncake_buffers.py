"""Host memory a `MooncakeStore` moves records through: an `Arena` registered with Mooncake's
client once, which records are written from (`write`: each record's byte form, built in place)
and read into (the records a read returns are views of it, never copies).

The arena is a ring of regions, one per client call. A region is taken again only once the
call that used it has ended (a call that timed out may still be writing into it) and nothing
holds a view of it any more: a record a reader keeps is never overwritten, as in `HostStore`.
When the ring has no such room (readers hold what is ahead, or a batch is larger than the
arena) a call gets `Scratch` memory of its own instead, registered for that call alone.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import struct
import sys
import threading
import zlib
from collections.abc import Sequence

import numpy as np

from jaxkv.connector import _records
from jaxkv.connector._records import BlockRecord, address

# Records start at this alignment inside a region (numpy copies aligned rows fastest).
ALIGN = 64
_PAGE = 4096
# The prefix of a record's byte form (see `jaxkv.connector._records`): magic, version and the
# header's length; the CRC32 of everything before it closes the record.
_PREFIX = struct.Struct("<8sII")
_CRC = struct.Struct("<I")


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _touched_memory(nbytes: int) -> mmap.mmap:
    """Anonymous private memory with every page touched (see `HostStore`: copies into fresh
    pages pay a fault per page), huge pages asked for where Linux offers them."""
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        mem = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mem.madvise(mmap.MADV_HUGEPAGE)
    np.frombuffer(mem, np.uint8)[::_PAGE] = 0
    return mem


class Region:
    """Bytes of the arena (or scratch memory) that one client call uses.

    `base` is a uint8 array of the bytes; records read into it are views of it, so its
    reference count says whether anyone still holds one. `busy` while its call runs.
    """

    __slots__ = ("offset", "size", "base", "busy", "registered")

    def __init__(self, base: np.ndarray, offset: int, registered: bool):
        self.base = base
        self.offset, self.size = offset, int(base.nbytes)
        self.busy = True
        self.registered = registered  # False: scratch memory, registered for its call alone

    @property
    def address(self) -> int:
        return address(self.base)

    def free(self) -> bool:
        # 2 = the `base` attribute + getrefcount's argument: no view of it is alive.
        return not self.busy and sys.getrefcount(self.base) == 2


class Arena:
    """`nbytes` of touched host memory, cut into regions in ring order (see the module
    docstring). Thread-safe.

    Attributes:
        address: where the memory starts (what the client registers).
        nbytes: its size.
    """

    def __init__(self, nbytes: int):
        self._mem = _touched_memory(nbytes)
        self._bytes = np.frombuffer(self._mem, np.uint8)
        self.address = address(self._bytes)
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._live: collections.deque[Region] = collections.deque()  # in ring order
        self._head = 0

    def take(self, size: int) -> Region:
        """A region of `size` bytes (busy: call `done` when its call ends): the arena's next
        one when what lies there is free, else scratch memory of its own."""
        size = round_up(max(size, 1))
        with self._lock:
            start = self._head if self._head + size <= self.nbytes else 0
            if size <= self.nbytes and self._clear(start, size):
                region = Region(self._bytes[start : start + size], start, registered=True)
                self._live.append(region)
                self._head = start + size
                return region
        return Region(_touched_scratch(size), 0, registered=False)

    def _clear(self, start: int, size: int) -> bool:
        """Forgets the live regions inside `[start, start + size)` when all are free; False
        (keeping them) when one is not."""
        end = start + size
        inside = [r for r in self._live if r.offset < end and start < r.offset + r.size]
        if not all(r.free() for r in inside):
            return False
        for r in inside:
            self._live.remove(r)
        return True


def _touched_scratch(size: int) -> np.ndarray:
    scratch = np.empty(size, np.uint8)
    scratch[::_PAGE] = 0
    return scratch


# ---- the byte form, written in place -------------------------------------------------------


class Layout:
    """Where each record of a batch goes in one region: `offsets[i]`, `sizes[i]` (its byte
    form's length), and `nbytes`, the region's size."""

    __slots__ = ("offsets", "sizes", "nbytes")

    def __init__(self, sizes: Sequence[int]):
        self.sizes = list(sizes)
        self.offsets, at = [], 0
        for size in self.sizes:
            self.offsets.append(at)
            at += round_up(size)
        self.nbytes = at


def header(record: BlockRecord) -> bytes:
    """The prefix and JSON header of `record`'s byte form (`_records.head`)."""
    return _records.head(record)


def write(record: BlockRecord, head: bytes, out: np.ndarray) -> None:
    """Writes `record`'s byte form (its `header` is `head`) into `out`, a uint8 array of
    exactly its length: one copy of each part, then the CRC32 of what was written."""
    out[: len(head)] = np.frombuffer(head, np.uint8)
    at = len(head)
    for arr in record.parts.values():
        n = int(arr.nbytes)
        src = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
        out[at : at + n] = src.reshape(-1).view(np.uint8)
        at += n
    out[at : at + _CRC.size] = np.frombuffer(_CRC.pack(zlib.crc32(out[:at].data)), np.uint8)


def encoded_size(head: bytes, record: BlockRecord) -> int:
    return len(head) + record.nbytes + _CRC.size
