"""Moving whole blocks between a pool and host memory, and the staging policy behind it.

Exports gather on the device in one jitted call over every layer and part; only the
block-major staging array crosses to the host, so the live pool buffers are never referenced by
an export (a live export would turn the next donated update into a full copy). Which staging a
transfer uses (zero-copy DLPack export, per-layer host stacking for large CPU snapshots, pinned
host segments on accelerators) is decided here.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxkv.connector import _foreign
from jaxkv.connector._block_kernels import (
    block_starts,
    gather_jit,
    gather_layers_jit,
    pick_layers_jit,
)
from jaxkv.connector._pool_views import PoolView
from jaxkv.connector._records import Segment, address
from jaxkv.connector._staging import (
    StagingCache,
    StagingSlot,
    host_view,
    pinned_device,
    to_host,
)


def gather_blocks(view: PoolView, slots: np.ndarray, block_size: int) -> dict[str, np.ndarray]:
    """Block-major staging arrays `(n_blocks, layer_num, block_size, *row)`, one per part.

    Device buffers are gathered on the device and handed over through DLPack; foreign buffers
    already in host memory are gathered with numpy.
    """
    host = {p.key: view.host_layers(p) for p in view.layout.parts}
    device_parts = tuple(p for p in view.layout.parts if host[p.key] is None)
    out = {}
    if device_parts:
        codecs = tuple(p.codec for p in device_parts)
        starts = block_starts(slots, block_size)
        arrays = view.arrays(device_parts)
        staged = gather_jit(arrays, slots.astype(np.int32), starts, codecs, block_size)
        jax.block_until_ready(staged)  # the snapshot is complete when this returns
        out.update({p.key: to_host(x) for p, x in zip(device_parts, staged)})
    for p in view.layout.parts:
        if host[p.key] is not None:
            out[p.key] = _foreign.read_blocks(
                host[p.key], p.codec, slots, block_size, p.row_shape, p.bits_dtype
            )
    return {p.key: out[p.key] for p in view.layout.parts}


# glibc serves allocations above this size with fresh mmaps (its dynamic mmap threshold stops
# growing at 32 MiB on 64-bit), so an XLA:CPU output that large faults in every page each call.
_FRESH_MMAP_BYTES = 32 << 20


def _cpu_layers(view: PoolView) -> list[list[jax.Array]] | None:
    """The layer buffers of every part when each is a jax array on one CPU device holding its
    part's bits, every codec token-major: the blocks can then be copied with numpy from
    zero-copy views. None otherwise."""
    for part in view.layout.parts:
        if view.host_layers(part) is not None or not part.codec.token_major:
            return None
    arrays = view.arrays()
    for part, bufs in zip(view.layout.parts, arrays):
        for b in bufs:
            devices = b.sharding.device_set
            if len(devices) != 1 or next(iter(devices)).platform != "cpu":
                return None
            if b.dtype != part.bits_dtype or pinned_device(b) is not None:
                return None
    return arrays


def _copy_blocks(layers: list[jax.Array], starts: np.ndarray, block_size: int, out: np.ndarray):
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
        src = np.from_dlpack(buf)
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


def stage_blocks(
    view: PoolView, slots: np.ndarray, block_size: int, cache: StagingCache, store=None
) -> tuple[list[dict[str, np.ndarray]], list]:
    """Host copies of the blocks at `slots` for the store path: per block, its parts
    `(layer_num, block_size, *row)`; also what to give back once the records were written
    (`cache` buffers, or a store's reservation: see the connector's `_give_back`).

    Blocks of a jaxkv pool on CPU whose slots are contiguous runs are copied with numpy from
    zero-copy views of the layer buffers, one copy per run of adjacent blocks per layer: into
    memory `store` lends for the records when it does (`HostStore._reserve`: its `put` then
    keeps them without a copy), else into reused (already touched) staging. The device gather
    wrote into fresh XLA output memory, whose first-touch page faults made it 1.5-3.5 memcpys
    of the same bytes (32 MiB: 6.4-15.9 ms against 4.3 ms).
    Otherwise, up to 32 MiB per part this is `gather_blocks` (one device-side stacked array,
    handed over zero-copy). Larger snapshots on CPU gather each layer into its own device
    array and stack them on the host into reused memory: the stacked 64 MiB output of 32
    layers took 35 ms (every page a fresh fault) against 8 + 9 ms this way.
    """
    n_blocks = len(slots) // block_size
    starts = block_starts(slots, block_size)
    layers = _cpu_layers(view) if starts is not None else None
    if layers is not None:
        jax.block_until_ready(layers)
        parts = view.layout.parts
        shapes = {p.key: ((len(layers[0]), block_size, *p.row_shape), p.bits_dtype) for p in parts}
        reserve = getattr(store, "_reserve", None)
        lent = reserve(shapes, n_blocks) if reserve is not None else None
        if lent is not None:
            blocks, reservation = lent
            dests = {k: as_one_array([b[k] for b in blocks]) for k in shapes}
            give_back = [reservation]
        else:
            dests = {
                k: cache.take((n_blocks, *shape), dtype) for k, (shape, dtype) in shapes.items()
            }
            blocks = per_block(dests, n_blocks)
            give_back = list(dests.values())
        for part, bufs in zip(parts, layers):
            _copy_blocks(bufs, starts, block_size, dests[part.key])
        return blocks, give_back
    largest = max(
        n_blocks
        * view.layout.layer_num
        * block_size
        * int(np.prod(p.row_shape))
        * p.bits_dtype.itemsize
        for p in view.layout.parts
    )
    if largest <= _FRESH_MMAP_BYTES or any(
        view.host_layers(p) is not None for p in view.layout.parts
    ):
        return per_block(gather_blocks(view, slots, block_size), n_blocks), []
    platform = next(iter(view.arrays()[0][0].sharding.device_set)).platform
    if platform != "cpu":
        return per_block(gather_blocks(view, slots, block_size), n_blocks), []
    codecs = tuple(p.codec for p in view.layout.parts)
    per_layer = gather_layers_jit(view.arrays(), slots.astype(np.int32), starts, codecs, block_size)
    jax.block_until_ready(per_layer)
    out = {}
    for part, layers in zip(view.layout.parts, per_layer):
        shape = (n_blocks, len(layers), block_size, *part.row_shape)
        buf = cache.take(shape, part.bits_dtype)
        np.stack([to_host(x) for x in layers], axis=1, out=buf)
        out[part.key] = buf
    return per_block(out, n_blocks), list(out.values())


def per_block(staged: dict[str, np.ndarray], n_blocks: int) -> list[dict[str, np.ndarray]]:
    """Block-major staging `(n_blocks, ...)` per part as each block's parts."""
    return [{key: arr[j] for key, arr in staged.items()} for j in range(n_blocks)]


