"""What a pool's blocks are: the one place a pool is described for transfer.

`describe(pool, declared=None)` returns a `Layout`: kind, dtype, page size, layer range and,
per exported buffer family, a part (`"k"`, `"v"`, `"kv"`, `"index_k"`): the pool's
`BufferSpec`, with its attribute, per-token row shape, raw-bit dtype and codec. Every path
calls it once per pool and hands the result on; nothing else describes a pool.

Whoever knows a pool describes it:

* jaxkv pools describe themselves (`buffer_specs`, `KIND`: each buffer declared once, with
  `jaxkv._buffers.buffer`);
* a user declares the layout of any pool (`PoolLayout`, passed as `layout=` to the connector);
* a jaxkv module that knows another framework's pool classes declares theirs with
  `declare_layout`, keyed by the module that defines the class; the declaring module is named
  in `_DECLARING_MODULES` and imported when such a pool first arrives, so the caller never
  imports it and the connector names no foreign class (sglang-jax's fused pools:
  `jaxkv.integrations.sglang_jax.layouts`);
* anything else is matched against the jaxkv kinds' declared buffer attributes (SGLang's names)
  and described by the same declarations, its row shapes read from its buffers.

A new pool kind is one declaration in one place: a `buffer()` field of a jaxkv kind, or a
`declare_layout` call beside the integration that knows the class.

`Layout.fingerprint` is the stable digest block keys are chained from, and
`Layout.differences` says field by field why two layouts are not the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxkv import _dtypes
from jaxkv._buffers import BufferSpec
from jaxkv._checks import is_int
from jaxkv._kernels import PagedRowCodec, RowCodec
from jaxkv._pool_base import PoolBase
from jaxkv.connector import _foreign
from jaxkv.connector._foreign import buffer_dtype
from jaxkv.errors import UnsupportedKVCacheError
from jaxkv.pools import KOnlyPool, MHAPool, MLAPool, NSAPool

__all__ = [
    "BufferLayout",
    "BufferSpec",
    "Layout",
    "PoolLayout",
    "buffer_dtype",
    "check_family",
    "declare_layout",
    "describe",
    "layers_of",
    "logical_dtype",
    "unsupported",
]

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
    parts: tuple[BufferSpec, ...]
    shard: str = "full"
    sizes: tuple[tuple[str, int], ...] = ()

    def part_layers(self, part: BufferSpec) -> int:
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


def _rows(part: BufferSpec) -> str:
    return f"{part.row_shape} {part.bits_dtype.name}"


_UNSUPPORTED = (
    "Unsupported KV cache type {name}: expected kv_buffer (MLA/NSA) or k_buffer/v_buffer (MHA), "
    "or k_buffer alone (K-only), each a sequence of per-layer arrays that support DLPack"
)


def describe(pool, declared: PoolLayout | None = None) -> Layout:
    """The layout of `pool`: by `declared` when given, else a jaxkv pool's own, a layout a
    jaxkv module declares for its class (`declare_layout`), or that of an object with SGLang's
    buffer attributes.

    Raises:
        UnsupportedKVCacheError: a pool none of these describes, buffers that disagree with
            the description, or a pool of a declared class the connector does not serve.
        ConsumedPoolError: a jaxkv pool already consumed.
    """
    if isinstance(pool, PoolBase):
        if pool.consumed:
            pool.layer_buffer(pool.BUFFERS[0], 0)  # raises ConsumedPoolError, naming the pool
        if declared is None:
            return _jaxkv_layout(pool)
    if declared is None:
        found = _registered(pool)
        if found is not None:
            found.check(pool)
            declared = found.layout(pool)
    if declared is not None:
        return declared.resolve(pool)
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


def unsupported(name: str, why: str) -> UnsupportedKVCacheError:
    """The error for a pool of class `name` jaxkv does not move, saying `why`."""
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
        raise unsupported(name, f"{attr} has {len(layers)} layers, expected {n_layers}")
    first = layers[0]
    shape, dtype, kind = tuple(first.shape), _foreign.buffer_dtype(first), _foreign.kind(first)
    if rows is not None and shape[0] != rows:
        raise unsupported(name, f"{attr}[0] has {shape[0]} rows, expected {rows}")
    for li, b in enumerate(layers[1:], 1):
        got = (tuple(b.shape), _foreign.buffer_dtype(b), _foreign.kind(b))
        if got != (shape, dtype, kind):
            raise unsupported(
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
            raise unsupported(
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
            raise unsupported(
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
            raise unsupported(name, f"{decl.attr}: {err}") from None
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
        """The layout a jaxkv module declares for `pool`'s class (see `declare_layout`:
        sglang-jax's `MHATokenToKVPool` and `MLATokenToKVPool`, subclasses too), from the
        pool's own attributes, every buffer family it holds listed (DSA's indexer keys too);
        None for any other class. Pools the connector does not serve are described as they
        lie (`describe` refuses them).

        Raises:
            UnsupportedKVCacheError: buffers that disagree with the pool's attributes.
        """
        found = _registered(pool)
        return None if found is None else found.layout(pool)

    def resolve(self, pool) -> Layout:
        """The `Layout` of `pool` under this declaration, every buffer checked against it.

        Raises:
            UnsupportedKVCacheError: a buffer family missing, or not shaped as declared (the
                message says what was seen).
        """
        name = type(pool).__name__
        parts: list[BufferSpec] = []
        slots = n_layers = None
        for decl in self.buffers:
            where = decl.attr or "the pool"
            layers = layers_of(pool, decl.attr)
            if layers is None:
                raise unsupported(
                    name, f"{where}: expected a sequence of per-layer arrays, as declared"
                )
            shape = tuple(int(d) for d in layers[0].shape)
            check_family(name, decl.attr or "pool", layers, None if decl.own_layers else n_layers)
            n_layers = n_layers or len(layers)
            part, rows = self._part(name, decl, shape, _foreign.buffer_dtype(layers[0]))
            if slots is not None and rows != slots:
                raise unsupported(
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

    def _part(self, name: str, decl: BufferLayout, shape, dtype) -> tuple[BufferSpec, int]:
        """The part a family's layer buffers of `shape` and `dtype` make, and its slots."""
        where = f"{decl.attr or 'pool'}[0]"
        if len(shape) <= decl.token_axes:
            raise unsupported(
                name,
                f"{where} has shape {shape}: expected {decl.token_axes} token axes and at least "
                "one axis of each token's entry",
            )
        row_shape = shape[decl.token_axes :]
        bits = _dtypes.bits_dtype(dtype)
        page = self.page_size
        if decl.token_axes == 1:
            if decl.page_rows is not None:
                raise unsupported(name, f"{where}: page_rows needs paged token axes (>= 2)")
            return BufferSpec(decl.attr, decl.key, row_shape, bits, RowCodec(dtype)), shape[0]
        lead = shape[1 : decl.token_axes]
        held = math.prod(lead)
        declared = decl.page_rows or page
        if held != declared or held < page:
            raise unsupported(
                name,
                f"{where} has shape {shape}: its pages hold {held} token rows {lead}, expected "
                f"{declared} for page_size {page}"
                + ("" if decl.page_rows else " (declare page_rows when pages are padded)"),
            )
        codec = PagedRowCodec(page, lead)
        return BufferSpec(decl.attr, decl.key, row_shape, bits, codec), shape[0] * page


