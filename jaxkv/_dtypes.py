"""Logical and storage dtypes of KV pools, and the casts between them.

Pools keep 16- and 8-bit floats as raw unsigned bits: on XLA:CPU a scatter into a bf16 or fp8
buffer rewrites the whole buffer even when donated, while the same scatter into the unsigned
integer of the same width is O(tokens). Raw bits also export through DLPack,
which rejects bf16 and fp8. Every cast lives here so the pools and the connector agree on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The logical dtypes a pool may have. Each is stored as `bits_dtype` of itself: float32 as
# itself (its scatters are already O(T)), 16- and 8-bit floats as raw unsigned bits.
SUPPORTED_DTYPES = tuple(
    jnp.dtype(d)
    for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)
)


def canonical_dtype(dtype, *, arg: str = "dtype") -> np.dtype:
    """Returns the supported logical dtype named by `dtype` or raises `ValueError`."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError as err:
        raise ValueError(f"{arg}: expected a float dtype, got {dtype!r}") from err
    if dt not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise ValueError(f"{arg}: expected one of {names}, got {dt.name}")
    return dt


def store_dtype_of(dtype: np.dtype) -> np.dtype:
    """The dtype a pool of logical `dtype` keeps in its buffers (its raw bits' dtype)."""
    return bits_dtype(dtype)


