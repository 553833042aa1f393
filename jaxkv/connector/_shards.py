"""Shard-local transfers for pools whose buffers span several devices.

A pool placed over a mesh is moved shard by shard, never gathered: each distinct shard this
process can address (one per head range for a head-sharded pool, the whole buffer for a
replicated one) is treated as a pool of its own. Its blocks are keyed under a layout that names
the shard's coordinates (`BufferSpec`s with the shard's row shape, `shard` saying which heads), so a
store made at one tensor-parallel degree never serves another: a TP-8 shard holds heads 0:1 of 8,
a TP-4 shard asks for heads 0:2 of 8, and the keys differ. A shard that holds every head (a
replicated buffer, or a mesh axis of one device) keeps the unsharded layout, so its blocks are
shared with one-device pools of the same model.

Each shard is stored once, by the device holding its replica 0 (in a multi-process run exactly
one process holds it); a load writes every replica this process addresses. Everything here runs
on single-device arrays (`addressable_shards`) and rebuilds the global buffers with
`jax.make_array_from_single_device_arrays`, so no process waits for another: callers that must
load the same prefix on every process agree on its length first (`min_block_count`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from jaxkv.connector._pool_views import PoolView, write_arrays
from jaxkv.connector.layout import BufferSpec, Layout
from jaxkv.connector.transfer import has_explicit_axes, shard_span


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    """One distinct shard of a pool and the devices of this process that hold it.

    Attributes:
        label: the shard's coordinates ("" when it holds whole rows).
        layout: the pool's layout with this shard's row shapes and `shard` naming `label`.
        fingerprint: `layout.fingerprint(block_size)`, the root of this shard's block keys.
        devices: the addressable devices holding a replica of it.
        stores: whether this process holds its replica 0 (and so stores it).
    """

    label: str
    layout: Layout
    fingerprint: str
    devices: tuple[jax.Device, ...]
    stores: bool


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The shards a connector moves for a pool placed with `sharding`."""

    sharding: jax.sharding.Sharding
    groups: tuple[ShardGroup, ...]
    fully_addressable: bool


def placement(view: PoolView) -> jax.sharding.Sharding | None:
    """The sharding of a pool moved shard by shard, else None: a pool whose jax buffers span
    several devices, or sit on a mesh with explicit axes (where a gather or scatter of the
    global array must name its output sharding; its shards, single-device arrays, need not).

    A jaxkv pool has one sharding for all its buffers; another framework's pool is moved by
    shards when its first buffer is, and every buffer's placement is checked by `plan`.
    """
    first = view.buffers(view.layout.parts[0])[0]
    if not isinstance(first, jax.Array):
        return None
    sharding = first.sharding
    if len(sharding.device_set) == 1 and not has_explicit_axes(sharding):
        return None
    return sharding


def _split_label(part: BufferSpec, span, shape) -> str:
    """The split axes of one part's shard, e.g. "k.1=0:2/8" (heads 0 to 2 of 8)."""
    return ",".join(
        f"{part.key}.{axis}={lo}:{hi}/{dim}"
        for axis, ((lo, hi), dim) in enumerate(zip(span, shape))
        if (lo, hi) != (0, dim)
    )


