"""Transfer paths: how blocks cross between a pool's buffers and host memory.

A connector picks one `TransferPath` when it is made (`choose_path`), from where the pool's
buffers live and what the caller asked for, and every store and load goes through it:

- `CpuCopyPath`: a jaxkv pool on one CPU device. Snapshots copy the blocks with numpy from
  zero-copy views of the layer buffers, into memory the store lends for them
  (`BlockStore.lend`) or into reused staging; loads fill XLA-owned staging that the scatter
  reads in place.
- `GatherPath`: any other jax buffers (a mesh shard, a device without pinned host memory). One
  jitted gather stacks the blocks on the device and hands them to the host through DLPack; on
  CPU a large snapshot gathers layer by layer instead (see `stack_above_bytes`).
- `PinnedPath`: buffers on one device with pinned host memory (GPU, TPU; CPU when asked). A
  snapshot is a `Segment`, the device-to-pinned transfer's own output, which a store keeps
  without a host copy; a load sends a segment back whole when it needs enough of it (see
  `whole_segment_share`), else stages blocks in pinned host memory.
- `ForeignHostPath`: a foreign pool with buffers jaxkv moves outside XLA (numpy arrays, torch
  tensors on an accelerator): read with numpy or torch and written in place.

Each path owns its staging cache and its thresholds. Exports (`export_blocks`) always gather on
the device: they hand the caller block-major arrays, whatever the path.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jaxkv.connector import _foreign
from jaxkv.connector._block_kernels import (
    block_starts,
    bucket,
    gather_jit,
    gather_layers_jit,
    pick_layers_jit,
    read_slots,
)
from jaxkv.connector._pool_views import PoolView
from jaxkv.connector._records import BlockRecord, Segment, address, is_block_of
from jaxkv.connector.transfer import (
    DeviceStaging,
    JoinedStaging,
    Staging,
    StagingCache,
    device_of,
    dlpack_view,
    host_view,
    pinned_device,
    to_host,
)

#: The `transfer` choices a connector accepts; None picks from the pool's placement.
TRANSFERS = ("cpu", "gather", "pinned")


@dataclasses.dataclass
class Snapshot:
    """Host copies of blocks, taken for a store.

    Attributes:
        parts: per block, its parts `(layer_num, block_size, *row)`.
        segment: when set, `parts[j]` is block j of this segment (see `Segment`).
        give_back: staging buffers and store loans to hand back once the records are written.
    """

    parts: list[dict[str, np.ndarray]]
    segment: Segment | None = None
    give_back: list = dataclasses.field(default_factory=list)


class TransferPath:
    """One way blocks cross between a pool's buffers and host memory (see the module)."""

    name = ""

    def __init__(self) -> None:
        self.staging = StagingCache()

    def snapshot(self, view: PoolView, slots: np.ndarray, block_size: int, store) -> Snapshot:
        """The blocks at `slots` (whole blocks, in order) copied to host memory; complete
        when this returns, so the pool may be donated at once."""
        n_blocks = len(slots) // block_size
        return Snapshot(per_block(gather_blocks(view, slots, block_size), n_blocks))

    def write(self, view: PoolView, records: Sequence[BlockRecord], slots, block_size: int):
        """Writes `records` at `slots` (block_size rows each); returns the pool (a jaxkv pool
        anew, a foreign pool written in place) or, for a shard, its new arrays."""
        return self.write_staged(view, records, slots, block_size)

    def write_staged(self, view: PoolView, records: Sequence[BlockRecord], slots, block_size):
        """`write` through host staging: the records stacked per layer into staging memory
        that reaches the device without a further host copy where the path has one."""
        with contextlib.ExitStack() as stack:
            staging = self._staged(stack, view, records, block_size)
            return view.write(slots, staging, block_size)

    def precompile(self, view: PoolView, n_blocks: int, block_size: int, windows: bool):
        """Compiles (by running) the device transfers of `n_blocks` blocks: a load's scatter
        whose every block is dropped, so nothing is written, and, where a snapshot gathers on
        the device, a gather of as many blocks; blocks as runs of slots (`windows`) or not,
        the two variants an allocator's slots lead to. Returns what `write` returns."""
        if self.name != "cpu":
            run = np.arange(block_size)
            gather_blocks(view, np.tile(run if windows else run[::-1], n_blocks), block_size)
        with contextlib.ExitStack() as stack:
            staging = self._staged(stack, view, [], block_size, room=n_blocks)
            return view.write(np.empty(0, np.int64), staging, block_size, windows)

    def _staged(self, stack, view, records, block_size, room: int = 0) -> list[Staging]:
        """Per part, staging borrowed for the rest of `stack` holding `records`' blocks (with
        room for at least `room` blocks)."""
        staging = []
        for p in view.layout.parts:
            like = None if view.host_layers(p) is not None else view.arrays((p,))[0][0]
            kind, device = self._staging_kind(like)
            # Device staging holds a `bucket` of blocks: the scatter compiles once per bucket.
            n = len(records)
            shape = (n if like is None else bucket(max(n, room)), block_size, *p.row_shape)
            slot = stack.enter_context(
                self.staging.borrow(kind, view.layout.part_layers(p), shape, p.bits_dtype, device)
            )
            slot.blocks = n
            # Blocks a HostStore holds side by side (stored together) are one strided
            # array: one copy per layer instead of a stack of every block.
            blocks = as_one_array([r.parts[p.key] for r in records]) if records else None
            for li, host in enumerate(slot.host if records else ()):
                if isinstance(blocks, np.ndarray):
                    host[:n] = blocks[:, li]
                else:
                    np.stack([r.parts[p.key][li] for r in records], out=host[:n])
            staging.append(slot)
        return staging

    def _staging_kind(self, like: jax.Array | None) -> tuple[str, jax.Device | None]:
        """The load staging for buffers like `like` (None: written outside XLA)."""
        if like is None or len(like.sharding.device_set) != 1:
            return "host", None
        dev = device_of(like)
        return ("xla", dev) if dev.platform == "cpu" else ("host", None)

    def give_back(self, snapshot: Snapshot) -> None:
        """Returns a snapshot's staging to the cache and releases a store's loan (what the
        store kept of it is its own now)."""
        for item in snapshot.give_back:
            if isinstance(item, np.ndarray):
                self.staging.give(item)
            else:
                item.release()
        snapshot.give_back = []


