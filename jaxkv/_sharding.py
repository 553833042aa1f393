"""Where a pool's buffers may be split across devices: one rule per buffer, checked at `create`.

A pool takes one `sharding` for all its buffers; each buffer's declaration says which of its
axes that sharding may split (`ShardRule`). Token rows are never split: a slot is an index into
the whole buffer, and a scatter by slot over a row-split buffer would cross devices on every
write. Heads are independent (attention never mixes them), so MHA and K-only pools may split
their heads axis over a tensor-parallel mesh axis, as SGLang's tensor-parallel ranks hold
`head_num / tp` heads. An MLA or NSA latent row is one vector shared by every head, so every
tensor-parallel rank holds it whole: those buffers are replicated, and NSA's indexer buffer
(keys of the same tokens) follows them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

_TOKEN_AXIS_ADVICE = (
    "slots index whole buffers, so token rows stay on every device that holds the buffer; "
    "shard heads instead (PartitionSpec(None, 'tp', None) for MHA and K-only pools), replicate "
    "latent pools (PartitionSpec()), or give each data-parallel replica its own pool"
)


@dataclasses.dataclass(frozen=True)
class ShardRule:
    """The buffer axis a pool's `sharding` may split (`axis`, whose size is the pool field
    `size_name`), or none (`axis=None`: the buffer is replicated wherever it is placed)."""

    axis: int | None = None
    size_name: str = ""

    def placement(self, sharding, name: str, shape: tuple[int, ...], pool: str):
        """The sharding to allocate buffer `name` of `shape` with, or `ValueError` naming
        `sharding`, the split that was expected and the one that came.

        A `NamedSharding` whose spec is longer than the buffer's rank with only unsplit axes
        past it is trimmed (NSA's 2-d indexer buffer follows a 3-entry replicated spec), and a
        shorter one is padded with unsplit axes (`PartitionSpec()` becomes one `None` per
        axis); any
        other `jax.sharding.Sharding` is checked through the shard shape it gives; devices and
        `None` are placements, not splits, and pass as they are.
        """
        if isinstance(sharding, NamedSharding):
            spec = tuple(sharding.spec)
            if any(e is not None for e in spec[len(shape) :]):
                raise ValueError(
                    f"sharding: expected a PartitionSpec of at most {len(shape)} entries for "
                    f"{pool}.{name} {shape}, got {sharding.spec}"
                )
            mesh = sharding.mesh.shape
            for axis, entry in enumerate(spec[: len(shape)]):
                if entry is not None:
                    names = entry if isinstance(entry, tuple) else (entry,)
                    parts = math.prod(mesh[n] for n in names)
                    self._check_split(axis, parts, name, shape, pool, f"mesh axis {entry!r}")
            if len(spec) != len(shape):
                # One entry per axis, as jax writes the outputs of updates: a pool's buffers
                # then compare equal to their sharding before and after every update.
                full = (*spec[: len(shape)], *(None,) * (len(shape) - len(spec)))
                return NamedSharding(
                    sharding.mesh, PartitionSpec(*full), memory_kind=sharding.memory_kind
                )
            return sharding
        if isinstance(sharding, jax.sharding.Sharding):
            local = sharding.shard_shape(shape)
            for axis, (whole, part) in enumerate(zip(shape, local)):
                if part != whole:
                    self._check_split(axis, -(-whole // part), name, shape, pool, "the sharding")
        elif sharding is not None and not isinstance(sharding, jax.Device):
            raise TypeError(
                f"sharding: expected None, a jax.Device or a jax.sharding.Sharding, got "
                f"{sharding!r:.80}"
            )
        return sharding

    def _check_split(self, axis: int, parts: int, name, shape, pool: str, over: str) -> None:
        if parts == 1:
            return  # a mesh axis of one device splits nothing
        if axis == 0:
            raise ValueError(
                f"sharding: expected the token axis (axis 0) of {pool}.{name} unsplit, got it "
                f"split over {over} ({parts} devices): {_TOKEN_AXIS_ADVICE}"
            )
        if axis != self.axis:
            allowed = (
                "only its heads axis (axis 1) may be split"
                if self.axis is not None
                else "it is replicated across tensor-parallel devices (its rows are shared by "
                "every head): pass a replicated sharding such as NamedSharding(mesh, "
                "PartitionSpec())"
            )
            raise ValueError(
                f"sharding: expected axis {axis} of {pool}.{name} {shape} unsplit, got it split "
                f"over {over} ({parts} devices); {allowed}"
            )
        if shape[axis] % parts:
            raise ValueError(
                f"sharding: expected {self.size_name} divisible by the {parts} devices of "
                f"{over}, got {self.size_name}={shape[axis]}"
            )


REPLICATED = ShardRule()
HEADS = ShardRule(axis=1, size_name="head_num")