def plan(view: PoolView, layout: Layout, block_size: int) -> ShardPlan | None:
    """The shards of `view`'s pool this process moves, or None for a pool on one device."""
    sharding = placement(view)
    if sharding is None:
        return None
    per_device: dict[jax.Device, list] = {}
    for p in layout.parts:
        bufs = view.arrays((p,))[0]
        buf = bufs[0]
        if not all(isinstance(b, jax.Array) and b.sharding == buf.sharding for b in bufs):
            raise ValueError(
                f"pool: expected every {p.attr or 'pool'} buffer placed like the first one "
                f"({buf.sharding}), got another placement"
            )
        for shard in buf.addressable_shards:
            span = shard_span(shard.index, buf.shape)
            per_device.setdefault(shard.device, []).append((p, span, buf.shape, shard.replica_id))
    groups: dict[str, list] = {}
    for device, parts in per_device.items():
        labels, new_parts = [], []
        for p, span, shape, _ in parts:
            label = _split_label(p, span, shape)
            token = p.codec.token_axes  # the leading axes holding token rows
            whole = all(span[a] == (0, shape[a]) for a in range(token))
            if label and (not whole or not p.codec.token_major):
                raise ValueError(
                    f"pool: expected {p.attr or 'pool'} split along its row axes only, got a "
                    f"shard covering {span} of {shape}"
                )
            rows = tuple(hi - lo for lo, hi in span[token:])
            new_parts.append(dataclasses.replace(p, row_shape=rows) if label else p)
            labels.append(label)
        key = ",".join(x for x in labels if x)
        entry = groups.setdefault(key, [tuple(new_parts), [], False])
        entry[1].append(device)
        entry[2] = entry[2] or parts[0][3] == 0
    out = []
    for label, (parts, devices, stores) in sorted(groups.items()):
        shard = layout.shard
        if label:
            shard = label if shard == "full" else f"{shard}|{label}"
        sub = dataclasses.replace(layout, parts=parts, shard=shard)
        out.append(
            ShardGroup(label, sub, sub.fingerprint(block_size), tuple(devices), bool(stores))
        )
    return ShardPlan(sharding, tuple(out), sharding.is_fully_addressable)


class ShardView(PoolView):
    """One device's shard of a pool's buffers, moved like a one-device pool's: `write` returns
    the new per-part, per-layer arrays instead of a pool (see `rebuild`)."""

    def __init__(self, pool, layout: Layout, arrays: tuple[tuple[jax.Array, ...], ...]):
        super().__init__(pool, layout)
        self._arrays = arrays
        self._index = {p.key: i for i, p in enumerate(layout.parts)}

    def host_layers(self, part):
        return None

    def arrays(self, parts=None):
        if parts is None:
            return self._arrays
        return tuple(self._arrays[self._index[p.key]] for p in parts)

    def write(self, slots, staging, block_size, windows=True):
        return write_arrays(self._arrays, self.layout.parts, slots, staging, block_size, windows)


def _local(shard) -> jax.Array:
    """A shard as a plain single-device array sharing its memory: a buffer on a one-device
    mesh is its own shard, still typed with the mesh's axes, which an explicit mesh's gathers
    and scatters would then ask output shardings for."""
    data = shard.data
    single = jax.sharding.SingleDeviceSharding(shard.device, memory_kind=data.sharding.memory_kind)
    if data.sharding == single:
        return data
    return jax.make_array_from_single_device_arrays(data.shape, single, [data])


def _auto_typed(x: jax.Array) -> jax.Array:
    """`x` on a copy of its mesh whose axes are all Auto, sharing its memory: gathers of the
    global array then leave their output sharding to the compiler, as on any jaxkv mesh."""
    sharding = x.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding) or not has_explicit_axes(sharding):
        return x
    mesh = sharding.mesh
    axes = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=axes)
    retyped = jax.sharding.NamedSharding(auto, sharding.spec, memory_kind=sharding.memory_kind)
    shards = [s.data for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, retyped, shards)


class GlobalView(PoolView):
    """A pool's global buffers for reading whole rows (`export_blocks`), on meshes with Auto
    axes (see `_auto_typed`)."""

    def __init__(self, view: PoolView):
        super().__init__(view.pool, view.layout)
        self._view = view

    def host_layers(self, part):
        return self._view.host_layers(part)

    def arrays(self, parts=None):
        return tuple(tuple(_auto_typed(b) for b in bufs) for bufs in self._view.arrays(parts))


def shard_views(plan_: ShardPlan, view: PoolView) -> list[tuple[ShardGroup, list[ShardView]]]:
    """Per shard group, a view of each of its replicas on this process's devices."""
    n_parts = len(view.layout.parts)
    by_device: dict[jax.Device, list[list[jax.Array]]] = {}
    for pi, layers in enumerate(view.arrays()):
        for buf in layers:
            for shard in buf.addressable_shards:
                per_part = by_device.setdefault(shard.device, [[] for _ in range(n_parts)])
                per_part[pi].append(_local(shard))
    return [
        (
            g,
            [
                ShardView(view.pool, g.layout, tuple(tuple(a) for a in by_device[d]))
                for d in g.devices
            ],
        )
        for g in plan_.groups
    ]


