"""Host memory for the pool's pages: a pre-touched arena on CPU devices, pinned segments on
accelerators.

A page of the pool lives on the host as one piece per part (the share of a page one device
holds, `PageMover.placement`) and layer. Both kinds answer the same four calls:

- `land(parts)`: a chunk that came off the devices, as host arrays per part and layer.
- `keep(slots, landed, rows)`: rows `rows` of a landed chunk become the pages of `slots`.
- `fetch(slots)`: the pages of `slots`, per device, as arrays on that device.
- `drop(slot)`: the slot holds nothing any more.
- `warm(size)`: compiles whatever a fetch of `size` pages runs (for `precompile_transfers`).

The pool calls `keep` and `fetch` outside its lock, only for slots it has claimed (no other
copy in or out of them runs meanwhile), and `drop` once a slot is back on its free list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxkv.connector._staging import StagingCache, aligned_empty, host_view, to_host
from jaxkv.integrations.sglang_jax._pages_on_device import PageMover, PartKey

_TOUCH = 4096  # bytes between the writes that fault a fresh mapping in


class Landed:
    """A chunk on the host: per part, per layer, `(c, *part_shape)` arrays (`views`), and
    what holds their memory (`owner`: a pinned segment, or None for views of device arrays
    read before the call that landed them returns)."""

    __slots__ = ("views", "owner")

    def __init__(self, views: Mapping[PartKey, Sequence[np.ndarray]], owner: Any = None):
        self.views, self.owner = views, owner


class HostPages(Protocol):
    """Where the pool's pages live on the host (see the module docstring)."""

    def land(self, parts: Mapping[PartKey, Sequence[jax.Array]]) -> Landed: ...

    def keep(self, slots: np.ndarray, landed: Landed, rows: np.ndarray) -> None: ...

    def fetch(self, slots: np.ndarray) -> dict[Any, tuple[jax.Array, ...]]: ...

    def drop(self, slot: int) -> None: ...

    def warm(self, size: int) -> None: ...


def host_pages_for(slots: int, mover: PageMover) -> HostPages:
    """The host memory for `slots` pages of `mover`'s pool: pinned segments when every device
    has a `pinned_host` memory and is an accelerator, the arena otherwise."""
    devices = list(mover.placement)
    if all(dev.platform != "cpu" and _has_pinned_host(dev) for dev in devices):
        return PinnedPages(slots, mover)
    return ArenaPages(slots, mover)


def _has_pinned_host(dev) -> bool:
    try:
        return "pinned_host" in {m.kind for m in dev.addressable_memories()}
    except (AttributeError, NotImplementedError, RuntimeError):  # backends without memories
        return False


class ArenaPages:
    """Pages in host arrays allocated and touched once: per part, `(layers, slots, *part)`.

    A slot's page sits at row `slot` of every layer, so keeping a page is one copy per part
    and layer, and the memory never moves or grows. Every 4 KiB page of the arena is written
    at construction: a copy into fresh memory pays a page fault per 4 KiB on first touch.
    On CPU devices a landed chunk is a zero-copy view of the device array, and a fetched page
    is copied once, straight into memory XLA allocated for the device array.
    """

    def __init__(self, slots: int, mover: PageMover):
        self._mover = mover
        self._rows: dict[PartKey, np.ndarray] = {}
        for key, shape in mover.part_shapes.items():
            rows = aligned_empty((mover.layers, slots, *shape), mover.bits)
            rows.reshape(-1).view(np.uint8)[::_TOUCH] = 0
            self._rows[key] = rows

    def land(self, parts):
        return Landed({key: [to_host(x) for x in layers] for key, layers in parts.items()})

    def keep(self, slots, landed, rows):
        for key, layers in landed.views.items():
            dst = self._rows[key]
            for layer, src in enumerate(layers):
                dst[layer, slots] = _rows_of(src, rows)

    def fetch(self, slots):
        out = {}
        for dev, key in self._mover.placement.items():
            rows = self._rows[key]
            out[dev] = tuple(self._on_device(rows[layer], slots, dev) for layer in range(len(rows)))
        return out

    def drop(self, slot):
        pass  # the row is rewritten by the slot's next page

    def warm(self, size):
        for dev, key in self._mover.placement.items():
            if dev.platform == "cpu":
                _xla_owned((size, *self._mover.part_shapes[key]), self._mover.bits, dev)

    def _on_device(self, rows: np.ndarray, slots: np.ndarray, dev) -> jax.Array:
        shape = (len(slots), *rows.shape[1:])
        if dev.platform == "cpu":
            # A CPU device reads numpy memory it is handed in place (device_put aliases it), so
            # the pages are copied into memory XLA allocated, which outlives nothing of ours.
            arr = _xla_owned(shape, rows.dtype, dev)
            np.take(rows, slots, axis=0, out=host_view(arr, writable=True))
            return arr
        return jax.device_put(np.take(rows, slots, axis=0), dev)