def is_fp8(dtype: np.dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1


def encode(values: jax.Array, dtype: np.dtype, scale: jax.Array | None = None) -> jax.Array:
    """Casts `values` to logical `dtype` and returns the stored bits.

    Values already in `dtype` without a scale are bitcast untouched, so round trips are
    bit-exact, and values in the pool's unsigned `store_dtype` are taken as raw bits (SGLang's
    `store_dtype` view). Callers drop the scale of values the caller passed in the pool dtype
    (`scale_applies`): by then a float64 input may already be float32 on the device. Casts into
    fp8 saturate to the largest finite value: XLA's plain cast would turn 1000.0 into NaN
    (e4m3fn) or 1e6 into inf (e5m2).
    """
    dtype = jnp.dtype(dtype)
    store = store_dtype_of(dtype)
    if store != dtype and values.dtype == store:
        return values
    if scale is not None or values.dtype != dtype:
        x = values
        if scale is not None:
            # SGLang divides the value in its own dtype (torch computes a 16-bit quotient in
            # float32 and rounds it to 16 bits), then casts; the same two roundings here.
            narrow = jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4
            x = divide(x, scale)
            if narrow:
                x = x.astype(values.dtype)
        if is_fp8(dtype):
            limit = float(jnp.finfo(dtype).max)
            x = jnp.clip(x.astype(jnp.float32), -limit, limit)
        values = x.astype(dtype)
    return values if store == dtype else jax.lax.bitcast_convert_type(values, store)


_TINY = float(np.finfo(np.float32).tiny)
_QUIET_NAN = np.uint32(0x7FC00000)
# Veltkamp's splitting constant for float32 (24-bit significands): 2**12 + 1.
_SPLIT = 4097.0


def scale_applies(value_dtype, dtype) -> bool:
    """Whether a scale divides a value of `value_dtype` written into a pool of logical `dtype`.

    SGLang divides only when it converts the value to the pool dtype: a value already in the
    pool dtype, or raw bits in its store dtype, is stored as it is.
    """
    return jnp.dtype(value_dtype) not in (jnp.dtype(dtype), store_dtype_of(dtype))


def _flush(x: jax.Array) -> jax.Array:
    """Subnormals -> zero of the same sign; everything else (NaN and inf included) as is."""
    return jnp.where(jnp.abs(x) < _TINY, jnp.copysign(jnp.zeros_like(x), x), x)


def canonical(x: jax.Array) -> jax.Array:
    """A float32 result with the bits every backend agrees on: subnormals as zeros of their
    sign, every NaN as the quiet NaN `0x7FC00000`.

    Backends differ exactly there: XLA:CPU flushes subnormal inputs and results, XLA:GPU keeps
    them; a NaN's sign and payload are whatever the hardware propagates (x86 keeps an operand's,
    NVIDIA GPUs produce `0x7FFFFFFF`). The NaN test is on the integer bits, which no simplifier
    folds away.
    """
    bits = _bits(_flush(x))
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return jax.lax.bitcast_convert_type(jnp.where(nan, _QUIET_NAN, bits), jnp.float32)


def multiply(x, y) -> jax.Array:
    """The IEEE float32 product `x * y` with the same bits on every backend: subnormal inputs
    and results are zeros of their sign, NaN is `0x7FC00000` (see `canonical`)."""
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    return canonical(_flush(x) * _flush(y))


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    # Veltkamp: a == hi + lo exactly, each with at most 12 significant bits, so a product of
    # two halves is exact in float32. The barrier keeps XLA from folding `t - (t - a)` away.
    t = _SPLIT * a
    hi = t - jax.lax.optimization_barrier(t - a)
    return hi, a - hi


def _residual(a: jax.Array, b: jax.Array, q: jax.Array) -> jax.Array:
    """`a - q*b`, with `q*b` formed exactly (Dekker's product); `a` within a few ulps of
    `q*b`, so `a - p` is exact too."""
    p = q * b
    qh, ql = _split(q)
    bh, bl = _split(b)
    err = ((qh * bh - p) + qh * bl + ql * bh) + ql * bl  # q*b == p + err exactly
    return (a - p) - err


def correct_quotient(q: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """The correctly rounded `a / b` from an estimate `q` up to 8 ulps off.

    `a` and `b` are float32 significands in [0.5, 1) (so no step overflows or underflows) and
    `q` an estimate of their quotient. One step `q + r/b` on the exact residual `r = a - q*b`
    lands within half an ulp; a quotient of two floats is never exactly halfway between two
    floats, so that is the IEEE quotient. Tests feed it perturbed estimates, so the correction
    is checked on backends whose own division is already exact.
    """
    return q + _residual(a, b, q) / b


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _significand(bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A normal float32 `|x|` (as bits) as `(s, e)`: `s` in [0.5, 1), `|x| == s * 2**(e-126)`."""
    s = jax.lax.bitcast_convert_type(
        (bits & np.uint32(0x007FFFFF)) | np.uint32(0x3F000000), jnp.float32
    )
    return s, ((bits >> 23) & np.uint32(0xFF)).astype(jnp.int32)


def divide(x, y) -> jax.Array:
    """The IEEE float32 quotient `x / y` (round to nearest even), `y` broadcast to `x`'s shape,
    with the same bits on every backend.

    Backends do not agree on division: XLA:GPU's float32 division is not correctly rounded
    (a large share of quotients differ from IEEE's in their last bit), and XLA's simplifier
    rewrites a division by a broadcast as a multiplication by the reciprocal (one ulp off for
    about half of all inputs). So the backend's quotient of the two significands is only an
    estimate, corrected from its exact residual (`correct_quotient`); the result's exponent is
    then assembled with integer arithmetic, which no backend rounds or flushes. Subnormal
    inputs and results are zero (sign kept) on every backend, as XLA:CPU's arithmetic has them;
    zeros and infinities follow IEEE, and every NaN result is the quiet NaN `0x7FC00000`.
    """
    x = _flush(jnp.asarray(x, jnp.float32))
    y = _flush(jnp.broadcast_to(jnp.asarray(y, jnp.float32), x.shape))
    plain = x / jax.lax.optimization_barrier(y)
    xb, yb = _bits(x), _bits(y)
    a, ex = _significand(xb)
    b, ey = _significand(yb)
    m = _bits(correct_quotient(a / jax.lax.optimization_barrier(b), a, b))  # in (0.5, 2)
    # m's biased exponent is 126 or 127; shifting it by ex - ey gives the quotient's.
    e = ((m >> 23) & np.uint32(0xFF)).astype(jnp.int32) + ex - ey
    sign = (xb ^ yb) & np.uint32(0x80000000)
    normal = (jnp.clip(e, 1, 254).astype(jnp.uint32) << 23) | (m & np.uint32(0x007FFFFF))
    exact = jnp.where(e >= 255, np.uint32(0x7F800000), jnp.where(e <= 0, np.uint32(0), normal))
    exact = jax.lax.bitcast_convert_type(sign | exact, jnp.float32)
    regular = jnp.isfinite(x) & jnp.isfinite(y) & (x != 0) & (y != 0)
    return canonical(jnp.where(regular, exact, plain))


def decode(bits: jax.Array, dtype: np.dtype) -> jax.Array:
    """Views raw bits as `dtype` (identity when they already are: float32 pools, for one)."""
    dtype = jnp.dtype(dtype)
    return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def host_bits(x, dtype):
    """`x` as a zero-copy host view of its raw bits, when that is cheaper than a device cast.

    On XLA:CPU a bf16 -> uint16 bitcast inside a jitted call is an elementwise pass over the
    values, while numpy views the same bytes for free. So an eager write of
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
