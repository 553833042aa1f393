"""KV pools: MHA (K and V), K-only, MLA (one latent row) and NSA (MLA plus fp8 indexer keys).

Each pool is an immutable pytree of per-layer buffers in `store_dtype`. Updates are functional:
they return a new pool and, eagerly, donate the buffers they replace (`donate=True`), so the
cost of a write grows with the tokens written, never with the pool. Under a donating `jax.jit`
they are in place. Slots outside `[0, size + page_size)` are dropped, never wrapped; the slots
of one update are distinct rows (scatters declare it, which keeps them at the device copy rate).

Example:
    >>> pool = MHAPool.create(size=64, head_num=2, head_dim=4, layer_num=1)
    >>> k = jnp.ones((3, 2, 4), jnp.bfloat16)
    >>> pool = pool.set_kv(0, jnp.array([1, 2, 3]), k, k)
    >>> pool.get_key_buffer(0)[1, 0, 0]
    Array(1, dtype=bfloat16)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxkv import _dtypes, _kernels, _packed_fp8
from jaxkv._buffers import Layers, Rows, buffer
from jaxkv._create import CreateArgs, common_create
from jaxkv._pool_base import PoolBase, Write
from jaxkv._sharding import HEADS

if TYPE_CHECKING:  # typing's own from 3.11 on; annotations only (never evaluated)
    from typing_extensions import Unpack

__all__ = ["MHAPool", "KOnlyPool", "MLAPool", "NSAPool"]

# Constructors and setters return a pool of the class they were called on.
_P = TypeVar("_P", bound=PoolBase)
_K = TypeVar("_K", bound="_KeyedPool")
_L = TypeVar("_L", bound="_LatentPool")

_NO_V_READ = "{cls} does not allocate V: it stores K only; use get_key_buffer({layer})"
_NO_V_WRITE = (
    "{cls} does not store V: write K rows with set_k(layer_id, loc, cache_k, k_scale=None)"
)


class _KeyedPool(PoolBase):
    """Pools whose K rows live in the buffer of part key `KEY_PART`; `set_k` and
    `get_key_buffer` are shared."""

    KEY_PART: ClassVar[str]

    def get_key_buffer(self, layer_id: int) -> jax.Array:
        """The whole K buffer of `layer_id` (MLA/NSA: the latent rows), logical dtype."""
        return self.read(self.KEY_PART, layer_id)

    def set_k(
        self: _K,
        layer_id: int,
        loc: ArrayLike,
        cache_k: ArrayLike,
        k_scale: ArrayLike | None = None,
        *,
        donate: bool = True,
        check_bounds: bool = False,
    ) -> _K:
        """Writes K rows only: `cache_k (T, *row)` into rows `loc (T,)`.

        Args:
            layer_id: global layer id in `range(start_layer, start_layer + layer_num)`.
            loc: int slots `(T,)`, distinct within one call; entries outside
                `[0, size + page_size)` are dropped (so `-1` pads). A slot repeated in one call
                leaves that row holding one of its tokens' values (on accelerators possibly
                mixed element by element); no other row is touched.
            cache_k: any float array, converted to the pool dtype (fp8 saturates, inf
                included; NaN is stored as NaN).
            k_scale: optional finite positive scalar; `cache_k / k_scale` is stored.
            donate: eagerly, hand the replaced buffer to the new pool (O(T)) and consume this
                one (`ConsumedPoolError` on any later use; `CopyWarning` when a view held
                outside JAX forced a full copy); `False` keeps the old pool readable at O(pool)
                cost.
            check_bounds: eagerly, raise `IndexError` on the first out-of-range slot.

        Returns:
            The new pool, of this pool's type, shapes and sharding.

        Raises:
            IndexError: `layer_id` outside the pool's layers, or (with `check_bounds`) a slot
                outside `[0, size + page_size)`.
            ValueError: a value or `loc` of the wrong shape, or a scale that is not finite and
                positive.
            TypeError: values that are not real numbers, non-integer `loc`, or a scale that is
                not a real scalar.
            ConsumedPoolError: this pool was consumed by an earlier update.
        """
        self.check_scale("k_scale", k_scale)
        write = Write(self.KEY_PART, "cache_k", cache_k, self._applied_scale(k_scale))
        return self.write(layer_id, loc, [write], donate=donate, check_bounds=check_bounds)

    def _applied_scale(self, k_scale):
        """The (checked) scale the key rows are divided by: `k_scale` itself here."""
        return k_scale


# The part keys, each stated once: a buffer's declaration and the setters and readers that name
# the buffer use these (the connector's blocks carry each buffer under its key).
K, V, KV, INDEX_K = "k", "v", "kv", "index_k"


class _HeadPool(_KeyedPool):
    """Rows of `head_num` heads per token. Heads are independent, so a `sharding` may split
    the heads axis over a tensor-parallel mesh axis, as SGLang's ranks hold `head_num / tp`."""

    KEY_PART = K
    head_num: int
    head_dim: int
    k_buffer: Layers = buffer(key=K, rows=lambda p: p.head_rows(p.head_dim), shard=HEADS)

    def head_rows(self, head_dim: int) -> Rows:
        """Token-major rows of `head_num` heads of `head_dim` values, stored as the pool's
        `store_dtype`."""
        return Rows((self.head_num, head_dim), self.store_dtype, _kernels.RowCodec(self.dtype))

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """`(k_bytes, v_bytes)` over every layer (K-only: `v_bytes == 0`)."""
        return self.part_bytes(K), self.part_bytes(V)