# ---- accelerator path: segments in pinned host memory -----------------------------------------


def gather_segment(view: PoolView, slots: np.ndarray, block_size: int) -> Segment | None:
    """The blocks at `slots` as a `Segment` in pinned host memory, or None when the pool's
    buffers are not on one device with pinned host memory (use `stage_blocks` then).

    One jitted gather stacks every layer's blocks on the device, and one transfer moves each
    part to pinned host memory: the segment is the transfer's own output, which a store
    keeps without a host copy and a load sends back as it is.
    """
    if any(view.host_layers(p) is not None for p in view.layout.parts):
        return None
    arrays = view.arrays()
    dev = pinned_device(arrays[0][0])
    if dev is None or any(pinned_device(bufs[0]) != dev for bufs in arrays):
        return None
    codecs = tuple(p.codec for p in view.layout.parts)
    starts = block_starts(slots, block_size)
    staged = gather_jit(arrays, slots.astype(np.int32), starts, codecs, block_size)
    pinned = jax.device_put(
        list(staged), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    )
    keys = [p.key for p in view.layout.parts]
    return Segment(dict(zip(keys, pinned)), {k: host_view(x) for k, x in zip(keys, pinned)})


def segment_staging(
    segment: Segment, keys: Sequence[str], index: np.ndarray, like: jax.Array
) -> list[StagingSlot]:
    """Device-side staging (one `StagingSlot` per part in `keys`) of blocks `index` of
    `segment`, for a write into buffers on `like`'s device.

    The segment moves from pinned host memory to device memory as it is (the link's speed,
    no host copy); picking the blocks and splitting them per layer runs on the device.
    """
    dev = next(iter(like.sharding.device_set))
    on_dev = jax.device_put(
        [segment.arrays[k] for k in keys],
        jax.sharding.SingleDeviceSharding(dev, memory_kind="device"),
    )
    index = np.asarray(index, np.int32)
    whole = index.shape[0] == segment.blocks and np.array_equal(index, np.arange(segment.blocks))
    layers = pick_layers_jit(tuple(on_dev), None if whole else index)
    return [StagingSlot((), tuple(per_layer)) for per_layer in layers]
