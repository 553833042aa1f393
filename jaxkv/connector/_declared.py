"""Declared layouts: what a pool's buffers are, said by whoever knows, never guessed.

A `PoolLayout` describes the per-layer buffer families of a pool jaxkv does not know by its
attribute names: which leading axes of each buffer flatten into token rows, how many rows a page
holds, and the part key its blocks carry it under. A user declares one for any pool
(`KVConnector(pool, store, layout=...)`); jaxkv declares one itself for the pool classes it
recognises (sglang-jax's `MHATokenToKVPool` and `MLATokenToKVPool`, from their own attributes).
Either way `resolve` checks every buffer against the declaration and gives the same `Layout`
(and `BufferSpec` parts) that jaxkv pools and SGLang-shaped objects are described by: one
description, whoever made the pool.

sglang-jax's buffers (see docs/sglang_jax.md):

* MHA: `kv_buffer[l]` `(pages, page_size, 2 * heads // packing, packing, head_dim)`, K and V
  interleaved per head; the first two axes are token rows (slot = page * page_size + offset).
* MLA: `kv_buffer[l]` `(pages, align(page_size, packing) // packing, packing, width)`, tokens
  packed `packing` to a row; the first three axes are token rows, `align(page_size, packing)`
  of them a page. DSA pools add `indexer_key_buffer`, one buffer per indexer (not per layer),
  in the same paged layout.

Blocks carry whole stored rows, padding included (the zero columns past a model's head_dim,
each MLA segment's padding to 128), so a round trip restores every bit of a token's row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import cast

from jaxkv import _dtypes
from jaxkv._checks import is_int
from jaxkv._kernels import PagedRowCodec, RowCodec
from jaxkv.connector import _foreign
from jaxkv.connector._layout import Layout, Part, check_family, layers_of, logical_dtype
from jaxkv.errors import UnsupportedKVCacheError


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """One per-layer buffer family of a declared `PoolLayout`.

    Attributes:
        attr: the pool's attribute holding the per-layer sequence of buffers, or `""` when the
            object handed to the connector is that sequence itself (a plain list of arrays).
        key: the part key blocks carry the family under (`"kv"`, `"k"`, ...; distinct per
            layout).
        token_axes: how many leading axes of a layer buffer flatten into token rows: 1 for
            `(rows, *row)` buffers; 2 or more for paged buffers `(pages, *lead, *row)`, whose
            first axis is the page.
        page_rows: the token rows a page holds in the buffer (the product of the lead axes),
            when it is more than the page size: the rows past the page size pad each page
            (tokens packed several to a row). Leave None when a page holds exactly its
            tokens; a buffer whose pages hold more rows than declared is refused.
        own_layers: the family has its own number of buffers instead of one per layer (DSA's
            indexer keys: one per indexer). The first family of a layout counts the layers.
    """

    attr: str
    key: str = "kv"
    token_axes: int = 1
    page_rows: int | None = None
    own_layers: bool = False

    def __post_init__(self):
        if not isinstance(self.attr, str):
            raise TypeError(f"attr: expected a str ('' for the pool itself), got {self.attr!r}")
        if not isinstance(self.key, str) or not self.key:
            raise TypeError(f"key: expected a non-empty str, got {self.key!r}")
        if not is_int(self.token_axes) or self.token_axes < 1:
            raise ValueError(f"token_axes: expected an int >= 1, got {self.token_axes!r}")
        if self.page_rows is not None and (not is_int(self.page_rows) or self.page_rows < 1):
            raise ValueError(f"page_rows: expected None or an int >= 1, got {self.page_rows!r}")


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """The declared layout of a pool: its buffer families and what keys its blocks.

    Attributes:
        kind: the layout's name, part of every block key (pools of different kinds never
            share blocks), e.g. `"tpu-inference-fused"`.
        page_size: tokens per page; slot `s` is token `s % page_size` of page
            `s // page_size`.
        buffers: the families, the first one counting the layers.
        dtype: the logical dtype blocks are keyed by (default: the pool's `dtype` attribute,
            else its buffers' dtype).
        start_layer: the first model layer the pool holds.

    Example, a plain list of fused per-layer arrays `(blocks, block_size, 2 * heads //
    packing, packing, head_dim)` (tpu-inference's caches):

        layout = PoolLayout(
            kind="tpu-inference-fused",
            page_size=block_size,
            buffers=(BufferLayout(attr="", key="kv", token_axes=2),),
        )
        conn = KVConnector(kv_caches, store, layout=layout)
    """

    kind: str
    page_size: int
    buffers: tuple[BufferLayout, ...]
    dtype: str | None = None
    start_layer: int = 0
    # A jaxkv-made description's named sizes (messages only, as a jaxkv pool's `sizes`).
    sizes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        if not isinstance(self.kind, str) or not self.kind:
            raise TypeError(f"kind: expected a non-empty str, got {self.kind!r}")
        if not is_int(self.page_size) or self.page_size < 1:
            raise ValueError(f"page_size: expected an int >= 1, got {self.page_size!r}")
        buffers = tuple(self.buffers) if isinstance(self.buffers, Sequence) else None
        if not buffers or not all(isinstance(b, BufferLayout) for b in buffers):
            raise TypeError(
                f"buffers: expected a non-empty sequence of BufferLayout, got {self.buffers!r}"
            )
        keys = [b.key for b in buffers]
        if len(set(keys)) != len(keys):
            raise ValueError(f"buffers: expected a distinct key per buffer, got {keys}")
        if buffers[0].own_layers:
            raise ValueError("buffers[0]: the first buffer counts the layers (own_layers=False)")
        if not is_int(self.start_layer) or self.start_layer < 0:
            raise ValueError(f"start_layer: expected an int >= 0, got {self.start_layer!r}")
        object.__setattr__(self, "buffers", buffers)

    @classmethod
    def declared_for(cls, pool) -> PoolLayout | None:
        """The layout jaxkv declares for `pool` when its class is one jaxkv recognises
        (sglang-jax's `MHATokenToKVPool` and `MLATokenToKVPool`, subclasses too), from the
        pool's own attributes, every buffer family it holds listed (DSA's indexer keys too);
        None for any other class. Pages spread over data ranks are described as they lie
        (`KVConnector` refuses those pools: their token slots are rank-local).

        Raises:
            UnsupportedKVCacheError: buffers that disagree with the pool's attributes.
        """
        name = _sglang_jax_class(pool)
        return None if name is None else _DESCRIBERS[name](pool)

    def resolve(self, pool) -> Layout:
        """The `Layout` of `pool` under this declaration, every buffer checked against it.

        Raises:
            UnsupportedKVCacheError: a buffer family missing, or not shaped as declared (the
                message says what was seen).
        """
        name = type(pool).__name__
        parts: list[Part] = []
        slots = n_layers = None
        for decl in self.buffers:
            where = decl.attr or "the pool"
            layers = layers_of(pool, decl.attr)
            if layers is None:
                raise _unsupported(
                    name, f"{where}: expected a sequence of per-layer arrays, as declared"
                )
            shape = tuple(int(d) for d in layers[0].shape)
            check_family(name, decl.attr or "pool", layers, None if decl.own_layers else n_layers)
            n_layers = n_layers or len(layers)
            part, rows = self._part(name, decl, shape, _foreign.buffer_dtype(layers[0]))
            if slots is not None and rows != slots:
                raise _unsupported(
                    name, f"{where} holds {rows} token slots, expected {slots} like the others"
                )
            slots = rows
            if decl.own_layers:
                part = dataclasses.replace(part, layers=len(layers))
            parts.append(part)
        main = layers_of(pool, self.buffers[0].attr)
        assert main is not None and slots is not None and n_layers is not None  # checked above
        dtype = self.dtype or logical_dtype(pool, main[0].dtype)
        return Layout(
            kind=self.kind,
            dtype=_foreign.dtype_name(dtype),
            page_size=self.page_size,
            start_layer=int(self.start_layer),
            layer_num=n_layers,
            rows=slots,
            parts=tuple(parts),
            sizes=self.sizes,
        )

    def _part(self, name: str, decl: BufferLayout, shape, dtype) -> tuple[Part, int]:
        """The part a family's layer buffers of `shape` and `dtype` make, and its slots."""
        where = f"{decl.attr or 'pool'}[0]"
        if len(shape) <= decl.token_axes:
            raise _unsupported(
                name,
                f"{where} has shape {shape}: expected {decl.token_axes} token axes and at least "
                "one axis of each token's entry",
            )
        row_shape = shape[decl.token_axes :]
        bits = _dtypes.bits_dtype(dtype)
        page = self.page_size
        if decl.token_axes == 1:
            if decl.page_rows is not None:
                raise _unsupported(name, f"{where}: page_rows needs paged token axes (>= 2)")
            return Part(decl.attr, decl.key, row_shape, bits, RowCodec(dtype)), shape[0]
        lead = shape[1 : decl.token_axes]
        held = math.prod(lead)
        declared = decl.page_rows or page
        if held != declared or held < page:
            raise _unsupported(
                name,
                f"{where} has shape {shape}: its pages hold {held} token rows {lead}, expected "
                f"{declared} for page_size {page}"
                + ("" if decl.page_rows else " (declare page_rows when pages are padded)"),
            )
        codec = PagedRowCodec(page, lead)
        return Part(decl.attr, decl.key, row_shape, bits, codec), shape[0] * page


def _unsupported(name: str, why: str) -> UnsupportedKVCacheError:
    return UnsupportedKVCacheError(f"Unsupported KV cache type {name}: {why}")


# ---- sglang-jax ---------------------------------------------------------------------------

# The module sglang-jax's pools live in (its package is never imported here: an object of one
# of these classes is already in the caller's hands when the connector sees it).
_SGLANG_JAX_POOLS = "sgl_jax.srt.mem_cache.memory_pool"


def _sglang_jax_class(pool) -> str | None:
    """`"MHATokenToKVPool"` or `"MLATokenToKVPool"` when `pool` is one of sglang-jax's (or a
    subclass), else None."""
    for cls in type(pool).__mro__:
        if cls.__module__ == _SGLANG_JAX_POOLS and cls.__name__ in _DESCRIBERS:
            return cls.__name__
    return None


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def _attrs(pool, *names: str) -> dict[str, int]:
    name = type(pool).__name__
    out = {}
    for attr in names:
        value = getattr(pool, attr, None)
        if not is_int(value):
            raise _unsupported(name, f"{attr}: expected an int attribute, got {value!r}")
        out[attr] = int(cast(int, value))
    return out


def _packing(pool) -> int:
    """sglang-jax's entries per 32-bit word for the pool's dtype (bf16 2, float32 1)."""
    try:
        bits = 8 * _foreign.buffer_dtype(pool).itemsize
    except TypeError as err:
        raise _unsupported(type(pool).__name__, f"dtype: {err}") from None
    return max(1, 32 // bits)


def _check_shapes(pool, attr: str, want: tuple[int, ...], facts: str) -> None:
    """Every layer buffer of `attr` has shape `want`, which the pool's attributes give."""
    layers = layers_of(pool, attr) or []
    for li, buf in enumerate(layers):
        if tuple(buf.shape) != want:
            raise _unsupported(
                type(pool).__name__,
                f"{attr}[{li}] has shape {tuple(buf.shape)}, expected {want} from its "
                f"attributes ({facts}); jaxkv reads sglang-jax's pools only as sglang-jax "
                "lays them out",
            )


def _refuse_data_parallel(pool, dp: int) -> None:
    if dp != 1:
        raise _unsupported(
            type(pool).__name__,
            f"dp_size={dp}: data-parallel attention pools are not supported (each data rank "
            "hands out slots local to its own pages, so a slot does not name one row of the "
            "buffer); use dp_size=1",
        )


def _sglang_jax_mha(pool) -> PoolLayout:
    a = _attrs(pool, "size", "page_size", "head_num", "head_dim", "dp_size", "start_layer")
    p, page = _packing(pool), a["page_size"]
    want = (a["size"] // page + a["dp_size"], page, 2 * a["head_num"] // p, p, a["head_dim"])
    _check_shapes(pool, "kv_buffer", want, f"{a}, packing {p}")
    return PoolLayout(
        kind="sglang-jax-mha",
        page_size=page,
        buffers=(BufferLayout("kv_buffer", "kv", token_axes=2),),
        start_layer=a["start_layer"],
        sizes=(("head_num", a["head_num"]), ("head_dim", a["head_dim"])),
    )


def _sglang_jax_mla(pool) -> PoolLayout:
    a = _attrs(
        pool, "size", "page_size", "kv_lora_rank", "qk_rope_head_dim", "dp_size", "start_layer"
    )
    p, page = _packing(pool), a["page_size"]
    rows = _align(page, p)
    pages = a["size"] // page + a["dp_size"]
    width = _align(a["kv_lora_rank"], 128) + _align(a["qk_rope_head_dim"], 128)
    facts = f"{a}, packing {p}"
    _check_shapes(pool, "kv_buffer", (pages, rows // p, p, width), facts)
    buffers = [BufferLayout("kv_buffer", "kv", token_axes=3, page_rows=rows)]
    if layers_of(pool, "indexer_key_buffer"):
        dim = _attrs(pool, "indexer_key_dim")["indexer_key_dim"]
        want = (pages, rows // p, p, _align(dim, 128))
        _check_shapes(pool, "indexer_key_buffer", want, f"{facts}, indexer_key_dim {dim}")
        buffers.append(
            BufferLayout("indexer_key_buffer", "index_k", 3, page_rows=rows, own_layers=True)
        )
    return PoolLayout(
        kind="sglang-jax-mla",
        page_size=page,
        buffers=tuple(buffers),
        start_layer=a["start_layer"],
        sizes=(("kv_lora_rank", a["kv_lora_rank"]), ("qk_rope_head_dim", a["qk_rope_head_dim"])),
    )


_DESCRIBERS = {"MHATokenToKVPool": _sglang_jax_mha, "MLATokenToKVPool": _sglang_jax_mla}


def recognised(pool) -> PoolLayout | None:
    """The layout jaxkv declares for a pool class it recognises (sglang-jax's), else None.

    Raises:
        UnsupportedKVCacheError: a recognised pool whose buffers disagree with its attributes,
            or one jaxkv does not serve (data-parallel pages).
    """
    if _sglang_jax_class(pool) is None:
        return None
    _refuse_data_parallel(pool, _attrs(pool, "dp_size")["dp_size"])
    return PoolLayout.declared_for(pool)