class MHAPool(_HeadPool):
    """Multi-head attention pool: `k_buffer[l] (rows, head_num, head_dim)` and `v_buffer[l]
    (rows, head_num, v_head_dim)` per layer, `rows = size + page_size`."""

    KIND = "mha"
    v_head_dim: int
    v_buffer: Layers = buffer(key=V, rows=lambda p: p.head_rows(p.v_head_dim), shard=HEADS)

    @classmethod
    @common_create(page_size=1)
    def create(
        cls: type[_P],
        *,
        head_num: int,
        head_dim: int,
        v_head_dim: int | None = None,
        **common: Unpack[CreateArgs],
    ) -> _P:
        """Allocates a zeroed MHA pool. The arguments every kind takes, what `create` returns
        and raises: see `PoolBase`.

        Args:
            head_num: K and V heads per token.
            head_dim: values per K head.
            v_head_dim: values per V head (`None`: `head_dim`).

        Example:
            >>> pool = MHAPool.create(size=4, head_num=2, head_dim=8, layer_num=1, v_head_dim=4)
            >>> pool.k_buffer[0].shape, pool.v_buffer[0].shape
            ((5, 2, 8), (5, 2, 4))
        """
        if v_head_dim is None:
            v_head_dim = head_dim
        return cls._build(locals())  # every argument, by name (`common`: the shared ones)

    def get_value_buffer(self, layer_id: int) -> jax.Array:
        return self.read(V, layer_id)

    def get_kv_buffer(self, layer_id: int) -> tuple[jax.Array, jax.Array]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv(
        self,
        layer_id: int,
        loc: ArrayLike,
        cache_k: ArrayLike,
        cache_v: ArrayLike,
        k_scale: ArrayLike | None = None,
        v_scale: ArrayLike | None = None,
        *,
        donate: bool = True,
        check_bounds: bool = False,
    ) -> MHAPool:
        """Writes `cache_k (T, head_num, head_dim)` and `cache_v (T, head_num, v_head_dim)` at
        `loc (T,)` in one call (all or nothing).

        Args:
            layer_id, loc, donate, check_bounds: as for `set_k`.
            cache_k, cache_v: K and V rows, any real dtype, converted to the pool dtype.
            k_scale, v_scale: optional finite positive scalars dividing `cache_k`, `cache_v`.

        Returns:
            The new pool.

        Raises:
            IndexError, ValueError, TypeError, ConsumedPoolError: as for `set_k`.
        """
        self.check_scale("k_scale", k_scale)
        self.check_scale("v_scale", v_scale)
        writes = [
            Write(K, "cache_k", cache_k, k_scale),
            Write(V, "cache_v", cache_v, v_scale),
        ]
        return self.write(layer_id, loc, writes, donate=donate, check_bounds=check_bounds)


