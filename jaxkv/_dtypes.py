"""Logical and storage dtypes of KV pools, and the casts between them.

Pools keep 16- and 8-bit floats as raw unsigned bits: on XLA:CPU a scatter into a bf16 or fp8
buffer rewrites the whole buffer even when donated, while the same scatter into the unsigned
integer of the same width is O(tokens) (REFERENCE.md). Raw bits also export through DLPack,
which rejects bf16 and fp8. Every cast lives here so the pools and the connector agree on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Logical dtype -> storage dtype. float32 is stored as itself: its scatters are already O(T).
_STORE = {
    jnp.dtype(jnp.float32): jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
    jnp.dtype(jnp.float16): jnp.dtype(jnp.uint16),
    jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8),
    jnp.dtype(jnp.float8_e5m2): jnp.dtype(jnp.uint8),
}

SUPPORTED_DTYPES = tuple(_STORE)


def canonical_dtype(dtype, *, arg: str = "dtype") -> np.dtype:
    """Returns the supported logical dtype named by `dtype` or raises `ValueError`."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError as err:
        raise ValueError(f"{arg}: expected a float dtype, got {dtype!r}") from err
    if dt not in _STORE:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise ValueError(f"{arg}: expected one of {names}, got {dt.name}")
    return dt


def store_dtype_of(dtype: np.dtype) -> np.dtype:
    """The dtype a pool of logical `dtype` keeps in its buffers."""
    return _STORE[jnp.dtype(dtype)]


def is_fp8(dtype: np.dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1


def encode(values: jax.Array, dtype: np.dtype, scale: jax.Array | None = None) -> jax.Array:
    """Casts `values` to logical `dtype` (dividing by `scale` first) and returns the stored bits.

    Values already in `dtype` without a scale are bitcast untouched, so round trips are
    bit-exact; values in the pool's unsigned `store_dtype` are taken as raw bits (SGLang's
    `store_dtype` view) and stored as they are. Casts into fp8 saturate to the largest finite
    value: XLA's plain cast would turn 1000.0 into NaN (e4m3fn) or 1e6 into inf (e5m2).
    """
    dtype = jnp.dtype(dtype)
    store = store_dtype_of(dtype)
    if store != dtype and values.dtype == store:
        if scale is not None:
            raise ValueError("a scale cannot apply to raw-bit values in the store dtype")
        return values
    if scale is not None or values.dtype != dtype:
        x = values
        if scale is not None:
            x = divide(x, scale)
        if is_fp8(dtype):
            limit = float(jnp.finfo(dtype).max)
            x = jnp.clip(x.astype(jnp.float32), -limit, limit)
        values = x.astype(dtype)
    return values if store == dtype else jax.lax.bitcast_convert_type(values, store)


def divide(x, y) -> jax.Array:
    """The IEEE float32 quotient `x / y`, with `y` broadcast to the shape of `x`.

    XLA's simplifier rewrites a division by a broadcast (a scalar scale, a per-token amax, a
    constant) as a multiplication by the reciprocal, which is one ulp off for about half of all
    inputs; hiding the broadcast behind a barrier keeps the exact quotient the API promises.
    """
    x = jnp.asarray(x, jnp.float32)
    y = jnp.broadcast_to(jnp.asarray(y, jnp.float32), x.shape)
    return x / jax.lax.optimization_barrier(y)


def decode(bits: jax.Array, dtype: np.dtype) -> jax.Array:
    """Views stored bits as logical `dtype` (identity for float32 pools)."""
    dtype = jnp.dtype(dtype)
    return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def host_bits(x, dtype):
    """`x` as a zero-copy host view of its raw bits, when that is cheaper than a device cast.

    On XLA:CPU a bf16 -> uint16 bitcast inside a jitted call is an elementwise pass (about
    80 us for 512 KiB here), while numpy views the same bytes for free. So an eager write of
    values already in the pool's 16- or 8-bit dtype sends their bits from a host view. Returns
    `x` unchanged when that does not apply (other dtypes, tracers, arrays on accelerators).
    """
    store = store_dtype_of(dtype)
    if store == jnp.dtype(dtype) or getattr(x, "dtype", None) != jnp.dtype(dtype):
        return x
    if isinstance(x, np.ndarray):
        return x.view(store)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        devices = x.sharding.device_set
        if len(devices) == 1 and next(iter(devices)).platform == "cpu":
            return np.asarray(x).view(store)
    return x


def check_value_dtype(x, arg: str) -> None:
    """Rejects values that are not real numbers (bool and complex have no KV meaning)."""
    dt = jnp.dtype(x.dtype)
    if not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
        raise TypeError(f"{arg}: expected a float array, got dtype {dt.name}")


def bits_dtype(dtype) -> np.dtype:
    """The dtype that carries `dtype`'s raw bits through numpy and DLPack.

    16- and 8-bit floats become the unsigned integer of their width (DLPack and numpy reject
    bf16 and fp8); every other dtype is carried as itself.
    """
    dt = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.floating) and dt.itemsize <= 2:
        return jnp.dtype(f"uint{8 * dt.itemsize}")
    return dt


def to_bits(x: jax.Array) -> jax.Array:
    dt = bits_dtype(x.dtype)
    return x if dt == x.dtype else jax.lax.bitcast_convert_type(x, dt)


def from_bits(bits: jax.Array, dtype) -> jax.Array:
    dt = jnp.dtype(dtype)
    return bits if bits.dtype == dt else jax.lax.bitcast_convert_type(bits, dt)
