"""SGLang's packed fp8 latent row for NSA pools (DeepSeek V3.2, the layout FlashMLA reads).

One token's row is `kv_lora_rank + 4 * (kv_lora_rank // 128) + 2 * qk_rope_head_dim` bytes
(656 for 512 + 64), little-endian:

    [ latent as fp8-e4m3 codes | one float32 scale per tile of 128 | rope as bfloat16 ]

Each tile of 128 latent values is quantised the way SGLang's NSA pool writer does it (its
Triton kernel behind `quantize_k_cache_separate`), in float32:

    scale = amax / 448                   (amax = max |x| over the tile; no floor)
    code  = fp8_e4m3(clip(x * (1 / scale), -448, 448))     (round to nearest even)

so a reader gets `code * scale` back. Three choices of ours where SGLang's kernel has none:

* A tile whose scale is zero (all zeros) keeps its zeros, signs included, where SGLang
  computes `0 * (1 / 0)`, a NaN (its GPU kernel then clamps that to a backend-dependent code).
  Any `0 * inf` of the product is taken as a zero of the value's sign.
* Casts saturate, as every fp8 cast in jaxkv does: the rope part is cast to bfloat16 with
  magnitudes above bfloat16's largest finite value (inf included) set to it, so a finite input
  never turns into inf or NaN. SGLang's inputs are bfloat16 already: there is no difference
  for them.
* Non-finite latent values never spoil their tile: the tile's amax is taken over its finite
  values, an inf is stored as the code +-448 (it reads back as the tile's largest finite
  magnitude: saturated) and a NaN stays NaN in its own element. SGLang's amax would be inf or
  NaN and turn every value of the tile into NaN. Latent values beyond float32's range (float64
  inputs; JAX without x64 holds float32) arrive as inf and saturate the same way.

Quotients go through `_dtypes.divide` and products through `_dtypes.multiply`, so scales,
codes and read-back values are the same float32 bits on every backend (subnormals as zeros,
one quiet NaN).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _dtypes, _kernels

TILE = 128
_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


def _saturate(x: jax.Array, limit: float) -> jax.Array:
    """`x` in float32 with magnitudes above `limit` (inf included) set to +-`limit`, so a later
    cast never turns a finite input into inf or NaN. A select, not `jnp.clip`: XLA:CPU's min
    and max flush subnormals, which bfloat16 can hold."""
    x = x.astype(jnp.float32)
    return jnp.where(jnp.abs(x) > limit, jnp.copysign(jnp.float32(limit), x), x)


def packed_width(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Bytes of one packed row: fp8 latent, one float32 scale per tile, bfloat16 rope."""
    return kv_lora_rank + 4 * (kv_lora_rank // TILE) + 2 * qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class PackedFp8Codec(_kernels.RowCodec):
    """Token-major uint8 rows `(rows, 1, packed_width)`: slot `s` is row `s`, as for any
    `RowCodec` (the connector moves them as raw rows), but values are quantised on write.

    `dtype` is the pool's logical fp8 dtype; the latent codes are fp8-e4m3 whichever it is.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def width(self) -> int:
        return packed_width(self.kv_lora_rank, self.qk_rope_head_dim)

    def encode(self, values) -> jax.Array:
        """Packed rows uint8 `(T, 1, width)` from a float latent row `(T, 1, rank + rope)`, from
        `(k_nope, k_rope)` parts, or from raw packed rows (uint8, stored as they are)."""
        if isinstance(values, tuple):
            return self.quantize(*values)
        if values.dtype == jnp.uint8:
            return values
        return self.quantize(values[..., : self.kv_lora_rank], values[..., self.kv_lora_rank :])

    def quantize(self, k_nope: jax.Array, k_rope: jax.Array) -> jax.Array:
        """`k_nope (..., kv_lora_rank)` and `k_rope (..., qk_rope_head_dim)`, any float dtype,
        -> packed rows uint8 `(..., width)`."""
        lead = k_nope.shape[:-1]
        # An inf stays out of the tile's amax and lands on the code +-448 (clipped below).
        x = k_nope.astype(jnp.float32).reshape(*lead, -1, TILE)
        scale = _dtypes.divide(_kernels.finite_amax(x), _kernels.FP8_E4M3_MAX)
        inverse = _dtypes.divide(jnp.ones_like(scale), scale)
        q = _dtypes.multiply(x, jnp.broadcast_to(inverse, x.shape))
        # 0 * inf (a zero tile's scale is 0): a zero of x's sign, where SGLang gets NaN.
        q = jnp.where(jnp.isnan(q) & ~jnp.isnan(x), jnp.copysign(jnp.zeros_like(x), x), q)
        q = jnp.clip(q, -_kernels.FP8_E4M3_MAX, _kernels.FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
        rope = _saturate(k_rope, _BF16_MAX).astype(jnp.bfloat16)
        parts = (
            jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(*lead, -1),
            jax.lax.bitcast_convert_type(scale[..., 0], jnp.uint8).reshape(*lead, -1),
            jax.lax.bitcast_convert_type(rope, jnp.uint8).reshape(*lead, -1),
        )
        return jnp.concatenate(parts, axis=-1)

    def dequantize(self, rows: jax.Array) -> jax.Array:
        """Packed rows uint8 `(..., width)` -> float32 `(..., kv_lora_rank + rope)`:
        `code * scale` per latent value (float32), then the rope values.

        Rounding this to bfloat16 gives what SGLang's `dequantize_k_cache` returns.
        """
        lead, rank = rows.shape[:-1], self.kv_lora_rank
        tiles = rank // TILE
        codes = jax.lax.bitcast_convert_type(rows[..., :rank], jnp.float8_e4m3fn)
        codes = codes.astype(jnp.float32).reshape(*lead, tiles, TILE)
        scale_bytes = rows[..., rank : rank + 4 * tiles].reshape(*lead, tiles, 4)
        scale = jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)
        nope = _dtypes.multiply(codes, scale[..., None]).reshape(*lead, rank)
        rope_bytes = rows[..., rank + 4 * tiles :].reshape(*lead, self.qk_rope_head_dim, 2)
        rope = jax.lax.bitcast_convert_type(rope_bytes, jnp.bfloat16).astype(jnp.float32)
        return jnp.concatenate([nope, rope], axis=-1)

    def write(self, buf: jax.Array, loc: jax.Array, values, scale) -> jax.Array:
        del scale  # every tile carries its own scale; SGLang's writer takes no other
        return self.load(buf, loc, self.encode(values))


_dequantize = jax.jit(lambda codec, rows: codec.dequantize(rows), static_argnums=0)


def dequantize(codec: PackedFp8Codec, rows: jax.Array) -> jax.Array:
    """`codec.dequantize(rows)` as one compiled call (inlined when already tracing)."""
    return _dequantize(codec, rows)


def check_rank(kv_lora_rank: int, dtype: np.dtype) -> None:
    """An fp8 NSA pool packs the latent in tiles of 128 values: the rank must fill them."""
    if kv_lora_rank % TILE:
        raise ValueError(
            f"kv_lora_rank: expected a multiple of {TILE} for an NSA pool of dtype "
            f"{jnp.dtype(dtype).name} (its latent is packed in fp8 tiles of {TILE} values, "
            f"SGLang's layout), got {kv_lora_rank}; use a 16- or 32-bit dtype for other ranks"
        )