class KOnlyPool(_HeadPool):
    """K-only pool (SGLang's `MHATokenToKOnlyPool`, MiniMax sparse index layers):
    `k_buffer[l] (rows, head_num, head_dim)` and no `v_buffer` attribute at all."""

    KIND = "k_only"

    @classmethod
    @common_create(page_size=1)
    def create(cls: type[_P], *, head_num: int, head_dim: int, **common: Unpack[CreateArgs]) -> _P:
        """Allocates a zeroed K-only pool, with no V buffer at all. The arguments every kind
        takes, what `create` returns and raises: see `PoolBase`.

        Args:
            head_num: K heads per token.
            head_dim: values per K head.

        Example:
            >>> pool = KOnlyPool.create(size=8, page_size=4, head_num=1, head_dim=16, layer_num=2)
            >>> len(pool.k_buffer), pool.k_buffer[0].shape, hasattr(pool, "v_buffer")
            (2, (12, 1, 16), False)
        """
        return cls._build(locals())  # every argument, by name (`common`: the shared ones)

    def get_value_buffer(self, layer_id: int):
        raise NotImplementedError(_NO_V_READ.format(cls=type(self).__name__, layer=layer_id))

    def get_kv_buffer(self, layer_id: int):
        raise NotImplementedError(_NO_V_READ.format(cls=type(self).__name__, layer=layer_id))

    def set_kv(self, layer_id, loc, cache_k, cache_v=None, k_scale=None, v_scale=None, **kw):
        """Not available: a K-only pool stores no V.

        Raises:
            NotImplementedError: always, naming `set_k` (which writes K rows).
        """
        raise NotImplementedError(_NO_V_WRITE.format(cls=type(self).__name__))


class _LatentPool(_KeyedPool):
    """MLA latent rows: `kv_buffer[l] (rows, 1, kv_lora_rank + qk_rope_head_dim)`. One latent
    row serves every head, so a `sharding` places it whole (replicated over tensor-parallel
    devices), never splits it."""

    KEY_PART = KV
    kv_lora_rank: int
    qk_rope_head_dim: int
    kv_buffer: Layers = buffer(key=KV, rows=lambda p: p.latent_rows())

    def latent_rows(self) -> Rows:
        """One latent row per token, `(1, kv_lora_rank + qk_rope_head_dim)`, stored as the
        pool's `store_dtype`."""
        row = (1, self.kv_lora_rank + self.qk_rope_head_dim)
        return Rows(row, self.store_dtype, _kernels.RowCodec(self.dtype))

    def get_value_buffer(self, layer_id: int) -> jax.Array:
        """The `[..., :kv_lora_rank]` part of the latent rows (SGLang's V view)."""
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[jax.Array, jax.Array]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_mla_kv(self, layer_id: int, loc: ArrayLike) -> tuple[jax.Array, jax.Array]:
        """`(k_nope (T, 1, kv_lora_rank), k_rope (T, 1, qk_rope_head_dim))` at slots `loc`;
        out-of-range slots read as zeros."""
        rows = self._decode_rows(self.read_slots(KV, layer_id, loc))
        return rows[..., : self.kv_lora_rank], rows[..., self.kv_lora_rank :]

    def _decode_rows(self, bits: jax.Array) -> jax.Array:
        """Stored latent rows -> the values readers return (here: the logical dtype)."""
        return _dtypes.decode(bits, self.dtype)

    def _check_parts(self, k_nope, k_rope) -> None:
        """Refuses `set_mla_kv` parts this layout cannot store (none here)."""

    def set_kv(
        self: _L,
        layer_id: int,
        loc: ArrayLike,
        cache_k: ArrayLike,
        cache_v: ArrayLike | None = None,
        k_scale: ArrayLike | None = None,
        v_scale: ArrayLike | None = None,
        *,
        donate: bool = True,
        check_bounds: bool = False,
    ) -> _L:
        """Stores the latent rows `cache_k (T, 1, kv_lora_rank + qk_rope_head_dim)`; `cache_v`
        and `v_scale` are ignored (K and V share the latent row, as in SGLang).

        Args:
            layer_id, loc, cache_k, k_scale, donate, check_bounds: as for `set_k`.
            cache_v, v_scale: ignored.

        Returns:
            The new pool.

        Raises:
            IndexError, ValueError, TypeError, ConsumedPoolError: as for `set_k`.
        """
        del cache_v, v_scale
        return self.set_k(layer_id, loc, cache_k, k_scale, donate=donate, check_bounds=check_bounds)

    def set_mla_kv(
        self: _L,
        layer_id: int,
        loc: ArrayLike,
        k_nope: ArrayLike,
        k_rope: ArrayLike,
        *,
        donate: bool = True,
        check_bounds: bool = False,
    ) -> _L:
        """Writes `k_nope (T, 1, kv_lora_rank)` and `k_rope (T, 1, qk_rope_head_dim)` as one
        latent row per token.

        Args:
            layer_id, loc, donate, check_bounds: as for `set_k`.
            k_nope, k_rope: the two parts of each latent row, any real dtype.

        Returns:
            The new pool.

        Raises:
            IndexError, ValueError, TypeError, ConsumedPoolError: as for `set_k`.
        """
        self._check_parts(k_nope, k_rope)
        shapes = (("k_nope", (1, self.kv_lora_rank)), ("k_rope", (1, self.qk_rope_head_dim)))
        write = Write(KV, "k_nope/k_rope", (k_nope, k_rope), part_shapes=shapes)
        return self.write(layer_id, loc, [write], donate=donate, check_bounds=check_bounds)


