"""How a per-layer buffer family is described, for jaxkv pools and other frameworks' alike.

A pool kind states each of its buffers once, as a dataclass field declared with `buffer()` (as
flax's `struct.field` marks a pytree node):

    k_buffer: Layers = buffer(key="k", rows=lambda p: p.head_rows(p.head_dim), shard=HEADS)

The field's name is the buffer's attribute (SGLang's name for it); the declaration adds the
part key the connector exports it under, how the pool's sizes give its rows (`Rows`), the codec
type that lays its tokens out and the axis a `sharding` may split. Everything else is derived
from that one statement: the pytree's data fields, `buffer_specs()`, what `create` allocates,
the readers' and setters' lookups (by part key), `get_kv_size_bytes` and the connector's
layouts. An object of another framework is matched against the kinds' declared attributes and
described with the same declarations, its rows read from its buffers (`BufferDecl.of_layer`).

`BufferSpec` is what a declaration resolves to for one pool: attribute, part key, per-token row
shape, raw-bit dtype and codec (plus a setter's value shape and the sharding rule). It is the
connector's layout part too, so a jaxkv pool and a foreign object holding the same buffers are
described by equal values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxkv import _dtypes, _kernels
from jaxkv._sharding import REPLICATED, ShardRule

# A buffer field's value: one array per layer.
Layers = tuple[jax.Array, ...]

# The field metadata entry that holds a `BufferDecl`.
_DECL = "jaxkv.buffer"


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """One per-layer buffer family of a pool: per layer, one entry of `row_shape` stored bits
    for each token, placed by `codec`.

    Attributes:
        attr: the attribute holding the per-layer sequence (`k_buffer`: SGLang's names).
        key: the part key the connector's blocks carry it under (`"k"`, `"v"`, `"kv"`,
            `"index_k"`); a pool's setters and readers name their buffers by it.
        row_shape: one token's stored entry.
        bits_dtype: the dtype of the stored bits (a jaxkv pool's `store_dtype`).
        codec: where a slot's entry lives in a layer buffer, and how values become bits; a
            layer buffer has shape `codec.buffer_shape(rows, row_shape)` (`(rows, *row_shape)`
            for token-major rows).
        value_shape: the per-token shape a setter takes when it is not `row_shape` (NSA index
            keys are written as floats and stored as fp8 bytes plus a scale), else None.
        shard: the axis a pool's `sharding` may split.
        layers: the family's own number of buffers when it is not one per layer (DSA's
            indexer keys, one per indexer, in sglang-jax's pools), else None.
    """

    attr: str
    key: str
    row_shape: tuple[int, ...]
    bits_dtype: np.dtype
    codec: _kernels.Codec
    value_shape: tuple[int, ...] | None = None
    shard: ShardRule = REPLICATED
    layers: int | None = None

    @property
    def name(self) -> str:
        """The attribute name (`attr`), as pools' generic code spells it."""
        return self.attr

    @property
    def store_dtype(self) -> np.dtype:
        """The stored dtype (`bits_dtype`), as pools spell it."""
        return self.bits_dtype

    def layer_shape(self, rows: int) -> tuple[int, ...]:
        """The shape of one layer buffer holding `rows` token slots."""
        return self.codec.buffer_shape(rows, self.row_shape)

    def input_shape(self, value) -> tuple[int, ...]:
        """The per-token shape a setter's `value` must have: `value_shape` (else `row_shape`),
        except that raw bits in the store dtype are whole stored rows of a token-major buffer
        (NSA's packed fp8 rows take floats of the latent's shape, or raw packed rows)."""
        raw = (
            not isinstance(value, tuple)
            and self.codec.token_major
            and value.dtype == self.bits_dtype
        )
        return self.row_shape if raw or self.value_shape is None else self.value_shape


class Rows(NamedTuple):
    """What a pool's sizes give one declared buffer: the per-token `row_shape`, the
    `bits_dtype` stored, the `codec`, and `value_shape` when a setter takes another shape."""

    row_shape: tuple[int, ...]
    bits_dtype: np.dtype
    codec: _kernels.Codec
    value_shape: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class BufferDecl:
    """A pool kind's statement of one buffer field (made by `buffer`; `attr` is the field's
    name, filled in when the kind is declared).

    `codec` is the codec type that lays the buffer's tokens out (`RowCodec`: token-major rows;
    `IndexCodec`: NSA's index pages). A pool's `rows` may give a subclass of it (NSA's packed
    fp8 rows are still token-major rows); a foreign buffer is read through it (`of_layer`).
    """

    key: str
    rows: Callable[[Any], Rows]
    codec: type[_kernels.RowCodec | _kernels.IndexCodec] = _kernels.RowCodec
    shard: ShardRule = REPLICATED
    attr: str = ""

    def spec(self, pool) -> BufferSpec:
        """This buffer's description in `pool`, whose sizes give its rows."""
        rows = self.rows(pool)
        if not isinstance(rows.codec, self.codec):
            raise TypeError(
                f"{type(pool).__name__}.{self.attr}: expected rows laid out by "
                f"{self.codec.__name__} as declared, got a {type(rows.codec).__name__}"
            )
        return BufferSpec(
            self.attr,
            self.key,
            tuple(rows.row_shape),
            np.dtype(rows.bits_dtype),
            rows.codec,
            rows.value_shape,
            self.shard,
        )

    def of_layer(self, shape: tuple[int, ...], dtype, rows: int, page_size: int | None):
        """This buffer's description in another framework's pool, from one layer buffer of
        `shape` and `dtype` over `rows` token slots (`page_size`: the pool's, if it says).

        Raises:
            ValueError: the buffer is not laid out as declared (the message says how).
        """
        row_shape, codec = self.codec.of_layer(shape, dtype, rows, page_size)
        bits = _dtypes.bits_dtype(dtype)
        return BufferSpec(self.attr, self.key, row_shape, bits, codec, shard=self.shard)


def buffer(
    *,
    key: str,
    rows: Callable[[Any], Rows],
    codec: type[_kernels.RowCodec | _kernels.IndexCodec] = _kernels.RowCodec,
    shard: ShardRule = REPLICATED,
) -> Any:
    """Declares a per-layer buffer field of a pool kind: a pytree data field (a tuple of
    arrays, one per layer) where every undeclared field is static.

    Args:
        key: the part key (unique within the kind) the connector exports the buffer under and
            the pool's setters and readers name it by.
        rows: the pool -> its `Rows` (per-token shape, stored dtype, codec).
        codec: the codec type laying out the buffer's tokens (see `BufferDecl`).
        shard: the axis a pool's `sharding` may split (default: none, replicated).

    Returns:
        A `dataclasses.field` carrying the declaration.
    """
    return dataclasses.field(metadata={_DECL: BufferDecl(key, rows, codec, shard)})


def declarations(cls) -> tuple[BufferDecl, ...]:
    """The buffers dataclass `cls` declares, in field order, each with its attribute name.

    Raises:
        TypeError: two buffers of `cls` share a part key.
    """
    decls = tuple(
        dataclasses.replace(f.metadata[_DECL], attr=f.name)
        for f in dataclasses.fields(cls)
        if _DECL in f.metadata
    )
    keys = [d.key for d in decls]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise TypeError(
            f"{cls.__name__}: expected a distinct part key per buffer, got {repeated} for "
            f"{[d.attr for d in decls if d.key in repeated]}"
        )
    return decls
