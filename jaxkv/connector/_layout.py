"""What a pool's blocks are: its layout (the key blocks are namespaced by) and its parts.

`describe(pool)` returns a `Layout`: kind, dtype, page size, layer range and, per exported buffer
family, a `Part` (`"k"`, `"v"`, `"kv"`, `"index_k"`) with its attribute, per-token row shape,
raw-bit dtype and codec. A part is a pool's `BufferSpec`: jaxkv pools describe themselves
(`buffer_specs`, `KIND`), and any other object is matched against the jaxkv kinds' declared
buffer attributes (SGLang's names) and described by the same declarations, its row shapes read
from its buffers. `Layout.fingerprint` is the stable digest block keys are chained from, and
`Layout.differences` says field by field why two layouts are not the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from jaxkv._buffers import BufferSpec
from jaxkv._pool_base import PoolBase
from jaxkv.connector import _foreign
from jaxkv.errors import UnsupportedKVCacheError
from jaxkv.pools import KOnlyPool, MHAPool, MLAPool, NSAPool

# One exported buffer family: `layer_num` buffers of `row_shape` entries per token.
Part = BufferSpec

# The kinds another framework's pool may be, tried in order: the first whose buffers it has
# all of describes it. A kind comes before the kind it extends (NSA before MLA, MHA before
# K-only), and latent kinds before head kinds: an object with `kv_buffer` is a latent pool.
_FOREIGN_KINDS = (NSAPool, MLAPool, MHAPool, KOnlyPool)
_FOREIGN_ATTRS = tuple(dict.fromkeys(a for kind in _FOREIGN_KINDS for a in kind.BUFFERS))


# Fields of `Layout` that the fingerprint covers and `differences` names, in message order.
_NAMED_FIELDS = ("kind", "dtype", "page_size", "start_layer", "layer_num", "shard")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Everything that must match for a stored block to be meaningful in a pool.

    `sizes` are a jaxkv pool's own sizes (`head_num`, `kv_lora_rank`, ...): they only name
    differences in messages; the parts' row shapes carry them into the fingerprint.
    """

    kind: str
    dtype: str
    page_size: int
    start_layer: int
    layer_num: int
    rows: int
    parts: tuple[Part, ...]
    shard: str = "full"
    sizes: tuple[tuple[str, int], ...] = ()

    def part_layers(self, part: Part) -> int:
        """How many buffers `part` has: one per layer, unless it has its own count."""
        return part.layers or self.layer_num

    def block_nbytes(self, block_size: int) -> int:
        """Bytes of one block record's parts: every layer's rows of `block_size` tokens."""
        return block_size * sum(
            self.part_layers(p) * int(np.prod(p.row_shape)) * p.bits_dtype.itemsize
            for p in self.parts
        )

    def fingerprint(self, block_size: int) -> str:
        """A stable hex digest of the layout and block size (never Python's salted `hash`)."""
        desc = {
            "kind": self.kind,
            "dtype": self.dtype,
            "page_size": self.page_size,
            "layers": [self.start_layer, self.start_layer + self.layer_num],
            "block_size": block_size,
            "shard": self.shard,
            "parts": [
                [p.key, list(p.row_shape), p.bits_dtype.name, *([p.layers] if p.layers else [])]
                for p in self.parts
            ],
        }
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()

    def differences(self, got: Layout) -> list[str]:
        """Each field in which `got` differs from this layout, as "field: expected X, got Y".

        Sizes are named when both layouts know them (jaxkv pools); when no size or kind
        differs (foreign pools, or only the rows' dtype), each differing part's rows are.
        """
        diffs = [
            f"{name}: expected {getattr(self, name)}, got {getattr(got, name)}"
            for name in _NAMED_FIELDS
            if getattr(self, name) != getattr(got, name)
        ]
        theirs = dict(got.sizes)
        sized = [
            f"{name}: expected {value}, got {theirs[name]}"
            for name, value in self.sizes
            if name in theirs and theirs[name] != value
        ]
        if sized or self.kind != got.kind:  # the parts differ because of those
            return diffs + sized
        mine = {p.key: _rows(p) for p in self.parts}
        other = {p.key: _rows(p) for p in got.parts}
        for key in sorted(mine.keys() | other.keys()):
            if mine.get(key) != other.get(key):
                diffs.append(f"{key} rows: expected {mine.get(key)}, got {other.get(key)}")
        return diffs


def _rows(part: Part) -> str:
    return f"{part.row_shape} {part.bits_dtype.name}"


_UNSUPPORTED = (
    "Unsupported KV cache type {name}: expected kv_buffer (MLA/NSA) or k_buffer/v_buffer (MHA), "
    "or k_buffer alone (K-only), each a sequence of per-layer arrays that support DLPack"
)


def describe(pool) -> Layout:
    """The layout of `pool`: a jaxkv pool, or any object with SGLang's buffer attributes."""
    if isinstance(pool, PoolBase):
        return _jaxkv_layout(pool)
    return _foreign_layout(pool)


def _jaxkv_layout(pool: PoolBase) -> Layout:
    return Layout(
        kind=pool.KIND,
        dtype=pool.dtype.name,
        page_size=pool.page_size,
        start_layer=pool.start_layer,
        layer_num=pool.layer_num,
        rows=pool.rows,
        parts=pool.buffer_specs(),
        sizes=tuple(pool.size_fields().items()),
    )


