"""Whole pages between sglang-jax's per-layer KV buffers and batches of pages on the devices.

sglang-jax keeps one buffer per layer whose axis 0 is the page: MHA's fused
`(pages, page_size, 2H // packing, packing, head_dim)`, MLA's latent
`(pages, rows, packing, width)`; a DSA pool adds a family of its own count, its indexer keys
`(pages, rows, packing, key width)`, one buffer per indexer. Their `NamedSharding` spreads
pages over the data ranks and (MHA) packed heads over the tensor axis. A `PageMover` moves one
family; a pool's families (`movers_for`) share the page axis, so a page moves with all of
them. A batch of `c` pages is, per layer, `(c, *page)` with
the page axis replicated and the rest of the buffer's spec kept: every device holds whole pages
of its own share of the heads, so the host side reads and fills each device's part without a
collective. Batches carry the pages' bits, as unsigned ints of the dtype's width (bfloat16
as uint16): numpy and DLPack have no bfloat16 or float8, and bits move exactly.

On CPU devices the buffers are host memory, and pages move without XLA: `shard_views` shows
each device's share of a buffer as a numpy array of its bits. XLA:CPU turns a scatter into a
bfloat16 buffer into float32 arithmetic over the whole buffer, and a bitcast of the buffer to
its bits into a copy of it, so a scatter costs the buffer's size and quiets NaN payloads; a
numpy copy costs the pages' size and moves bits. Writes go into buffers first taken over by
`claim`, a donated call that returns the same memory as new arrays (the old ones deleted, as
any donation deletes them), so no other array sees them change.

A compiled transfer of `n` pages runs as chunks of the powers of two that add up to `n`
(13 = 8 + 4 + 1), each one compiled call over all layers at an exact size: nothing is padded on
the way to the host, and the compiled shapes are one per power of two whatever counts the
cache asks for.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.connector.transfer import CompileCache, has_explicit_axes, host_view, shard_span

# A part of a page: the (start, stop) of each page axis that one device holds.
PartKey = tuple[tuple[int, int], ...]
Chunk = tuple[jax.Array, ...]  # per layer, (c, *page) on the batch sharding


class Shard(NamedTuple):
    """One device's share of a buffer: its part of a page (`key`) for pages [start, stop)."""

    device: Any
    key: PartKey
    start: int
    stop: int


def chunk_sizes(n: int) -> list[int]:
    """The powers of two adding up to `n`, largest first (`chunk_sizes(13) == [8, 4, 1]`)."""
    return [1 << bit for bit in reversed(range(n.bit_length())) if n >> bit & 1]


def movers_for(device_pool: Any, attrs: Sequence[str]) -> list[PageMover]:
    """A `PageMover` per buffer family of `device_pool`, named by its attribute (`attrs`,
    the pool's per-layer lists), in order.

    Raises:
        ValueError: a family empty, its buffers unlike each other (shape, dtype, sharding), or
            a page axis unlike the first family's.
        TypeError: buffers not on a `NamedSharding`.
    """
    movers: list[PageMover] = []
    for attr in attrs:
        mover = PageMover(list(getattr(device_pool, attr)), attr)
        if movers and mover.pages != movers[0].pages:
            raise ValueError(
                f"device_pool.{attr}: expected {movers[0].pages} pages (the page axis of "
                f"{attrs[0]}), got {mover.pages}"
            )
        movers.append(mover)
    return movers


