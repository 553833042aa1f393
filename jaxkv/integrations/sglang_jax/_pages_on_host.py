"""Host memory for the pool's pages: an arena on CPU devices, pinned segments on
accelerators.

A page of the pool lives on the host as one piece per buffer family (a `PageMover` each: the
KV buffers, and a DSA pool's indexer keys), part (the share of a page one device holds,
`PageMover.placement`) and layer. Each kind runs the four steps of the two moves, and says
what pages are between a move's two phases (a `Batch`, rows `0..size-1`). `buffers` are the
device pool's per-layer lists, one per family, in the movers' order:

- `gather(buffers, pages)`: the device pages, copied out of the device pool's buffers (on the
  thread that owns them; it returns once nothing reads them any more).
- `keep(slots, batch, rows)`: rows `rows` of a gathered batch become the pages of `slots`.
- `fetch(slots)`: the pages `slots` hold now, ready for `scatter` (it returns once they are);
  a later backup into a slot leaves them as they were.
- `scatter(buffers, batch, rows, pages)`: rows `rows` of a fetched batch written into the
  distinct device pages `pages` (on the thread that owns the buffers): the buffers are
  donated, and the new ones replace them in the lists `buffers` before anything can fail.
- `drop(slot)`: the slot holds nothing any more.
- `precompile(max_pages)`: compiles whatever a transfer of up to `max_pages` pages runs;
  returns how many compiled calls that is.

The pool calls `keep` and `fetch` outside its lock, only for slots it has claimed (no other
copy in or out of them runs meanwhile), and `drop` once a slot is back on its free list.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxkv.connector.transfer import StagingCache, aligned_empty, host_view
from jaxkv.integrations.sglang_jax._pages_on_device import PageMover, PartKey, Shard, chunk_sizes

# Per family (the movers' order), the device pool's per-layer list of buffers.
Families = Sequence[list[jax.Array]]

_TOUCH = 4096  # bytes between the writes that fault a fresh mapping in


class Batch:
    """Pages between the two phases of a move, rows `0..size-1`, as the kind of host memory
    holds them (`data`: a chunk on the devices, or host staging)."""

    __slots__ = ("data", "size", "__weakref__")

    def __init__(self, data: Any, size: int):
        self.data, self.size = data, size


class HostPages(Protocol):
    """Where the pool's pages live on the host (see the module docstring)."""

    def gather(self, buffers: Families, pages: np.ndarray) -> list[Batch]: ...

    def keep(self, slots: np.ndarray, batch: Batch, rows: np.ndarray) -> None: ...

    def fetch(self, slots: np.ndarray) -> list[Batch]: ...

    def scatter(
        self, buffers: Families, batch: Batch, rows: np.ndarray, pages: np.ndarray
    ) -> None: ...

    def drop(self, slot: int) -> None: ...

    def precompile(self, max_pages: int) -> int: ...


def host_pages_for(slots: int, movers: Sequence[PageMover]) -> HostPages:
    """The host memory for `slots` pages of the pool whose buffer families `movers` move: the
    arena on CPU devices, pinned segments on accelerators.

    Raises:
        ValueError: accelerators without a `pinned_host` memory.
    """
    devices = list(dict.fromkeys(dev for mover in movers for dev in mover.placement))
    if all(dev.platform == "cpu" for dev in devices):
        return ArenaPages(slots, movers)
    if all(_has_pinned_host(dev) for dev in devices):
        return PinnedPages(slots, movers)
    raise ValueError(
        "device_pool.kv_buffer: expected arrays on CPU devices or on accelerators with "
        f"pinned host memory (memory_kind 'pinned_host'), got {sorted(map(str, devices))}"
    )


def _has_pinned_host(dev) -> bool:
    try:
        return "pinned_host" in {m.kind for m in dev.addressable_memories()}
    except (AttributeError, NotImplementedError, RuntimeError):  # backends without memories
        return False