def _rows_of(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`x[rows]`, without a copy when `rows` is all of `x` in order (a whole chunk)."""
    if len(rows) == len(x) and np.array_equal(rows, np.arange(len(x))):
        return x
    return x[rows]


def _xla_owned(shape: tuple[int, ...], dtype, dev) -> jax.Array:
    """A new zeroed array of XLA's own memory on `dev` (one compiled fill per shape)."""
    return jnp.zeros(shape, dtype, device=dev)


class _Segment:
    """One landed chunk in pinned host memory, as host views per part and layer (each view
    holds its pinned array, so the memory lives as long as the segment)."""

    __slots__ = ("views",)

    def __init__(self, arrays: Mapping[PartKey, Sequence[jax.Array]]):
        self.views = {key: [host_view(a) for a in layers] for key, layers in arrays.items()}


class PinnedPages:
    """Pages in the pinned host arrays their chunks landed in (segments), kept as they are.

    A chunk crosses the link once, device to pinned memory at the link's speed, and its pages
    stay there: a slot refers to a row of a segment. A segment's memory is freed when its last
    page leaves the pool; pages backed up together (one radix node's) usually leave together.
    A fetch copies the slots' rows from their segments into pinned staging (reused) and sends
    that to each device in one transfer per layer.
    """

    def __init__(self, slots: int, mover: PageMover):
        self._mover = mover
        self._refs: list[tuple[_Segment, int] | None] = [None] * slots
        self._staging = StagingCache()
        # Staging transfers name their target device through an array on it.
        self._anchors = {dev: jax.device_put(np.zeros((), np.int8), dev) for dev in mover.placement}

    def land(self, parts):
        pinned = {
            key: [jax.device_put(x, _pinned_on(x)) for x in layers] for key, layers in parts.items()
        }
        segment = _Segment(pinned)  # its views wait for the transfers
        return Landed(segment.views, owner=segment)

    def keep(self, slots, landed, rows):
        segment = landed.owner
        assert isinstance(segment, _Segment), "PinnedPages keeps only chunks it landed"
        for slot, row in zip(slots.tolist(), rows.tolist()):
            self._refs[slot] = (segment, row)

    def fetch(self, slots):
        refs = [self._refs[slot] for slot in slots.tolist()]
        groups: dict[int, tuple[_Segment, list[int], list[int]]] = {}
        for pos, ref in enumerate(refs):
            assert ref is not None, "the pool fetches only slots that hold a page"
            segment, row = ref
            group = groups.setdefault(id(segment), (segment, [], []))
            group[1].append(pos)
            group[2].append(row)
        out = {}
        for dev, key in self._mover.placement.items():
            shape = (len(slots), *self._mover.part_shapes[key])
            with self._staging.borrow(
                "pinned", self._mover.layers, shape, self._mover.bits, dev
            ) as staging:
                for segment, positions, rows in groups.values():
                    for layer, dst in enumerate(staging.host):
                        dst[positions] = _rows_of(segment.views[key][layer], np.asarray(rows))
                arrays = staging.on_device(self._anchors[dev])
                out[dev] = tuple(jax.block_until_ready(arrays))  # before the staging is reused
        return out

    def drop(self, slot):
        self._refs[slot] = None

    def warm(self, size):
        pass  # pinned staging and its transfers compile nothing


def _pinned_on(x: jax.Array) -> SingleDeviceSharding:
    """Pinned host memory beside the one device of `x`."""
    return SingleDeviceSharding(next(iter(x.sharding.device_set)), memory_kind="pinned_host")