class PageMover:
    """Compiled whole-page gathers and scatters over one family of a device pool's per-layer
    buffers (`name`: the pool's attribute holding them).

    Built from the buffers as the pool holds them (all one shape, dtype and sharding); later
    calls take the pool's current buffers, which the forward replaces every step with arrays
    of the same type.

    Attributes:
        name: the device pool's attribute holding the family.
        layers: the number of per-layer buffers.
        pages: the length of the page axis (the usable pages plus the padding pages).
        page_shape: one page of one layer, `buffer.shape[1:]`.
        page_nbytes: one page over all layers, in bytes.
        dtype: the buffers' dtype.
        bits: the unsigned int dtype of its width, the dtype of batches.
        batch_sharding: the sharding of a batch `(c, *page)`: pages replicated, the rest of
            the buffers' spec kept.
        placement: each addressable device and the part of a page it holds in a batch.
        part_shapes: each part's shape (a page's shape, cut to what one device holds).
        shards: each addressable device's share of a buffer (its part, its pages).
    """

    def __init__(self, buffers: Sequence[jax.Array], name: str = "kv_buffer"):
        if not buffers:
            raise ValueError(f"device_pool.{name}: expected per-layer buffers, got none")
        first = buffers[0]
        sharding = first.sharding
        if not isinstance(sharding, NamedSharding):
            raise TypeError(
                f"device_pool.{name}[0]: expected an array on a NamedSharding (sglang-jax's "
                f"pools shard over their mesh), got {type(sharding).__name__}"
            )
        for i, buf in enumerate(buffers[1:], 1):
            if buf.shape != first.shape or buf.dtype != first.dtype:
                raise ValueError(
                    f"device_pool.{name}[{i}]: expected {first.dtype}{list(first.shape)} "
                    f"like {name}[0], got {buf.dtype}{list(buf.shape)}"
                )
            if not buf.sharding.is_equivalent_to(sharding, buf.ndim):
                raise ValueError(
                    f"device_pool.{name}[{i}]: expected the sharding of {name}[0], "
                    f"{sharding}, got {buf.sharding}"
                )
        self.name = name
        self.layers = len(buffers)
        self.pages = int(first.shape[0])
        self.page_shape = tuple(int(d) for d in first.shape[1:])
        self.dtype = first.dtype
        self.bits = np.dtype(f"uint{8 * first.dtype.itemsize}")
        self.page_nbytes = self.layers * math.prod(self.page_shape) * self.bits.itemsize
        self.buffer_sharding = sharding
        spec = tuple(sharding.spec) + (None,) * (first.ndim - len(sharding.spec))
        mesh = sharding.mesh
        self.batch_sharding = NamedSharding(mesh, PartitionSpec(None, *spec[1:]))
        self._index_sharding = NamedSharding(mesh, PartitionSpec())
        # Explicit axes type every array by its sharding: gathers and scatters name theirs.
        # Other meshes take the shardings from the compiled call's signature alone.
        self._explicit = has_explicit_axes(sharding)
        one = (1, *self.page_shape)
        self.placement: dict[Any, PartKey] = {
            dev: shard_span(index, one)[1:]
            for dev, index in self.batch_sharding.addressable_devices_indices_map(one).items()
        }
        self.part_shapes: dict[PartKey, tuple[int, ...]] = {
            key: tuple(stop - start for start, stop in key) for key in self.placement.values()
        }
        # The device each part is read from when a batch lands on the host (replicas agree).
        self._reader: dict[PartKey, Any] = {}
        for dev, key in self.placement.items():
            self._reader.setdefault(key, dev)
        full = (self.pages, *self.page_shape)
        self.shards = [
            Shard(dev, span[1:], *span[0])
            for dev, index in sharding.addressable_devices_indices_map(full).items()
            for span in [shard_span(index, full)]
        ]
        # XLA:CPU scatters a float buffer as float32 (see the module docstring); its bits
        # scatter exactly. Accelerators scatter the buffer's own dtype, without a cast of it.
        scatter_bits = all(dev.platform == "cpu" for dev in self.placement)
        self._signature = _Signature(
            self.layers,
            self.pages,
            self.page_shape,
            np.dtype(self.dtype),
            self.bits,
            sharding,
            self.batch_sharding,
            self._index_sharding,
            self._explicit,
            scatter_bits,
        )

    # ---- transfers ---------------------------------------------------------------------------

    def gather(self, buffers: Sequence[jax.Array], pages: np.ndarray) -> list[Chunk]:
        """The pages at `pages` (global page ids, in range) as chunks, in order."""
        chunks, start = [], 0
        for size in chunk_sizes(len(pages)):
            index = self._index(pages[start : start + size])
            chunks.append(self._executable("gather", size)(tuple(buffers), index))
            start += size
        return chunks

    def scatter(
        self, buffers: Sequence[jax.Array], chunk: Chunk, rows: np.ndarray, pages: np.ndarray
    ) -> tuple[jax.Array, ...]:
        """New buffers with rows `rows` of `chunk` written to the distinct pages `pages`.

        The buffers are donated: the caller replaces them with the result. The call is
        compiled at the chunk's size; the entries past `len(rows)` point past the page axis,
        at distinct pages, and are dropped.
        """
        size = int(chunk[0].shape[0])
        src = np.zeros(size, np.int32)
        src[: len(rows)] = rows
        dst = np.arange(self.pages, self.pages + size, dtype=np.int32)
        dst[: len(pages)] = pages
        return self._executable("scatter", size)(
            tuple(buffers), tuple(chunk), self._index(src), self._index(dst)
        )

    def claim(self, buffers: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """The buffers' memory as new arrays, once every computation using them is done: the
        buffers are donated and deleted, so the arrays returned are the only ones on it."""
        return jax.block_until_ready(self._executable("claim", 0)(tuple(buffers)))

    def shard_views(self, buffer: jax.Array, *, writable: bool = False) -> dict[Any, np.ndarray]:
        """Each addressable device's share of `buffer` (on CPU devices) as a numpy array of its
        bits, `(stop - start, *part)` (`shards` says which). `writable` only for arrays from
        `claim`: nothing else may see them change."""
        return {
            s.device: host_view(s.data, writable=writable, dtype=self.bits)
            for s in buffer.addressable_shards
        }

    def parts(self, chunk: Chunk) -> dict[PartKey, tuple[jax.Array, ...]]:
        """Each part of `chunk`, per layer, as the single-device array one device holds."""
        by_device = [{s.device: s.data for s in layer.addressable_shards} for layer in chunk]
        return {key: tuple(layer[dev] for layer in by_device) for key, dev in self._reader.items()}

    def assemble(self, per_device: Mapping[Any, Sequence[jax.Array]], size: int) -> Chunk:
        """A chunk of `size` pages from each device's per-layer arrays of its part."""
        shape = (size, *self.page_shape)
        return tuple(
            jax.make_array_from_single_device_arrays(
                shape, self.batch_sharding, [arrays[layer] for arrays in per_device.values()]
            )
            for layer in range(self.layers)
        )

    def precompile(self, max_pages: int) -> list[int]:
        """Compiles the gather and scatter of every chunk size a transfer of up to `max_pages`
        pages uses; returns those sizes."""
        sizes = [1 << bit for bit in range(max_pages.bit_length())]
        for size in sizes:
            self._executable("gather", size)
            self._executable("scatter", size)
        return sizes

    def precompile_claim(self) -> None:
        """Compiles `claim`."""
        self._executable("claim", 0)

    # ---- compiled calls ----------------------------------------------------------------------

    def _index(self, values: np.ndarray) -> jax.Array:
        return jax.device_put(np.asarray(values, np.int32), self._index_sharding)

    def _executable(self, kind: str, size: int):
        return _executable(self._signature, kind, size)


@dataclasses.dataclass(frozen=True)
class _Signature:
    """What the compiled calls depend on: pools of one signature share them (every pool of
    a server, and the many small ones of a test run)."""

    layers: int
    pages: int
    page_shape: tuple[int, ...]
    dtype: np.dtype
    bits: np.dtype
    buffer_sharding: NamedSharding
    batch_sharding: NamedSharding
    index_sharding: NamedSharding
    explicit: bool
    scatter_bits: bool


# Shared by every pool of a process (the D2H and H2D threads may ask for the same call), the
# most recently used kept: a server's pools share one signature, a test run meets many.
_COMPILED = CompileCache(max_entries=256)


def _executable(sig: _Signature, kind: str, size: int):
    return _COMPILED.get((sig, kind, size), lambda: _compile(sig, kind, size))


def _compile(sig: _Signature, kind: str, size: int):
    def spec(shape, dtype, sharding):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    buffers = tuple(
        spec((sig.pages, *sig.page_shape), sig.dtype, sig.buffer_sharding)
        for _ in range(sig.layers)
    )
    if kind == "claim":
        # Each output is its donated input: XLA aliases them, so the call copies nothing.
        claim = jax.jit(
            lambda bufs: bufs, donate_argnums=0, out_shardings=(sig.buffer_sharding,) * sig.layers
        )
        return claim.lower(buffers).compile()
    index = spec((size,), np.int32, sig.index_sharding)
    if kind == "gather":
        gather = jax.jit(
            functools.partial(_gather_pages, sig), out_shardings=(sig.batch_sharding,) * sig.layers
        )
        return gather.lower(buffers, index).compile()
    chunk = tuple(
        spec((size, *sig.page_shape), sig.bits, sig.batch_sharding) for _ in range(sig.layers)
    )
    scatter = jax.jit(
        functools.partial(_scatter_pages, sig),
        donate_argnums=0,
        out_shardings=(sig.buffer_sharding,) * sig.layers,
    )
    return scatter.lower(buffers, chunk, index, index).compile()


def _take(sig: _Signature, x, index):
    if sig.explicit:
        return x.at[index].get(out_sharding=sig.batch_sharding)
    return x[index]


def _gather_pages(sig: _Signature, buffers, index):
    return tuple(jax.lax.bitcast_convert_type(_take(sig, buf, index), sig.bits) for buf in buffers)


def _scatter_pages(sig: _Signature, buffers, chunk, src, dst):
    out = []
    for buf, layer in zip(buffers, chunk):
        rows = _take(sig, layer, src)
        if sig.scatter_bits:
            buf = jax.lax.bitcast_convert_type(buf, sig.bits)
        else:
            rows = jax.lax.bitcast_convert_type(rows, sig.dtype)
        # `dst` holds distinct pages (the pool checks the caller's; the padding is distinct and
        # out of range), so the scatter declares unique indices.
        update = buf.at[dst]
        if sig.explicit:
            new = update.set(
                rows, mode="drop", unique_indices=True, out_sharding=sig.buffer_sharding
            )
        else:
            new = update.set(rows, mode="drop", unique_indices=True)
        out.append(jax.lax.bitcast_convert_type(new, sig.dtype) if sig.scatter_bits else new)
    return tuple(out)
