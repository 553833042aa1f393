"""`HostStore`: blocks in host memory, in an arena mapped and touched ahead of use."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import mmap
import sys
from collections.abc import Mapping

import numpy as np

from jaxkv._checks import int_arg
from jaxkv.connector._records import BlockRecord, Segment, is_block_of
from jaxkv.connector.stores import BlockStore

# Alignment of records (and of each part) inside the arena: numpy copies aligned rows fastest.
_ALIGN = 16
# The arena grows in chunks of this size (one mapping each; 1 TiB takes 16,384 mappings, under
# Linux's default limit of 65,530).
_CHUNK_BYTES = 64 << 20
# What a new HostStore maps and touches up front unless told otherwise.
_PREALLOCATE_BYTES = 256 << 20
_PAGE = 4096


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Chunk:
    """One anonymous mapping of the arena, every page touched when it is made.

    Fresh memory costs a page fault per 4 KiB page on first write (here a 64 MiB copy into
    fresh memory ran at 1.6 GB/s, into touched memory at 4.5 GB/s). Transparent huge pages are
    asked for where Linux offers them: copies into touched huge pages ran at 8.3 GB/s.
    """

    __slots__ = ("mem", "nbytes", "free", "largest")

    def __init__(self, nbytes: int):
        if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
            # Private, not the default shared mapping: shared anonymous memory is shmem, which
            # gets no transparent huge pages under the usual settings.
            self.mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            self.mem = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self.mem.madvise(mmap.MADV_HUGEPAGE)
        np.frombuffer(self.mem, np.uint8)[::_PAGE] = 0
        self.nbytes = nbytes
        self.free: list[list[int]] = [[0, nbytes]]  # [offset, size], sorted, coalesced
        self.largest = nbytes

    @property
    def empty(self) -> bool:
        return self.largest == self.nbytes

    def take(self, size: int) -> int | None:
        """First fit: the offset of `size` free bytes, now in use, or None."""
        if self.largest < size:
            return None
        for i, (offset, n) in enumerate(self.free):
            if n >= size:
                if n == size:
                    del self.free[i]
                else:
                    self.free[i] = [offset + size, n - size]
                self.largest = max((n for _, n in self.free), default=0)
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        """Frees `size` bytes at `offset`, merging them with free neighbours."""
        i = 0
        while i < len(self.free) and self.free[i][0] < offset:
            i += 1
        if i < len(self.free) and offset + size == self.free[i][0]:
            size += self.free.pop(i)[1]
        if i and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            self.free[i - 1][1] += size
            size = self.free[i - 1][1]
        else:
            self.free.insert(i, [offset, size])
        self.largest = max(self.largest, size)


class _Slot:
    """Arena bytes holding one record. Every part of the record is a view of `base`, so
    `base`'s reference count tells whether anyone outside the store still holds the record."""

    __slots__ = ("chunk", "offset", "size", "base")

    def __init__(self, chunk: _Chunk, offset: int, size: int):
        self.chunk, self.offset, self.size = chunk, offset, size
        # None once released: the arena bytes belong to the chunk's free list again.
        self.base: np.ndarray | None = np.frombuffer(chunk.mem, np.uint8, count=size, offset=offset)

    def unheld(self) -> bool:
        # 2 = the `base` attribute + getrefcount's argument: no part view is alive.
        return sys.getrefcount(self.base) == 2