class GatherPath(TransferPath):
    """Jax buffers on any device: gathered on the device, handed over through DLPack.

    Attributes:
        stack_above_bytes: on CPU, a snapshot whose largest part exceeds this gathers each
            layer into its own device array and stacks them on the host into reused memory:
            glibc serves allocations above its mmap threshold (at most 32 MiB on 64-bit) with
            fresh mappings, so one large XLA output faults in every page on each call.
    """

    name = "gather"
    stack_above_bytes = 32 << 20

    def snapshot(self, view, slots, block_size, store):
        n_blocks = len(slots) // block_size
        largest = max(
            n_blocks * view.layout.part_layers(p) * block_size * _row_bytes(p)
            for p in view.layout.parts
        )
        arrays = view.arrays()
        platform = device_of(arrays[0][0]).platform
        if largest <= self.stack_above_bytes or platform != "cpu":
            return super().snapshot(view, slots, block_size, store)
        codecs = tuple(p.codec for p in view.layout.parts)
        starts = block_starts(slots, block_size)
        per_layer = gather_layers_jit(arrays, slots.astype(np.int32), starts, codecs, block_size)
        jax.block_until_ready(per_layer)
        out = {}
        for part, layers in zip(view.layout.parts, per_layer):
            shape = (n_blocks, len(layers), block_size, *part.row_shape)
            buf = self.staging.take(shape, part.bits_dtype)
            np.stack([to_host(x) for x in layers], axis=1, out=buf)
            out[part.key] = buf
        return Snapshot(per_block(out, n_blocks), None, list(out.values()))