def placements(view: PoolView) -> list[list[tuple]]:
    """Per part, per layer: the buffer's shape, sharding and addressable devices in shard
    order; taken before a load donates the shards (`rebuild` needs them after)."""
    return [
        [(buf.shape, buf.sharding, [s.device for s in buf.addressable_shards]) for buf in layers]
        for layers in view.arrays()
    ]


def rebuild(view: PoolView, placed: list[list[tuple]], written: dict[jax.Device, tuple]):
    """The pool of `view` with each device's shard replaced by `written[device]` (per part,
    per layer single-device arrays), as global arrays placed as `placed` says."""
    changes = {}
    for pi, (p, layers) in enumerate(zip(view.layout.parts, placed)):
        changes[p.attr] = [
            jax.make_array_from_single_device_arrays(
                shape, sharding, [written[d][pi][li] for d in devices]
            )
            for li, (shape, sharding, devices) in enumerate(layers)
        ]
    return view.replace_buffers(changes)  # a jaxkv pool is consumed: its shards were donated


def check_placement(plan_: ShardPlan | None, view: PoolView) -> None:
    """`ValueError` when `view`'s pool is placed differently from the pool a connector was
    made for (its shards would be keyed and moved for another placement)."""
    got = placement(view)
    want = None if plan_ is None else plan_.sharding
    if want is None or got is None:
        same = got is want
    else:
        same = got.is_equivalent_to(want, len(view.buffers(view.layout.parts[0])[0].shape))
    if not same:
        raise ValueError(
            f"pool: expected buffers placed as the pool this connector was made for "
            f"({want or 'one device'}), got {got or 'one device'}"
        )


def load(plan_: ShardPlan, view: PoolView, fetch, slots, bs: int, path, count):
    """`KVConnector.load` of a sharded pool: the blocks every shard of this process holds
    (`fetch(group)` -> its verified records and the blocks asked for), as many as every
    shard has, written into each replica's shard on its own device by `path`, then the
    global buffers rebuilt; `count(name, n)` counts them. Returns `(pool, tokens loaded)`."""
    groups = shard_views(plan_, view)
    fetched = [fetch(group) for group, _ in groups]
    n_blocks = min(len(records) for records, _ in fetched)
    count("hits", n_blocks)
    count("misses", fetched[0][1] - n_blocks)
    if not n_blocks:
        return view.pool, 0
    rows = slots[: n_blocks * bs]
    view.check_replaceable()  # before any shard is donated: a refusal changes nothing
    placed = placements(view)
    written = {}
    for (group, replicas), (records, _) in zip(groups, fetched):
        for replica, device in zip(replicas, group.devices):
            written[device] = path.write_staged(replica, records[:n_blocks], rows, bs)
        count("bytes_loaded", n_blocks * group.layout.block_nbytes(bs))
        count("records_loaded", n_blocks)
    count("blocks_loaded", n_blocks)
    return rebuild(view, placed, written), n_blocks * bs


def min_block_count(per_rank_counts: Sequence[int]) -> int:
    """The block count every rank can hold: the minimum of the ranks' counts.

    Tensor-parallel ranks must agree on one block count for a shared store (SGLang's FlexKV
    MIN-aligns them); pass each rank's count, for instance gathered with an all-reduce.

    Args:
        per_rank_counts: each rank's block count (ints >= 0).

    Returns:
        The smallest count.

    Raises:
        ValueError: an empty sequence or a negative count.
    """
    counts = [int(c) for c in per_rank_counts]
    if not counts or min(counts) < 0:
        raise ValueError(f"per_rank_counts: expected non-negative counts, got {per_rank_counts!r}")
    return min(counts)