def layers_of(pool, attr: str) -> list | None:
    """The per-layer buffers `pool` holds under `attr` (`""`: `pool` is the sequence), when
    they are a non-empty sequence of arrays, else None."""
    layers = getattr(pool, attr, None) if attr else pool
    if layers is None:
        return None
    try:
        layers = list(layers)
    except TypeError:
        return None
    if not layers or not all(hasattr(b, "shape") and hasattr(b, "dtype") for b in layers):
        return None
    return layers


# Per-token scale side buffers of SGLang's quantised pools (FP4/MXFP8 KV): blocks without them
# would reload unreadable values, so such pools are refused rather than silently half-copied.
_SCALE_ATTRS = ("k_scale_buffer", "v_scale_buffer")


def _unsupported(name: str, why: str) -> UnsupportedKVCacheError:
    return UnsupportedKVCacheError(f"Unsupported KV cache type {name}: {why}")


def logical_dtype(pool, buffers_dtype) -> str:
    """The dtype a pool's layout is keyed by: its `dtype` attribute when it has one (SGLang's
    fp8 pools say float8_e4m3fn over uint8 buffers, as jaxkv pools do), else its buffers'."""
    dtype = getattr(pool, "dtype", None)
    if dtype is None:
        return _foreign.dtype_name(buffers_dtype)
    try:
        return _foreign.dtype_name(dtype)
    except TypeError as err:
        raise ValueError(
            f"pool.dtype: expected a dtype (numpy, jax, torch or its name), got {dtype!r}"
        ) from err


def check_family(
    name: str, attr: str, layers: list, n_layers: int | None, rows: int | None = None
) -> None:
    """Every layer of a buffer family alike: count (`n_layers`, None: any), shape, dtype, and
    how jaxkv moves it."""
    if n_layers is not None and len(layers) != n_layers:
        raise _unsupported(name, f"{attr} has {len(layers)} layers, expected {n_layers}")
    first = layers[0]
    shape, dtype, kind = tuple(first.shape), _foreign.buffer_dtype(first), _foreign.kind(first)
    if rows is not None and shape[0] != rows:
        raise _unsupported(name, f"{attr}[0] has {shape[0]} rows, expected {rows}")
    for li, b in enumerate(layers[1:], 1):
        got = (tuple(b.shape), _foreign.buffer_dtype(b), _foreign.kind(b))
        if got != (shape, dtype, kind):
            raise _unsupported(
                name,
                f"{attr}[{li}] is a {got[2]} buffer {got[0]} {got[1].name}, expected a "
                f"{kind} buffer {shape} {dtype.name} like {attr}[0]",
            )


def _foreign_layout(pool) -> Layout:
    name = type(pool).__name__
    present = {a: layers for a in _FOREIGN_ATTRS if (layers := layers_of(pool, a)) is not None}
    kind = next((k for k in _FOREIGN_KINDS if all(a in present for a in k.BUFFERS)), None)
    if kind is None:
        raise UnsupportedKVCacheError(_UNSUPPORTED.format(name=name))
    for attr in _SCALE_ATTRS:
        if layers_of(pool, attr) is not None:
            raise _unsupported(
                name,
                f"its per-token scales ({attr}) are not part of jaxkv blocks; reloading the "
                "values without them would corrupt the cache",
            )
    # Never guess: a token-major family is per-token rows, `(rows, D)` or `(rows, a, b)`. A 4-D
    # or 5-D buffer is paged (sglang-jax's fused `(pages, page_size, ...)` buffers): reading its
    # first axis as token rows would move whole pages to the wrong places.
    for decl in kind.DECLARED:
        ndim = len(present[decl.attr][0].shape)
        if decl.codec.token_major and ndim not in (2, 3):
            raise _unsupported(
                name,
                f"{decl.attr}[0] has shape {tuple(present[decl.attr][0].shape)}: a {ndim}-D "
                "buffer is not per-token rows ((rows, D) or (rows, heads, D), as SGLang's pools "
                "hold them); jaxkv does not guess which axes are pages and tokens: declare "
                "them with KVConnector(pool, store, layout=PoolLayout(...))",
            )
    # Token rows are counted on the first token-major buffer (paged ones hold pages).
    main = present[next(d.attr for d in kind.DECLARED if d.codec.token_major)]
    rows = int(main[0].shape[0])
    declared_page = getattr(pool, "page_size", None)
    page = int(declared_page) if declared_page else None
    parts = []
    for decl in kind.DECLARED:
        layers = present[decl.attr]
        check_family(name, decl.attr, layers, len(main), rows if decl.codec.token_major else None)
        shape = tuple(int(d) for d in layers[0].shape)
        try:
            parts.append(decl.of_layer(shape, _foreign.buffer_dtype(layers[0]), rows, page))
        except ValueError as err:
            raise _unsupported(name, f"{decl.attr}: {err}") from None
    # A paged buffer (NSA's index) tells the page size when the object does not.
    page_size = next((p.codec.page_size for p in parts if p.codec.page_size), page or 1)
    return Layout(
        kind=kind.KIND,
        dtype=logical_dtype(pool, main[0].dtype),
        page_size=page_size,
        start_layer=int(getattr(pool, "start_layer", 0) or 0),
        layer_num=len(main),
        rows=rows,
        parts=tuple(parts),
    )