# ---- declared classes ---------------------------------------------------------------------

# The jaxkv module that declares the layouts of another framework's pool classes, by the module
# defining those classes: imported when a pool of such a module first arrives. The foreign
# package itself is never imported here (its pool is already in the caller's hands).
_DECLARING_MODULES = {"sgl_jax.srt.mem_cache.memory_pool": "jaxkv.integrations.sglang_jax.layouts"}


class _Declared(NamedTuple):
    layout: Callable[[Any], PoolLayout]
    check: Callable[[Any], None]


# The registry `declare_layout` fills, by (module, class name). Written only when a declaring
# module is imported; read on every `describe` of a pool that is not jaxkv's.
_REGISTRY: dict[tuple[str, str], _Declared] = {}
_REGISTRY_LOCK = threading.Lock()


def declare_layout(
    module: str,
    name: str,
    layout: Callable[[Any], PoolLayout],
    *,
    check: Callable[[Any], None] | None = None,
) -> None:
    """Declares how pools of class `name` defined in `module` (and its subclasses) are laid
    out, for the module that knows them (an integration) to call when it is imported.

    Args:
        module: the `__module__` of the class.
        name: its `__qualname__`.
        layout: the pool -> its `PoolLayout`, read from the pool's own attributes; raises
            `UnsupportedKVCacheError` for buffers that disagree with them.
        check: the pool -> None, raising `UnsupportedKVCacheError` for a pool of the class
            that the connector does not serve (its layout is still declared for others).
    """
    with _REGISTRY_LOCK:
        _REGISTRY[(module, name)] = _Declared(layout, check or (lambda pool: None))


def _registered(pool) -> _Declared | None:
    """The declaration of `pool`'s class or of the nearest base class that has one."""
    for cls in type(pool).__mro__:
        declaring = _DECLARING_MODULES.get(cls.__module__)
        if declaring is not None:
            importlib.import_module(declaring)  # declares its classes (once: Python caches it)
        found = _REGISTRY.get((cls.__module__, cls.__qualname__))
        if found is not None:
            return found
    return None
