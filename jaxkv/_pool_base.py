"""What every KV pool shares: static metadata, validation, layer ids, slots and the write path.

A pool is a frozen dataclass registered as a JAX pytree whose leaves are exactly its per-layer
buffers (tuples of arrays, one per layer); every other field is static metadata, so two pools of
equal shapes share one trace. Subclasses declare their buffer fields (`buffer()`), their own
static sizes, their `create` signature and their rules; they never re-implement validation,
slot handling or the scatter.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Mapping
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    NamedTuple,
    TypeVar,
)

if TYPE_CHECKING:  # typing's own from 3.11 on; annotations only (never evaluated)
    pass

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _dtypes, _kernels
from jaxkv._buffers import BufferDecl, BufferSpec, buffer, declarations
from jaxkv._checks import int_arg, is_int
from jaxkv._create import COMMON_ARGS, check_create
from jaxkv.errors import ConsumedPoolError

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # the marker only informs type checkers, which read the branch above

    def dataclass_transform(**_):
        return lambda cls: cls


_P = TypeVar("_P", bound="PoolBase")


class Write(NamedTuple):
    """One buffer's part of an update: `value (T, *row_shape)` from user argument `arg` for
    the buffer of part key `key`.

    `value` may be a tuple of parts that are encoded separately and joined on the last axis
    (MLA's `k_nope` and `k_rope`), so mixed input dtypes never promote each other; then
    `part_shapes` names each part's argument and per-token shape, so errors name the part.
    """

    key: str
    arg: str
    value: Any
    scale: Any = None
    part_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()


def _register(cls) -> None:
    """Registers dataclass `cls` as a pytree whose leaves are its buffers.

    Not `register_dataclass`: its unflatten calls the dataclass `__init__`, which for a
    frozen class of a dozen fields cost 3.4-6.1 us per jitted call on the CI machine, while a
    small update's whole dispatch is 10-40 us. Here the static fields are interned once per
    distinct set of values (`_Static`), the pytree's aux data is that object (hashed and
    compared by identity in every jit cache lookup), and unflattening fills the new pool's
    `__dict__` from the interned one. Key paths stay attribute names (`pool.k_buffer[0]`).
    """
    names = [f.name for f in dataclasses.fields(cls)]
    data = tuple(n for n in names if n in cls.BUFFERS)
    meta = tuple(n for n in names if n not in cls.BUFFERS)
    keys = tuple(jax.tree_util.GetAttrKey(n) for n in data)

    def flatten(pool):
        # Remembered on the pool (its fields never change): `(children, statics)`.
        return pool.__dict__.get("_flat") or _flatten_first(pool)

    def _flatten_first(pool):
        d = pool.__dict__
        flat = d["_flat"] = (tuple([d[n] for n in data]), _Static.of(pool, meta))
        return flat

    def flatten_with_keys(pool):
        children, static = flatten(pool)
        return tuple(zip(keys, children)), static

    def unflatten(static, children):
        pool = object.__new__(cls)
        d = pool.__dict__
        d.update(static.template)
        d.update(zip(data, children))
        d["_flat"] = (children if type(children) is tuple else tuple(children), static)
        return pool

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


class _Static:
    """The static fields of a pool, one object per distinct `(class, values)`: equal pools
    share it, so identity is equality and a jit cache lookup compares one pointer instead of
    every field. `template` is the `__dict__` an unflattened pool starts from."""

    __slots__ = ("key", "template", "__weakref__")
    key: tuple
    template: dict
    # Weak: an entry lives while a pool, treedef or jit cache entry holds its object, so two
    # live objects never share values, and pools of sizes no longer used are not kept.
    _interned: ClassVar[weakref.WeakValueDictionary] = weakref.WeakValueDictionary()

    @classmethod
    def of(cls, pool, meta: tuple[str, ...]) -> _Static:
        """The interned statics of `pool`."""
        return cls.intern(type(pool), tuple((n, getattr(pool, n)) for n in meta))

    @classmethod
    def intern(cls, kind: type, items: tuple) -> _Static:
        key = (kind, items)
        static = cls._interned.get(key)
        if static is None:
            static = object.__new__(cls)
            static.key = key
            static.template = dict(items)
            static = cls._interned.setdefault(key, static)
        return static

    def __reduce__(self):
        # A copy from a pickle is the interned object of its values, not a stranger whose
        # pools would compare unequal (and retrace) against equal ones.
        return (_Static.intern, self.key)

    def __repr__(self) -> str:  # how a treedef prints it (e.g. in tree_map's mismatch errors)
        fields = ", ".join(f"{k}={v!r}" for k, v in self.template.items())
        return f"{self.key[0].__name__}({fields})"


def _zeros(shape: tuple[int, ...], dtype, where) -> jax.Array:
    """A zeroed buffer placed by `where`, committed to its device even when `where` is None
    (the default device). An uncommitted buffer becomes committed the first time it meets a
    committed array (a connector load's staging, for one), and jit keys its programs by
    commitment: every jitted step holding the pool would then compile a second time, inside a
    later request."""
    x = jnp.zeros(shape, dtype, device=where)
    return x if where is not None else jax.device_put(x, x.sharding)


_NOT_CONCRETE = (
    "loc: check_bounds=True needs concrete slot values; under jax.jit out-of-range entries are "
    "dropped instead (pass check_bounds=False, or check loc before tracing)"
)


@dataclass_transform(
    frozen_default=True, eq_default=False, field_specifiers=(buffer, dataclasses.field)
)
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class PoolBase:
    """Shared behaviour of `MHAPool`, `MLAPool`, `NSAPool` and `KOnlyPool`.

    Every subclass is a frozen dataclass (made one when it is defined, as flax's
    `struct.PyTreeNode` does): its buffer fields are declared with `buffer()` and every other
    field is static. A class with a `KIND` (a pool kind, and any subclass of one) is
    registered as a pytree whose leaves are its buffers, and its `create` is checked to take
    exactly its static fields. A kind's own sizes are fields, its buffers' rows come from
    them (`buffer(rows=...)`), and setters and readers name buffers by part key.

    Every kind's `create` is a keyword-only classmethod handing its arguments to `_build`,
    which takes these for every kind:

    Args:
        size: token slots, a positive multiple of `page_size`; each layer buffer has
            `size + page_size` rows (page 0 is the padding sink).
        page_size: tokens per page, positive.
        dtype: logical dtype (float32, bfloat16, float16, float8_e4m3fn, float8_e5m2).
        layer_num: layers held, positive; `start_layer` (>= 0) is the first one's global id.
        sharding: placement of every buffer (`None`: the default device). Token rows are
            never split; MHA and K-only pools may split heads over a mesh axis (`head_num`
            divisible by its size), MLA and NSA buffers are replicated.

    and the kind's own sizes, positive ints. It returns the pool with every buffer zero (its
    readers return zeros), placed by `sharding`, and raises `ValueError` for a bad size, dtype
    or sharding, naming the argument (NSA with an fp8 dtype also needs `kv_lora_rank` a
    multiple of 128), `TypeError` for a positional, unknown or missing argument, or a
    `sharding` that is no placement (not None, a device or a `jax.sharding.Sharding`).
    """

    # The layout kind the connector keys blocks by; subclasses of a kind inherit it.
    KIND: ClassVar[str] = ""
    # What the kind's buffer fields declare, in field order (set when a subclass is defined).
    DECLARED: ClassVar[tuple[BufferDecl, ...]] = ()
    # The buffer attributes, in field order: the pytree's data fields.
    BUFFERS: ClassVar[tuple[str, ...]] = ()

    size: int
    page_size: int
    dtype: np.dtype
    layer_num: int
    start_layer: int
    sharding: Any

    def __init_subclass__(cls, **kwargs):
        """Makes every subclass a frozen dataclass and derives its buffers from its fields.

        A pool kind (a class with a `KIND`) and a user's subclass of one are pytrees, so they
        can be jitted over and donated; pytree registration is per class.
        """
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True, eq=False, repr=False)(cls)
        cls.DECLARED = declarations(cls)
        cls.BUFFERS = tuple(d.attr for d in cls.DECLARED)
        if cls.KIND:
            check_create(cls)
            _register(cls)

    # ---- static description -------------------------------------------------------------

    @property
    def store_dtype(self) -> np.dtype:
        return _dtypes.store_dtype_of(self.dtype)

    @property
    def rows(self) -> int:
        """Rows of each token-major buffer: `size + page_size` (page 0 is the padding sink)."""
        return self.size + self.page_size

    def buffer_specs(self) -> tuple[BufferSpec, ...]:
        """The per-layer buffers of this pool as its kind declares them, in field order.

        Computed once per pool and handed on to the pools `with_buffers` makes: it depends on
        the static fields only, and every update asks for it.
        """
        specs = self.__dict__.get("_specs")
        if specs is None:
            specs = tuple(decl.spec(self) for decl in self.DECLARED)
            object.__setattr__(self, "_specs", specs)
        return specs

    def spec(self, key: str) -> BufferSpec:
        """The description of the buffer of part key `key` (`KeyError` if this kind has
        none)."""
        for s in self.buffer_specs():
            if s.key == key:
                return s
        keys = [s.key for s in self.buffer_specs()]
        raise KeyError(f"key: expected a part of {type(self).__name__} among {keys}, got {key!r}")

    def size_fields(self) -> dict[str, int]:
        """The kind's own sizes (`head_num`, `kv_lora_rank`, ...): every static field that
        is not common to all kinds."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in self.BUFFERS and f.name not in COMMON_ARGS
        }

    def buffers(self, name: str) -> tuple[jax.Array, ...]:
        """The per-layer buffers of attribute `name`."""
        return getattr(self, name)

    @property
    def consumed(self) -> bool:
        """Whether an eager donating update (or a connector load) has consumed this pool: its
        buffers went to the pool that call returned, and every read or update through this
        object raises `ConsumedPoolError`."""
        return self.__dict__.get("_consumed", False)

    def mark_consumed(self) -> None:
        """Records that this pool's buffers were handed to a newer pool (a Python flag: no
        device work). Not a dataclass field, so it never reaches the pytree or a trace."""
        object.__setattr__(self, "_consumed", True)

    def layer_buffer(self, name: str, li: int) -> jax.Array:
        """Buffer `name` of local layer `li`, with a clear error if an update consumed it."""
        where = f"{type(self).__name__}.{name}[{li}] (layer {self.start_layer + li})"
        if self.consumed:
            raise ConsumedPoolError(
                f"{where}: this {type(self).__name__} was consumed by an earlier update, which "
                "handed its buffers to the pool it returned: use the returned pool, or pass "
                "donate=False to keep this one readable"
            )
        buf = self.buffers(name)[li]
        if not isinstance(buf, jax.core.Tracer) and buf.is_deleted():
            raise ConsumedPoolError(
                f"{where} was donated to the pool returned by an update: use that pool, or pass "
                "donate=False to keep this one readable"
            )
        return buf

    def part_layer(self, key: str, layer_id: int) -> jax.Array:
        """The stored bits of global layer `layer_id` of the buffer of part key `key`."""
        return self.layer_buffer(self.spec(key).attr, self.layer_index(layer_id))

    @staticmethod
    def common_fields(
        *, size, page_size, layer_num, start_layer, dtype, sharding
    ) -> dict[str, Any]:
        """Validates the arguments every pool kind takes; returns them as static fields."""
        size, page_size = int_arg("size", size), int_arg("page_size", page_size)
        layer_num = int_arg("layer_num", layer_num)
        if size % page_size:
            raise ValueError(
                f"size: expected a multiple of page_size={page_size}, got {size} "
                f"(use {(size // page_size + 1) * page_size})"
            )
        return dict(
            size=size,
            page_size=page_size,
            dtype=_dtypes.canonical_dtype(dtype),
            layer_num=layer_num,
            start_layer=int_arg("start_layer", start_layer, low=0),
            sharding=sharding,
        )

    @classmethod
    def _build(cls: type[_P], args: Mapping[str, Any]) -> _P:
        """What every kind's `create` does with its arguments `args` (its `locals()`, by
        name): validates them, then allocates zeroed buffers as the kind declares them.

        The kind's own sizes (every argument not common to all kinds) are positive ints.
        Every check, sharding included, runs before anything is allocated.
        """
        common_args = args.get("common", {})  # a kind's `**common` (see `common_create`)
        args = {k: v for k, v in args.items() if k not in ("cls", "common")} | common_args
        sizes: dict[str, Any] = {k: int_arg(k, v) for k, v in args.items() if k not in COMMON_ARGS}
        common = cls.common_fields(**{k: args[k] for k in COMMON_ARGS})
        empty: dict[str, Any] = dict.fromkeys(cls.BUFFERS, ())
        pool = cls(**common, **sizes, **empty)
        pool.check_sizes()
        specs = pool.buffer_specs()
        shapes = [s.layer_shape(pool.rows) for s in specs]
        where = [
            s.shard.placement(pool.sharding, s.attr, shape, cls.__name__)
            for s, shape in zip(specs, shapes)
        ]
        return pool.with_buffers(
            **{
                s.attr: [_zeros(shape, s.bits_dtype, w) for _ in range(pool.layer_num)]
                for s, shape, w in zip(specs, shapes, where)
            }
        )

    def check_sizes(self) -> None:
        """Rules between a kind's sizes beyond positivity (`ValueError`); none by default."""

    def with_buffers(self, **buffers):
        """A pool like this one (same class and static fields) holding the given per-layer
        buffers, e.g. `pool.with_buffers(k_buffer=new_layers)`; the others are shared."""
        unknown = sorted(set(buffers) - set(self.BUFFERS))
        if unknown:
            raise ValueError(f"buffers: expected names among {self.BUFFERS}, got {unknown}")
        pool = dataclasses.replace(self, **{k: tuple(v) for k, v in buffers.items()})
        if "_specs" in self.__dict__:  # same statics, same specs
            object.__setattr__(pool, "_specs", self.__dict__["_specs"])
        return pool

    def __repr__(self) -> str:
        fields = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name not in self.BUFFERS and f.name != "dtype"
        ]
        return f"{type(self).__name__}(dtype={self.dtype.name}, {', '.join(fields)})"

    def part_bytes(self, key: str) -> int:
        """Bytes of every layer of the buffer of part key `key` (0 when this kind has none)."""
        attrs = [s.attr for s in self.buffer_specs() if s.key == key]
        return sum(int(b.nbytes) for attr in attrs for b in self.buffers(attr))

    def get_kv_size_bytes(self):
        """Bytes of every declared buffer (MHA and K-only return `(k, v)` instead)."""
        return sum(self.part_bytes(spec.key) for spec in self.buffer_specs())

    # ---- layer ids and slots ------------------------------------------------------------

    def layer_index(self, layer_id: int) -> int:
        """Global `layer_id` -> index into this pool's buffer tuples."""
        stop = self.start_layer + self.layer_num
        if not is_int(layer_id) or not (self.start_layer <= layer_id < stop):
            raise IndexError(
                f"layer_id: expected a global layer id in range({self.start_layer}, {stop}), "
                f"got {layer_id!r}"
            )
        return int(layer_id) - self.start_layer

    def prepare_loc(self, loc, *, check_bounds: bool = False) -> jax.Array:
        """Validates slot indices `(T,)` and makes them safe to send to the device.

        Host integers wider than 32 bits are clipped before narrowing, so a slot like 2**32+5
        is dropped instead of wrapping onto row 5.
        """
        arr: Any  # a tracer, a jax array or a host array
        if isinstance(loc, jax.core.Tracer):
            if check_bounds:
                raise ValueError(_NOT_CONCRETE)
            arr = loc
        elif isinstance(loc, jax.Array):
            arr = loc
        else:
            arr = self._host_slots(loc)
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise TypeError(f"loc: expected an integer array, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"loc: expected shape (T,), got {tuple(arr.shape)}")
        if check_bounds:
            host = np.asarray(arr)
            bad = np.flatnonzero((host < 0) | (host >= self.rows))
            if bad.size:
                i = int(bad[0])
                raise IndexError(
                    f"loc[{i}] = {int(host[i])} is outside the pool's rows [0, {self.rows})"
                )
        if isinstance(arr, np.ndarray) and (arr.dtype.itemsize > 4 or arr.dtype == np.uint32):
            arr = np.clip(arr, -1, self.rows).astype(np.int32)
        return arr

    def _host_slots(self, loc) -> np.ndarray:
        """`loc` given on the host (numpy, lists, Python ints) as a numpy array, or `TypeError` /
        `ValueError` naming `loc`. Python ints beyond int64 (an object array) are clipped to
        `[-1, rows]`, so they are dropped like any other out-of-range slot."""
        if loc is None or isinstance(loc, (str, bytes, dict, set)):
            raise TypeError(f"loc: expected an integer array of shape (T,), got {loc!r:.80}")
        try:
            arr = np.asarray(loc)
        except (TypeError, ValueError) as err:  # ragged nesting, objects numpy cannot hold
            raise ValueError(f"loc: expected an integer array of shape (T,), got {err}") from None
        if arr.dtype == object:
            flat = arr.reshape(-1)
            bad = [v for v in flat if not is_int(v)]
            if bad:
                raise TypeError(f"loc: expected integer slots, got an entry {bad[0]!r:.80}")
            clipped = [min(max(int(v), -1), self.rows) for v in flat]
            return np.array(clipped, np.int64).reshape(arr.shape)
        if arr.size == 0 and arr.dtype.kind == "f":  # `[]` is an empty slot list
            return arr.astype(np.int64)
        return arr

    @staticmethod
    def check_shape(arg: str, x, expected: tuple) -> None:
        """`ValueError` naming `arg` unless the shape of `x` (parts joined on the last axis
        when `x` is a tuple of arrays) is `expected`."""
        shape = _joined_shape(x)
        if shape != tuple(expected):
            want = "(" + ", ".join(str(d) for d in expected) + (",)" if len(expected) == 1 else ")")
            raise ValueError(f"{arg}: expected shape {want}, got {shape}")

    @staticmethod
    def check_scale(arg: str, scale) -> None:
        """A scale is None or a real scalar, finite and positive (a zero, negative, inf or NaN
        scale would store inf, NaN or flipped values). Host scales are checked by value; jax
        arrays by dtype and shape only (reading their value would wait for the device)."""
        if scale is None:
            return
        on_device = isinstance(scale, jax.Array)
        try:
            dtype, shape = (scale.dtype, scale.shape) if on_device else _host_scalar(scale)
        except (TypeError, ValueError):
            dtype, shape = None, ()
        if dtype is None or not (
            jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
        ):
            raise TypeError(f"{arg}: expected a real scalar scale, got {scale!r:.80}")
        if len(shape) != 0:
            raise ValueError(f"{arg}: expected a scalar scale, got shape {tuple(shape)}")
        if not on_device:
            value = float(np.asarray(scale))
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"{arg}: expected a finite positive scale, got {value!r}")

    # ---- the write path -----------------------------------------------------------------

    def write(self, layer_id: int, loc, writes, *, donate: bool = True, check_bounds: bool = False):
        """Applies `writes` (a sequence of `Write`) at slots `loc` of one layer; returns the new
        pool.

        Every value is checked against its buffer's row shape before anything runs, so a bad
        call changes nothing.
        """
        li = self.layer_index(layer_id)
        loc = self.prepare_loc(loc, check_bounds=check_bounds)
        specs = {s.key: s for s in self.buffer_specs()}
        n = int(loc.shape[0])
        writes = [w._replace(value=_as_array(w.value)) for w in writes]
        eager = not _kernels.tracing(writes)
        for i, w in enumerate(writes):
            spec = specs[w.key]
            parts = w.value if isinstance(w.value, tuple) else (w.value,)
            for (arg, tail), part in zip(w.part_shapes, parts):
                self.check_shape(arg, part, (n, *tail))
            for part in parts:
                _dtypes.check_value_dtype(part, w.arg)
            if w.scale is not None and not _dtypes.scale_applies(parts[0].dtype, self.dtype):
                writes[i] = w = w._replace(scale=None)
            self.check_shape(w.arg, w.value, (n, *spec.input_shape(w.value)))
            # Only where values are stored as their own bits can a host view stand in for them.
            stored_as_is = spec.value_shape is None and spec.codec.token_major
            if eager and stored_as_is:
                bits = tuple(_dtypes.host_bits(p, self.dtype) for p in parts)
                writes[i] = w._replace(value=bits if isinstance(w.value, tuple) else bits[0])
        attrs = [specs[w.key].attr for w in writes]
        new = _kernels.apply_writes(
            [self.layer_buffer(attr, li) for attr in attrs],
            loc,
            [w.value for w in writes],
            [w.scale for w in writes],
            [specs[w.key].codec for w in writes],
            donate=donate,
        )
        pool = self.replace_layer(li, dict(zip(attrs, new)))
        if donate and not _kernels.tracing(new):
            # The buffers went to `pool` (or, when XLA could not reuse them, were copied and
            # reported): either way this object is spent, so no read or stray update through
            # it can return stale rows or donate a buffer `pool` shares.
            self.mark_consumed()
        return pool

    def replace_layer(self, li: int, new_buffers: Mapping[str, jax.Array]):
        """A new pool with layer `li` of each buffer replaced (keyed by attribute)."""
        changes = {}
        for name, buf in new_buffers.items():
            layers = list(self.buffers(name))
            layers[li] = buf
            changes[name] = layers
        return self.with_buffers(**changes)

    def read_slots(self, key: str, layer_id: int, loc) -> jax.Array:
        """Stored entries of the buffer of part key `key` at slots `loc` (zero bits out of
        range), `(T, *row_shape)`, as its declared codec finds them."""
        buf = self.part_layer(key, layer_id)
        return _kernels.read_slots(self.spec(key).codec, buf, self.prepare_loc(loc))

    def read(self, key: str, layer_id: int) -> jax.Array:
        """The whole buffer of part key `key` of `layer_id` in the logical dtype.

        Eagerly always a new array, never the pool's own buffer (a float32 pool's buffer is
        already in the logical dtype): what a reader holds stays valid when a later update
        donates the buffer, as the bitcast of every other dtype does. Under a trace no copy is
        made (XLA fuses the view into its consumer).
        """
        buf = self.part_layer(key, layer_id)
        out = _dtypes.decode(buf, self.dtype)
        return jnp.copy(out) if out is buf and not isinstance(buf, jax.core.Tracer) else out


def _host_scalar(scale) -> tuple[np.dtype | None, tuple]:
    """`(dtype, shape)` of a host scale; dtype None for what is no real number (bools, text)."""
    if isinstance(scale, (bool, np.bool_, str, bytes)):
        return None, ()
    arr = np.asarray(scale)
    return arr.dtype, arr.shape


def _as_array(value):
    if isinstance(value, tuple):
        return tuple(_as_array(v) for v in value)
    return value if hasattr(value, "shape") else np.asarray(value)


def _joined_shape(value) -> tuple:
    """Shape of `value`, or of its parts joined on the last axis when it is a tuple."""
    if not isinstance(value, tuple):
        return tuple(np.shape(value))
    shapes = [tuple(np.shape(v)) for v in value]
    return (*shapes[0][:-1], sum(s[-1] for s in shapes))