class MLAPool(_LatentPool):
    """Multi-head latent attention pool (DeepSeek): one latent row per token and layer."""

    KIND = "mla"

    @classmethod
    @common_create(page_size=1)
    def create(
        cls: type[_P],
        *,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        **common: Unpack[CreateArgs],
    ) -> _P:
        """Allocates a zeroed MLA pool: one latent row per token and layer. The arguments
        every kind takes, what `create` returns and raises: see `PoolBase`.

        Args:
            kv_lora_rank: values of the latent part of a row.
            qk_rope_head_dim: values of the rope part of a row.

        Example:
            >>> pool = MLAPool.create(size=4, kv_lora_rank=8, qk_rope_head_dim=2, layer_num=1)
            >>> pool.kv_buffer[0].shape, pool.get_kv_size_bytes()
            ((5, 1, 10), 100)
        """
        return cls._build(locals())  # every argument, by name (`common`: the shared ones)


class NSAPool(_LatentPool):
    """Native sparse attention pool (DeepSeek V3.2): MLA latent rows plus, per layer,
    `index_k_with_scale_buffer[l]` uint8 `(pages, page_size * (index_head_dim + 4))`: each page
    holds its tokens' fp8-e4m3 index keys, then one little-endian float32 scale per token.

    With an fp8 `dtype` (either one) the latent rows are SGLang's packed fp8 rows instead,
    the layout FlashMLA reads: `kv_buffer[l]` uint8 `(rows, 1, kv_lora_rank + 4 *
    (kv_lora_rank // 128) + 2 * qk_rope_head_dim)` (656 bytes for 512 + 64), holding the latent
    as fp8-e4m3 codes in tiles of 128 values, one float32 scale per tile (`amax / 448`), then
    the rope part as bfloat16. Setters quantise, readers dequantise to float32. SGLang itself
    packs only for float8_e4m3fn (an e5m2 pool there keeps plain e5m2 rows); here an e5m2 pool
    packs too, its tiles being e4m3 like every packed row. There `set_k` and `set_kv` also take
    raw packed rows, uint8 `(T, 1, width)`, and store them as they are; `k_scale` is checked
    but not applied (each tile carries its own scale, and SGLang's packed writer takes no
    other); `set_mla_kv` refuses uint8 parts (whole packed rows go to `set_k`).
    """

    KIND = "nsa"
    index_head_dim: int
    index_k_with_scale_buffer: Layers = buffer(
        key=INDEX_K, rows=lambda p: p.index_rows(), codec=_kernels.IndexCodec
    )

    @classmethod
    @common_create(page_size=64)
    def create(
        cls: type[_P],
        *,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        index_head_dim: int = 128,
        **common: Unpack[CreateArgs],
    ) -> _P:
        """Allocates a zeroed NSA pool: MLA's latent rows plus indexer keys packed per page.
        The arguments every kind takes, what `create` returns and raises: see `PoolBase`.

        Args:
            kv_lora_rank: values of the latent part of a row (with an fp8 `dtype`, a multiple
                of 128: the packed row quantises it in tiles of 128).
            qk_rope_head_dim: values of the rope part of a row.
            index_head_dim: values per indexer key.
            page_size: tokens per page, by default 64 (SGLang's for NSA).

        Example:
            >>> pool = NSAPool.create(size=64, kv_lora_rank=8, qk_rope_head_dim=2, layer_num=1)
            >>> pool.kv_buffer[0].shape, pool.index_k_with_scale_buffer[0].shape
            ((128, 1, 10), (2, 8448))
        """
        return cls._build(locals())  # every argument, by name (`common`: the shared ones)

    def check_sizes(self) -> None:
        if self.packed_fp8:
            _packed_fp8.check_rank(self.kv_lora_rank, self.dtype)

    @property
    def packed_fp8(self) -> bool:
        """Whether `kv_buffer` holds SGLang's packed fp8 rows (any fp8 `dtype`)."""
        return _dtypes.is_fp8(self.dtype)

    def latent_rows(self) -> Rows:
        """As MLA's, or with an fp8 `dtype` SGLang's packed rows: uint8 `(1, width)`, written
        from floats of the latent's shape."""
        if not self.packed_fp8:
            return super().latent_rows()
        codec = self._packed_codec()
        value = (1, self.kv_lora_rank + self.qk_rope_head_dim)
        return Rows((1, codec.width), jnp.dtype(jnp.uint8), codec, value)

    def _packed_codec(self) -> _packed_fp8.PackedFp8Codec:
        return _packed_fp8.PackedFp8Codec(self.dtype, self.kv_lora_rank, self.qk_rope_head_dim)

    def index_rows(self) -> Rows:
        """A token's index record: `index_head_dim` fp8 key bytes then a 4-byte scale, packed
        into its page; written from float keys `(index_head_dim,)`."""
        row = (self.index_head_dim + 4,)
        return Rows(row, jnp.dtype(jnp.uint8), self._index_codec(), (self.index_head_dim,))

    def _index_codec(self) -> _kernels.IndexCodec:
        return _kernels.IndexCodec(self.page_size, self.index_head_dim)

    def _decode_rows(self, bits: jax.Array) -> jax.Array:
        if not self.packed_fp8:
            return super()._decode_rows(bits)
        return _packed_fp8.dequantize(self._packed_codec(), bits)

    def get_key_buffer(self, layer_id: int) -> jax.Array:
        """The whole latent buffer of `layer_id`: `(rows, 1, kv_lora_rank + qk_rope_head_dim)`
        in the logical dtype, or, for packed fp8 rows, dequantised to float32 (`code * scale`
        in float32; casting it to bfloat16 gives SGLang's `dequantize_k_cache`)."""
        if not self.packed_fp8:
            return super().get_key_buffer(layer_id)
        return self._decode_rows(self.part_layer(KV, layer_id))

    def _applied_scale(self, k_scale):
        # Packed fp8 rows carry a scale per tile and SGLang's packed writer takes no other:
        # `k_scale` is checked but not applied there.
        return None if self.packed_fp8 else k_scale

    def _check_parts(self, k_nope, k_rope) -> None:
        if self.packed_fp8:
            for arg, part in (("k_nope", k_nope), ("k_rope", k_rope)):
                if getattr(part, "dtype", None) == jnp.uint8:
                    raise ValueError(
                        f"{arg}: uint8 raw bits cannot be split into parts of a packed fp8 row; "
                        "pass float values, or whole packed rows uint8 (T, 1, "
                        f"{self.spec(KV).row_shape[-1]}) to set_k"
                    )

    def get_index_k(self, layer_id: int, loc: ArrayLike) -> jax.Array:
        """Dequantised index keys float32 `(T, index_head_dim)` at slots `loc`."""
        records = self.read_slots(INDEX_K, layer_id, loc)
        return self._index_codec().dequantize(records)

    def set_index_k(
        self,
        layer_id: int,
        loc: ArrayLike,
        index_k: ArrayLike,
        *,
        donate: bool = True,
        check_bounds: bool = False,
    ) -> NSAPool:
        """Quantises `index_k (T, index_head_dim)` per token to fp8-e4m3 with scale
        `max(amax, 1e-4) / 448` (SGLang's floor) and packs keys and scales into each slot's
        page. `amax` covers the token's finite keys: an inf key saturates to the code +-448 and
        a NaN stays in its own key, never spoiling the others.

        Args:
            layer_id, loc, donate, check_bounds: as for `set_k`.
            index_k: the index keys, any real dtype, `(T, index_head_dim)`.

        Returns:
            The new pool.

        Raises:
            IndexError: `layer_id` outside the pool's layers, or (with `check_bounds`) a slot
                outside the pool.
            ValueError: `index_k` or `loc` of the wrong shape.
            TypeError: `index_k` that is not real numbers, or non-integer `loc`.
            ConsumedPoolError: this pool was consumed by an earlier update.
        """
        write = Write(INDEX_K, "index_k", index_k)
        return self.write(layer_id, loc, [write], donate=donate, check_bounds=check_bounds)