class CpuCopyPath(GatherPath):
    """A jaxkv pool on one CPU device, every part token-major (see the module); blocks that
    are not runs of rows are gathered on the device instead."""

    name = "cpu"

    def snapshot(self, view, slots, block_size, store):
        starts = block_starts(slots, block_size)
        layers = _cpu_layers(view)
        if starts is None or layers is None:
            return super().snapshot(view, slots, block_size, store)
        n_blocks = len(slots) // block_size
        jax.block_until_ready(layers)
        parts = view.layout.parts
        shapes = {
            p.key: ((len(bufs), block_size, *p.row_shape), p.bits_dtype)
            for p, bufs in zip(parts, layers)
        }
        lent = store.lend(shapes, n_blocks)
        if lent is not None:
            blocks, loan = lent
            dests = {k: as_one_array([b[k] for b in blocks]) for k in shapes}
            give_back = [loan]
        else:
            dests = {
                k: self.staging.take((n_blocks, *shape), dtype)
                for k, (shape, dtype) in shapes.items()
            }
            blocks = per_block(dests, n_blocks)
            give_back = list(dests.values())
        for part, bufs in zip(parts, layers):
            _copy_blocks(bufs, starts, block_size, dests[part.key])
        return Snapshot(blocks, None, give_back)


class PinnedPath(TransferPath):
    """Buffers on one device with pinned host memory (see the module).

    Attributes:
        whole_segment_share: a load sends a segment back to the device whole when it needs at
            least this share of the segment's blocks; for fewer, copying them on the host into
            pinned staging moves less (the link is several times faster than a host copy:
            docs/performance.md).
    """

    name = "pinned"
    whole_segment_share = 1 / 8

    def snapshot(self, view, slots, block_size, store):
        arrays = view.arrays()
        codecs = tuple(p.codec for p in view.layout.parts)
        starts = block_starts(slots, block_size)
        staged = gather_jit(arrays, slots.astype(np.int32), starts, codecs, block_size)
        target = jax.sharding.SingleDeviceSharding(_device(arrays), memory_kind="pinned_host")
        pinned = jax.device_put(list(staged), target)
        keys = [p.key for p in view.layout.parts]
        segment = Segment(dict(zip(keys, pinned)), {k: host_view(x) for k, x in zip(keys, pinned)})
        return Snapshot(per_block(segment.host, len(slots) // block_size), segment)

    def write(self, view, records, slots, block_size):
        """Segments worth sending whole go back as they are, the other records through pinned
        staging; all of it in one scatter, so a load that fails changes nothing."""
        by_segment: dict[int, list[int]] = {}
        for i, record in enumerate(records):
            if is_block_of(record):
                by_segment.setdefault(id(record.source[0]), []).append(i)
        keys = [p.key for p in view.layout.parts]
        device = _device(view.arrays())
        order: list[int] = []  # record indices in the order their staging is joined
        groups: list[list[Staging]] = []  # per group, one staging per part
        for group in by_segment.values():
            segment = records[group[0]].source[0]
            if len(group) < self.whole_segment_share * segment.blocks:  # blocks of one size
                continue
            index = np.array([records[i].source[1] for i in group])
            groups.append(self.segment_staging(segment, keys, index, device))
            order += group
        whole = set(order)
        rest = [i for i in range(len(records)) if i not in whole]
        rows = np.concatenate([slots[i * block_size : (i + 1) * block_size] for i in order + rest])
        with contextlib.ExitStack() as stack:
            if rest:
                groups.append(self._staged(stack, view, [records[i] for i in rest], block_size))
            staging = groups[0] if len(groups) == 1 else [JoinedStaging(g) for g in zip(*groups)]
            return view.write(rows, staging, block_size)

    def segment_staging(
        self, segment: Segment, keys: Sequence[str], index: np.ndarray, device: jax.Device
    ) -> list[DeviceStaging]:
        """Device-side staging (one per part in `keys`) of blocks `index` of `segment`, for
        buffers on `device`: the segment moves to device memory as it is, and picking the
        blocks and splitting them per layer runs on the device."""
        target = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        on_dev = jax.device_put([segment.arrays[k] for k in keys], target)
        index = np.asarray(index, np.int32)
        every = np.arange(segment.blocks)
        whole = index.shape == every.shape and np.array_equal(index, every)
        layers = pick_layers_jit(tuple(on_dev), None if whole else index)
        return [DeviceStaging(tuple(per_layer)) for per_layer in layers]

    def _staging_kind(self, like):
        return "pinned", device_of(like)


def _device(arrays) -> jax.Device:
    """The one device of a view's (single-device) buffers."""
    return device_of(arrays[0][0])


class ForeignHostPath(TransferPath):
    """A foreign pool with buffers jaxkv moves outside XLA (its other parts, jax arrays, go
    through the device gather and scatter); host staging only."""

    name = "foreign"


def choose_path(view: PoolView, transfer: str | None = None) -> TransferPath:
    """The path for `view`'s pool (or one shard of it: every shard of a pool is placed alike):
    the caller's `transfer` (one of `TRANSFERS`) when given and possible, else the fastest the
    placement allows.

    Raises:
        ValueError: a `transfer` that is not one of `TRANSFERS`, or that the pool's
            placement cannot take (say "cpu" for a pool on an accelerator).
    """
    if transfer is not None and transfer not in TRANSFERS:
        raise ValueError(f"transfer: expected None or one of {TRANSFERS}, got {transfer!r}")
    if any(view.host_layers(p) is not None for p in view.layout.parts):
        if transfer is not None:
            raise ValueError(
                f"transfer: expected None for a pool whose buffers live outside XLA (host "
                f"arrays, torch tensors), got {transfer!r}"
            )
        return ForeignHostPath()
    arrays = view.arrays()
    device = pinned_device(arrays[0][0], on_cpu=transfer == "pinned")
    if device is not None and any(pinned_device(bufs[0], on_cpu=True) != device for bufs in arrays):
        device = None
    if transfer == "pinned" or (transfer is None and device is not None):
        if device is None:
            raise ValueError(
                "transfer: 'pinned' needs every buffer on one device with pinned host memory, "
                f"got buffers on {arrays[0][0].sharding}"
            )
        return PinnedPath()
    cpu = _cpu_layers(view) is not None
    if transfer == "cpu" and not cpu:
        raise ValueError(
            "transfer: 'cpu' needs a jaxkv pool on one CPU device whose buffers hold raw bits, "
            f"got buffers on {arrays[0][0].sharding}"
        )
    if cpu and transfer != "gather":
        return CpuCopyPath()
    return GatherPath()


# ---- block copies ------------------------------------------------------------------------------


def gather_blocks(view: PoolView, slots: np.ndarray, block_size: int) -> dict[str, np.ndarray]:
    """Block-major staging arrays `(n_blocks, layer_num, block_size, *row)`, one per part.

    Device buffers are gathered on the device in one jitted call over every layer and part
    and handed over through DLPack (only the staging array crosses to the host, so no live
    export of a pool buffer outlives the call: one would turn the next donated update into a
    full copy); foreign buffers already in host memory are gathered with numpy.
    """
    host = {p.key: view.host_layers(p) for p in view.layout.parts}
    device_parts = tuple(p for p in view.layout.parts if host[p.key] is None)
    out = {}
    if device_parts:
        codecs = tuple(p.codec for p in device_parts)
        n = len(slots) // block_size
        padded = read_slots(slots, block_size)  # compiled once per `bucket` of blocks
        starts = block_starts(padded, block_size)
        arrays = view.arrays(device_parts)
        staged = gather_jit(arrays, padded.astype(np.int32), starts, codecs, block_size)
        jax.block_until_ready(staged)  # the snapshot is complete when this returns
        out.update({p.key: to_host(x)[:n] for p, x in zip(device_parts, staged)})
    for p in view.layout.parts:
        layers = host[p.key]
        if layers is not None:
            out[p.key] = _foreign.read_blocks(
                layers, p.codec, slots, block_size, p.row_shape, p.bits_dtype
            )
    return {p.key: out[p.key] for p in view.layout.parts}


def _row_bytes(part) -> int:
    return int(np.prod(part.row_shape)) * part.bits_dtype.itemsize


def _cpu_layers(view: PoolView) -> tuple[tuple[jax.Array, ...], ...] | None:
    """The layer buffers of every part when each is a jax array on one CPU device holding its
    part's bits, every codec token-major: the blocks can then be copied with numpy from
    zero-copy views. None otherwise."""
    for part in view.layout.parts:
        if view.host_layers(part) is not None or not part.codec.token_major:
            return None
        if part.codec.token_axes != 1:  # paged rows: slot s is not row s of the first axis
            return None
    arrays = view.arrays()
    for part, bufs in zip(view.layout.parts, arrays):
        for b in bufs:
            devices = b.sharding.device_set
            if len(devices) != 1 or device_of(b).platform != "cpu":
                return None
            if b.dtype != part.bits_dtype:
                return None
    return arrays


def _copy_blocks(layers: Sequence[jax.Array], starts: np.ndarray, block_size: int, out: np.ndarray):
    """`out[b, l] = layers[l][starts[b] : starts[b] + block_size]` through numpy views of the
    layer buffers (every start in range: the connector checked the slots). Blocks that follow
    each other in the buffer move as one copy per layer. The caller has waited for the
    layers to be ready."""
    # Runs of consecutive blocks: [first, last) block indices whose rows are one slice.
    breaks = np.flatnonzero(np.diff(starts) != block_size) + 1
    bounds = np.concatenate([[0], breaks, [len(starts)]]).tolist()
    runs = [(a, b, int(starts[a])) for a, b in zip(bounds[:-1], bounds[1:])]
    for li, buf in enumerate(layers):
        # A temporary view: no reference to the pool's memory outlives this call (a live
        # export would turn the pool's next donated update into a copy).
        src = dlpack_view(buf)
        for a, b, row in runs:
            rows = src[row : row + (b - a) * block_size]
            out[a:b, li] = rows.reshape(b - a, block_size, *src.shape[1:])


class _Blocks:
    """Arrays of one shape at arbitrary addresses, assigned to as `out[a:b, layer]` (what
    `_copy_blocks` writes) one block at a time."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays

    def __setitem__(self, index, value):
        blocks, layer = index
        for a, v in zip(self.arrays[blocks], value):
            a[layer] = v


def as_one_array(arrays: list[np.ndarray]):
    """`arrays` (same shape and dtype, each C-contiguous) as one array `(len(arrays), *shape)`
    when they lie at evenly spaced addresses (consecutive slots of a store's arena, the usual
    case): a run of blocks is then copied per layer in one numpy call. Otherwise a stand-in
    that assigns block by block (reading it is not supported)."""
    first = arrays[0]
    if not all(a.flags.c_contiguous and a.shape == first.shape for a in arrays) or any(
        a.dtype != first.dtype for a in arrays
    ):
        return _Blocks(arrays)
    addresses = np.array([address(a) for a in arrays], np.int64)
    step = int(addresses[1] - addresses[0]) if len(arrays) > 1 else first.nbytes
    if step >= first.nbytes and np.all(np.diff(addresses) == step):
        return np.lib.stride_tricks.as_strided(
            first, (len(arrays), *first.shape), (step, *first.strides), writeable=True
        )
    return _Blocks(arrays)


def per_block(staged: dict[str, np.ndarray], n_blocks: int) -> list[dict[str, np.ndarray]]:
    """Block-major staging `(n_blocks, ...)` per part as each block's parts."""
    return [{key: arr[j] for key, arr in staged.items()} for j in range(n_blocks)]