class HostStore(BlockStore):
    """Blocks in host memory, evicting least-recently-used blocks past `capacity_bytes`.

    The store owns all the memory its records live in, and `capacity_bytes` bounds that
    memory (not only the records' bytes):

    - Records the connector hands over from pinned-host transfers (GPU, TPU: a `source`
      segment, see `BlockRecord`) are kept as they are, without a host copy; a segment's
      bytes count until its last block leaves the store.
    - Every other record is copied into an arena of host memory mapped and touched ahead of
      use: `preallocate_bytes` at construction (default: `capacity_bytes`, at most 256 MiB),
      then 64 MiB chunks, each touched when mapped, as the store grows. Evicted records' bytes
      are reused in place, so a fresh store copies at the same speed as one at capacity.
      Touching costs about one memory write per byte (256 MiB took 48-78 ms here); pass
      `preallocate_bytes=capacity_bytes` to pay it all at construction, or 0 to pay it only as
      the store grows (for instance on accelerators, where records arrive as segments).
    - A connector storing a CPU pool's blocks copies them straight into arena memory the
      store lends for them (`lend`), and `put` keeps those records without a second copy.

    Records are handed out read-only, and a record a reader still holds is never overwritten:
    its bytes stay reserved (and counted) until the reader lets go of it. A put that cannot
    fit once everything evictable is gone is refused (`False`, counted as `rejected`).

    Args:
        capacity_bytes: the most host memory the store holds.
        preallocate_bytes: arena bytes mapped and touched now, in `[0, capacity_bytes]`.

    Raises:
        ValueError: a non-positive `capacity_bytes` or an out-of-range `preallocate_bytes`.

    Example:
        >>> store = HostStore(capacity_bytes=1 << 30, preallocate_bytes=16 << 20)
        >>> store.memory_bytes, store.nbytes, len(store)
        (16777216, 0, 0)
    """

    def __init__(self, capacity_bytes: int, *, preallocate_bytes: int | None = None):
        super().__init__()
        capacity_bytes = int_arg("capacity_bytes", capacity_bytes)
        if preallocate_bytes is None:
            preallocate_bytes = min(capacity_bytes, _PREALLOCATE_BYTES)
        preallocate_bytes = int_arg(
            "preallocate_bytes",
            preallocate_bytes,
            low=0,
            high=capacity_bytes,
            expected=f"an int in [0, capacity_bytes={capacity_bytes}]",
        )
        self.capacity_bytes = capacity_bytes
        # key -> (record, the memory it lives in, its bytes)
        self._records: collections.OrderedDict[str, tuple[BlockRecord, _Slot | Segment, int]] = (
            collections.OrderedDict()
        )
        self._chunks: dict[int, _Chunk] = {}
        self._last: _Chunk | None = None  # the newest chunk, filled first
        self._arena_bytes = 0
        self._loose = 0  # free bytes in the chunks
        self._segments: dict[int, list] = {}  # id -> [segment, records of it held]
        self._segment_bytes = 0
        self._held: list[_Slot] = []  # evicted records that a reader still holds
        # id of a lent record's first array -> (its slot, its arrays), lent by `lend`
        self._reserved: dict[int, tuple[_Slot, dict[str, np.ndarray]]] = {}
        while self._arena_bytes < preallocate_bytes:
            self._map(min(_CHUNK_BYTES, preallocate_bytes - self._arena_bytes))

    def __len__(self) -> int:
        return len(self._records)

    @property
    def memory_bytes(self) -> int:
        """Host memory the store holds now: its arena plus the segments it keeps."""
        with self._lock:
            return self._arena_bytes + self._segment_bytes

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._records:
                self._records.move_to_end(key)
                return True
            return False

    def get(self, key: str) -> BlockRecord | None:
        with self._lock:
            entry = self._records.get(key)
            if entry is None:
                self._counters["misses"] += 1
                return None
            self._records.move_to_end(key)
            record, _, size = entry
            self._counters["hits"] += 1
            self._counters["blocks_loaded"] += 1
            self._counters["bytes_loaded"] += size
            return record

    def discard(self, key: str) -> bool:
        """Removes the record of `key`, if held (see `BlockStore.discard`). A reader that still
        holds it keeps it intact: its bytes stay reserved until it lets go, as after an
        eviction."""
        with self._lock:
            if key not in self._records:
                return False
            self._remove(key)
            self._counters["discarded"] += 1
            self._dropped([key], "discarded")
            return True

    def put(self, record: BlockRecord) -> bool:
        size = record.nbytes
        if size > self.capacity_bytes:
            self._count("rejected")
            return False
        with self._lock:
            if record.key in self._records:
                self._records.move_to_end(record.key)
                return False
            owner: _Slot | Segment | None = self._adopt(record) or self._claim(record)
            if owner is None:
                owner = self._acquire(sum(_round_up(a.nbytes) for a in record.parts.values()))
                if owner is None:
                    self._counters["rejected"] += 1
                    return False
                record = _copy_into(record, owner)
            self._records[record.key] = (record, owner, size)
            self._bytes += size
            self._counters["blocks_stored"] += 1
            self._counters["bytes_stored"] += size
            return True

    # ---- arena bytes filled in place --------------------------------------------------------

    def lend(self, parts, count):
        """Arena bytes for `count` records (see `BlockStore.lend`), laid out as `put` copies
        a record; None when the store cannot lend that much now (then `put` copies as usual).
        Saves a host copy per stored block: the connector copies CPU pool rows straight into
        them."""
        size = sum(_round_up(_nbytes(shape, dtype)) for shape, dtype in parts.values())
        if not size or count * size > self.capacity_bytes:
            return None
        slots: list[_Slot] = []
        with self._lock:
            for _ in range(count):
                slot = self._acquire(size)
                if slot is None:
                    for taken in slots:
                        self._give_up(taken)
                    return None
                slots.append(slot)
        arrays = [_parts_in(slot, parts) for slot in slots]
        keys = [id(next(iter(a.values()))) for a in arrays]
        with self._lock:
            self._reserved.update(zip(keys, zip(slots, arrays)))
        return arrays, _Reservation(self, keys)

    def _claim(self, record: BlockRecord) -> _Slot | None:
        """The reserved slot whose very arrays are `record`'s parts (else None: the record
        is copied)."""
        if not self._reserved or not record.parts:
            return None
        key = id(next(iter(record.parts.values())))
        entry = self._reserved.get(key)
        if entry is None:
            return None
        slot, lent = entry
        if record.parts.keys() != lent.keys() or any(
            record.parts[name] is not arr for name, arr in lent.items()
        ):
            return None
        del self._reserved[key]
        for arr in lent.values():
            arr.flags.writeable = False
        return slot

    def _unreserve(self, keys: list[int]) -> None:
        """Gives back the reserved slots of `keys` that no `put` kept."""
        with self._lock:
            for key in keys:
                entry = self._reserved.pop(key, None)
                if entry is not None:
                    slot = entry[0]
                    del entry  # its arrays must not count as a reader in `_give_up`
                    self._give_up(slot)

    def _give_up(self, slot: _Slot) -> None:
        # Free now, or once the caller's arrays of it are gone.
        if slot.unheld():
            self._release(slot)
        else:
            self._held.append(slot)

    # ---- segments --------------------------------------------------------------------------

    def _adopt(self, record: BlockRecord) -> Segment | None:
        """Keeps `record` in its own segment's memory when it is one; None: copy it."""
        if record.source is None or not is_block_of(record):
            return None
        segment = record.source[0]
        entry = self._segments.get(id(segment))
        if entry is not None and entry[0] is segment:
            entry[1] += 1
            return segment
        if segment.nbytes > self.capacity_bytes or not self._make_room(segment.nbytes):
            return None
        self._segments[id(segment)] = [segment, 1]
        self._segment_bytes += segment.nbytes
        return segment

    def _make_room(self, nbytes: int) -> bool:
        while self._arena_bytes + self._segment_bytes + nbytes > self.capacity_bytes:
            if self._unmap_empty_chunk():
                continue
            if not self._records:
                return False
            self._evict_oldest()
        return True

    # ---- arena -----------------------------------------------------------------------------

    def _map(self, nbytes: int) -> _Chunk:
        chunk = self._last = _Chunk(nbytes)
        self._chunks[id(chunk)] = chunk
        self._arena_bytes += nbytes
        self._loose += nbytes
        return chunk

    def _unmap_empty_chunk(self) -> bool:
        for key, chunk in self._chunks.items():
            if chunk.empty:
                del self._chunks[key]
                self._arena_bytes -= chunk.nbytes
                self._loose -= chunk.nbytes
                if self._last is chunk:
                    self._last = None
                return True  # the mapping goes once nothing refers to it
        return False

    def _take(self, chunk: _Chunk | None, size: int) -> _Slot | None:
        offset = None if chunk is None else chunk.take(size)
        if chunk is None or offset is None:
            return None
        self._loose -= size
        return _Slot(chunk, offset, size)

    def _release(self, slot: _Slot) -> _Chunk:
        slot.base = None
        slot.chunk.give(slot.offset, slot.size)
        self._loose += slot.size
        return slot.chunk

    def _acquire(self, size: int) -> _Slot | None:
        """`size` arena bytes for a new record, growing the arena or evicting to find them.

        Every step is O(1) in the number of chunks in the usual cases: a growing store fills
        its newest chunk; a store at capacity reuses the bytes of the record it evicts. Free
        bytes elsewhere (left by records of other sizes) are searched only when there are
        enough of them.
        """
        while True:
            slot = self._take(self._last, size)
            if slot is not None:
                return slot
            if self._loose >= size:
                for chunk in self._chunks.values():
                    slot = self._take(chunk, size)
                    if slot is not None:
                        return slot
            if self._reclaim():
                continue
            room = self.capacity_bytes - self._arena_bytes - self._segment_bytes
            if room >= size:
                # A whole number of records: no fragment is left at the chunk's end.
                self._map(min(max(size, _CHUNK_BYTES // size * size), room // size * size))
                continue
            if self._records:
                slot = self._take(self._evict_oldest(), size)
                if slot is not None:
                    return slot
                continue
            if not self._unmap_empty_chunk():  # only fragments left: remap them whole
                return None

    def _reclaim(self) -> bool:
        """Frees the bytes of evicted records their readers have let go of."""
        held, freed = [], False
        for slot in self._held:  # one test per slot: a reader may let go at any moment
            if slot.unheld():
                self._release(slot)
                freed = True
            else:
                held.append(slot)
        self._held = held
        return freed

    def _evict_oldest(self) -> _Chunk | None:
        """Evicts the least recently used record; returns the chunk whose bytes it freed."""
        self._counters["evictions"] += 1
        key = next(iter(self._records))
        freed = self._remove(key)
        self._dropped([key], "evicted")
        return freed

    def _remove(self, key: str) -> _Chunk | None:
        """Removes the record of `key`, which must be held. Its bytes are freed now, or once
        the last reader holding it lets go; a segment's bytes once its last record leaves.
        Returns the chunk whose bytes were freed now, if any."""
        record, owner, size = self._records.pop(key)
        self._bytes -= size
        del record  # the store's reference: `unheld` then sees only the readers'
        if isinstance(owner, Segment):
            entry = self._segments[id(owner)]
            entry[1] -= 1
            if not entry[1]:
                del self._segments[id(owner)]
                self._segment_bytes -= owner.nbytes
            return None
        if owner.unheld():
            return self._release(owner)
        self._held.append(owner)
        return None


class _Reservation:
    """Reserved arena slots of one `HostStore.lend` call; `release` gives back those no `put`
    kept (call it once the records were put, or when they never will be)."""

    def __init__(self, store: HostStore, keys: list[int]):
        self._store, self._keys = store, keys

    def release(self) -> None:
        self._store._unreserve(self._keys)
        self._keys = []


def _nbytes(shape: tuple[int, ...], dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _parts_in(slot: _Slot, parts: Mapping[str, tuple[tuple[int, ...], np.dtype]]):
    """Arrays of `parts` (name -> shape, dtype) laid one after another in `slot`, each at a
    rounded offset: how `put` lays out a copied record and `lend` a lent one."""
    out, offset = {}, 0
    base = slot.base
    assert base is not None, "a released slot holds no record"
    for name, (shape, dtype) in parts.items():
        nbytes = _nbytes(shape, dtype)
        out[name] = base[offset : offset + nbytes].view(dtype).reshape(shape)
        offset += _round_up(nbytes)
    return out


def _copy_into(record: BlockRecord, slot: _Slot) -> BlockRecord:
    """A read-only copy of `record` in `slot`, its parts one after another."""
    parts = _parts_in(slot, {name: (a.shape, a.dtype) for name, a in record.parts.items()})
    for name, dst in parts.items():
        np.copyto(dst, record.parts[name])
        dst.flags.writeable = False
    return dataclasses.replace(record, parts=parts, source=None)