class ArenaPages:
    """Pages in host memory allocated and touched ahead, for a pool on CPU devices: rows of
    blocks of host arrays, per family and part `(layers, rows, *part)`, one row a page (of
    every family).

    A row is written once, while no one else holds it, and never changed after: a slot refers
    to the row of its page (as a pinned slot refers to its row of a segment) and a batch holds
    the rows of its pages. So each move is one numpy copy per part and layer, of the pages'
    bits, the device buffers being host memory too (`PageMover.shard_views`): `gather` copies
    device pages into free rows, `keep` points the slots at them, `fetch` holds the slots'
    rows, `scatter` copies those rows into device pages. A row is free again once no slot and
    no batch holds it (a batch lets go of its rows when the last reference to it goes).

    The first block has a row per slot, and every 4 KiB page of a block is written when it is
    made: a copy into fresh memory pays a page fault per 4 KiB on first touch. Rows beyond one
    per slot are needed only while a slot's old page is held with its new one (a slot that
    holds a page backed up into again, a load staged from a slot backed up into again before
    the load's flush); then a block is added, and kept.
    """

    def __init__(self, slots: int, movers: Sequence[PageMover]):
        self._movers = list(movers)
        self._slots = slots
        self._lock = threading.Lock()
        self._blocks: list[list[dict[PartKey, np.ndarray]]] = []  # per block, per family
        self._starts = np.zeros(0, np.int64)  # each block's first row
        self._refs = np.zeros(0, np.int32)  # per row: the slots and batches holding it
        self._slot_row = np.full(slots, -1, np.int64)  # -1: the slot holds no page
        # Rows let go of by batches that died, counted down at the next call: a batch may die
        # on any thread, inside any call, the lock's holder's included.
        self._released: collections.deque[np.ndarray] = collections.deque()
        self._grow(slots)
        # Per family, the shards each part is read from: one per run of pages (replicas agree).
        self._readers: list[dict[PartKey, list[Shard]]] = []
        for mover in self._movers:
            readers: dict[PartKey, list[Shard]] = {}
            runs: set[tuple[PartKey, int]] = set()
            for shard in mover.shards:
                if (shard.key, shard.start) not in runs:
                    runs.add((shard.key, shard.start))
                    readers.setdefault(shard.key, []).append(shard)
            self._readers.append(readers)

    def gather(self, buffers, pages):
        jax.block_until_ready(buffers)  # computations still writing them finish first
        with self._lock:
            batch = self._batch(self._allocate(len(pages)))
            runs = self._runs(batch.data)
        for family, mover, layer, buf in _layers(self._movers, buffers):
            views = mover.shard_views(buf)
            for key, shards in self._readers[family].items():
                for shard in shards:
                    src = views[shard.device]
                    inside = (pages >= shard.start) & (pages < shard.stop)
                    for first, stop, block, row in runs:
                        out = block[family][key][layer, row : row + stop - first]
                        part, ins = pages[first:stop] - shard.start, inside[first:stop]
                        if ins.all():
                            # numpy's default mode copies through a temporary, in case an
                            # index is bad; the pool has checked them.
                            np.take(src, part, axis=0, out=out, mode="clip")
                        elif ins.any():
                            out[ins] = src[part[ins]]
        return [batch]

    def keep(self, slots, batch, rows):
        with self._lock:
            self._count_released()
            new = batch.data[rows]
            old = self._slot_row[slots]
            self._slot_row[slots] = new
            self._hold(new, 1)
            self._hold(old[old >= 0], -1)

    def fetch(self, slots):
        with self._lock:
            self._count_released()
            rows = self._slot_row[slots]
            assert (rows >= 0).all(), "the pool fetches only slots that hold a page"
            self._hold(rows, 1)
            return [self._batch(rows)]

    def scatter(self, buffers, batch, rows, pages):
        # In row order, rows that follow each other copy as one run, whatever their pages.
        order = np.argsort(batch.data[rows], kind="stable")
        src_rows, pages = batch.data[rows][order], pages[order]
        with self._lock:
            runs = self._runs(src_rows)
        claimed = [mover.claim(family) for mover, family in zip(self._movers, buffers)]
        for family, new in zip(buffers, claimed):
            for layer, buf in enumerate(new):
                family[layer] = buf
        for family, mover, layer, buf in _layers(self._movers, claimed):
            views = mover.shard_views(buf, writable=True)
            for shard in mover.shards:  # every replica of a page is written
                dst = views[shard.device]
                inside = (pages >= shard.start) & (pages < shard.stop)
                for first, stop, block, row in runs:
                    src = block[family][shard.key][layer, row : row + stop - first]
                    part, ins = pages[first:stop] - shard.start, inside[first:stop]
                    if ins.all():
                        dst[part] = src
                    elif ins.any():
                        dst[part[ins]] = src[ins]

    def drop(self, slot):
        with self._lock:
            self._count_released()
            row = self._slot_row[slot]
            if row >= 0:
                self._slot_row[slot] = -1
                self._refs[row] -= 1

    def precompile(self, max_pages):
        for mover in self._movers:  # the copies are numpy's: only the claims compile
            mover.precompile_claim()
        return len(self._movers)

    @property
    def rows(self) -> int:
        """Rows allocated, in all blocks (`slots` until a block is added)."""
        return len(self._refs)

    @property
    def nbytes(self) -> int:
        """Host memory the rows take, in bytes (every family's, in all blocks)."""
        return sum(a.nbytes for block in self._blocks for parts in block for a in parts.values())

    def rows_held(self) -> int:
        """Rows some slot or batch holds now."""
        with self._lock:
            self._count_released()
            return int(np.count_nonzero(self._refs))

    # ---- rows (callers hold the lock) --------------------------------------------------------

    def _allocate(self, count: int) -> np.ndarray:
        """`count` free rows, lowest first (so they mostly follow each other), now held once."""
        self._count_released()
        free = np.flatnonzero(self._refs == 0)
        if len(free) < count:
            self._grow(max(count - len(free), -(-self._slots // 8)))
            free = np.flatnonzero(self._refs == 0)
        rows = free[:count]
        self._refs[rows] = 1
        return rows

    def _grow(self, rows: int) -> None:
        block = []
        for m in self._movers:
            parts = {}
            for key, shape in m.part_shapes.items():
                arr = aligned_empty((m.layers, rows, *shape), m.bits)
                arr.reshape(-1).view(np.uint8)[::_TOUCH] = 0
                parts[key] = arr
            block.append(parts)
        self._blocks.append(block)
        self._starts = np.append(self._starts, len(self._refs))
        self._refs = np.concatenate([self._refs, np.zeros(rows, np.int32)])

    def _hold(self, rows: np.ndarray, delta: int) -> None:
        np.add.at(self._refs, rows, delta)

    def _count_released(self) -> None:
        while self._released:
            self._hold(self._released.popleft(), -1)

    def _batch(self, rows: np.ndarray) -> Batch:
        """A batch of `rows` (held once for it), letting go of them when it dies."""
        batch = Batch(rows, len(rows))
        weakref.finalize(batch, self._released.append, rows)
        return batch

    def _runs(
        self, rows: np.ndarray
    ) -> list[tuple[int, int, list[dict[PartKey, np.ndarray]], int]]:
        """`(first, stop, block, row)` for each run of `rows` that follow each other in one
        block (per family, per part): `rows[first:stop]` are that block's rows from `row` on."""
        blocks = np.searchsorted(self._starts, rows, side="right") - 1
        breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(blocks) != 0)) + 1
        edges = [0, *breaks.tolist(), len(rows)]
        return [
            (a, b, self._blocks[blocks[a]], int(rows[a] - self._starts[blocks[a]]))
            for a, b in zip(edges, edges[1:])
        ]


def _layers(
    movers: Sequence[PageMover], buffers: Families | Sequence[Sequence[jax.Array]]
) -> Iterator[tuple[int, PageMover, int, jax.Array]]:
    """`(family, mover, layer, buffer)` for every buffer of `buffers` (per family)."""
    for family, (mover, layers) in enumerate(zip(movers, buffers, strict=True)):
        for layer, buf in enumerate(layers):
            yield family, mover, layer, buf


def _rows_of(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`x[rows]`, without a copy when `rows` is all of `x` in order (a whole chunk)."""
    if len(rows) == len(x) and np.array_equal(rows, np.arange(len(x))):
        return x
    return x[rows]


class _Segment:
    """One landed chunk in pinned host memory, as host views per (family, part) and layer
    (each view holds its pinned array, so the memory lives as long as the segment)."""

    __slots__ = ("views",)

    def __init__(self, arrays: Mapping[tuple[int, PartKey], Sequence[jax.Array]]):
        self.views = {key: [host_view(a) for a in layers] for key, layers in arrays.items()}


class PinnedPages:
    """Pages in the pinned host arrays their chunks landed in (segments), kept as they are.

    A move runs as compiled calls over all layers of a family, per power-of-two chunk of its
    pages (`PageMover`): a batch is a chunk of every family on the devices. A chunk crosses
    the link once, device to pinned memory at the link's speed, and its pages stay there: a
    slot refers to a row of a segment. A segment's memory is freed when its last page leaves
    the pool; pages backed up together (one radix node's) usually leave together. A fetch
    copies the slots' rows from their segments into pinned staging (reused) and sends that to
    each device in one transfer per layer.
    """

    def __init__(self, slots: int, movers: Sequence[PageMover]):
        self._movers = list(movers)
        self._refs: list[tuple[_Segment, int] | None] = [None] * slots
        self._staging = StagingCache()
        # Staging transfers name their target device through an array on it.
        devices = dict.fromkeys(dev for mover in movers for dev in mover.placement)
        self._anchors = {dev: jax.device_put(np.zeros((), np.int8), dev) for dev in devices}

    def gather(self, buffers, pages):
        # Per family, the same chunk sizes: a batch is the i-th chunk of every family.
        chunks = [m.gather(family, pages) for m, family in zip(self._movers, buffers, strict=True)]
        jax.block_until_ready(chunks)  # the buffers may be donated once this returns
        return [Batch(tuple(c), int(c[0][0].shape[0])) for c in zip(*chunks)]

    def keep(self, slots, batch, rows):
        pinned = {
            (family, key): [jax.device_put(x, _pinned_on(x)) for x in layers]
            for family, mover in enumerate(self._movers)
            for key, layers in mover.parts(batch.data[family]).items()
        }
        segment = _Segment(pinned)  # its views wait for the transfers
        for slot, row in zip(slots.tolist(), rows.tolist()):
            self._refs[slot] = (segment, row)

    def fetch(self, slots):
        batches, start = [], 0
        for size in chunk_sizes(len(slots)):
            chunk = tuple(
                mover.assemble(self._to_devices(family, slots[start : start + size]), size)
                for family, mover in enumerate(self._movers)
            )
            batches.append(Batch(chunk, size))
            start += size
        jax.block_until_ready([batch.data for batch in batches])
        return batches

    def scatter(self, buffers, batch, rows, pages):
        for mover, family, chunk in zip(self._movers, buffers, batch.data, strict=True):
            # Each family's donated buffers are replaced before the next family's call runs.
            for layer, buf in enumerate(mover.scatter(family, chunk, rows, pages)):
                family[layer] = buf

    def drop(self, slot):
        self._refs[slot] = None

    def precompile(self, max_pages):
        # Pinned staging and its transfers compile nothing.
        return sum(2 * len(mover.precompile(max_pages)) for mover in self._movers)

    def _to_devices(self, family: int, slots: np.ndarray) -> dict[Any, tuple[jax.Array, ...]]:
        """The pages of `slots` in buffer family `family`, per device, as arrays on that
        device."""
        refs = [self._refs[slot] for slot in slots.tolist()]
        groups: dict[int, tuple[_Segment, list[int], list[int]]] = {}
        for pos, ref in enumerate(refs):
            assert ref is not None, "the pool fetches only slots that hold a page"
            segment, row = ref
            group = groups.setdefault(id(segment), (segment, [], []))
            group[1].append(pos)
            group[2].append(row)
        out = {}
        mover = self._movers[family]
        for dev, key in mover.placement.items():
            shape = (len(slots), *mover.part_shapes[key])
            with self._staging.borrow("pinned", mover.layers, shape, mover.bits, dev) as staging:
                for segment, positions, rows in groups.values():
                    views = segment.views[family, key]
                    for layer, dst in enumerate(staging.host):
                        dst[positions] = _rows_of(views[layer], np.asarray(rows))
                arrays = staging.on_device(self._anchors[dev])
                out[dev] = tuple(jax.block_until_ready(arrays))  # before the staging is reused
        return out


def _pinned_on(x: jax.Array) -> SingleDeviceSharding:
    """Pinned host memory beside the one device of `x`."""
    return SingleDeviceSharding(next(iter(x.sharding.device_set)), memory_kind="pinned_host")
