"""The maths both attention variants share: norms, rotary positions, the MLP, paged reads.

Everything here is a pure function of arrays; weights are plain dicts of float32 arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A finite "minus infinity" for masked scores: a padded batch entry masks every key, and a
# softmax over -inf alone would be NaN; over this it is a harmless uniform average.
MASKED = -1e30


def dense(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """Weights drawn from N(0, 1/fan_in), so activations keep unit scale through a layer."""
    return jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)


def rms_norm(x: jax.Array, gain: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary positions, half-split (NeoX) layout.

    Args:
        x: `(..., T, heads, dim)` with an even `dim`.
        positions: int `(..., T)`, the absolute position of each token.
    """
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(half, dtype=np.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq  # (..., T, half)
    cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mlp_init(key: jax.Array, d_model: int, mlp_dim: int) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "gate": dense(k1, (d_model, mlp_dim), d_model),
        "up": dense(k2, (d_model, mlp_dim), d_model),
        "down": dense(k3, (mlp_dim, d_model), mlp_dim),
    }


def mlp(p: dict, x: jax.Array) -> jax.Array:
    """SwiGLU feed-forward."""
    return (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]


def gather_rows(buffer: jax.Array, slots: jax.Array) -> jax.Array:
    """The paged read: rows `slots (B, C)` of one layer's whole buffer, as float32
    `(B, C, *row)`.

    `buffer` comes from a pool reader (`get_key_buffer`, `get_value_buffer`), which views the
    stored bits as the logical dtype. Under jit XLA fuses that view into the gather, so the
    read costs O(context), not O(pool): a decode step at 1K context takes the same time with
    a 16K- and a 256K-token pool.
    """
    return jnp.take(buffer, slots, axis=0, mode="clip").astype(jnp.float32)


def over_query_chunks(fn, *xs, chunk: int = 256):
    """`fn(*xs)` computed `chunk` queries at a time; each `x` is `(B, T, ...)`.

    A long prefill's scores `(B, heads, T, C)` are hundreds of MiB; in chunks they stay in
    cache (docs/performance.md times both on the demo model). Shapes that do not split evenly
    run whole.
    """
    t = xs[0].shape[1]
    if t <= chunk or t % chunk:
        return fn(*xs)
    split = [jnp.moveaxis(x.reshape(x.shape[0], t // chunk, chunk, *x.shape[2:]), 1, 0) for x in xs]
    out = jax.lax.map(lambda a: fn(*a), split)  # (n, B, chunk, ...)
    return jnp.moveaxis(out, 0, 1).reshape(out.shape[1], t, *out.shape[3:])


def round_through(x: jax.Array, dtype) -> jax.Array:
    """`x` as a pool of `dtype` would return it (cast, fp8 saturating), back in float32.

    The uncached reference applies it to K and V so that it sees the values the cached path
    reads back; `dtype=None` leaves them exact.
    """
    if dtype is None:
        return x
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1:
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -limit, limit)
    return x.astype(dtype).astype(jnp.float32)


def causal_attention(q, k, v, scale: float, chunk: int = 512) -> jax.Array:
    """Plain causal attention over one whole sequence, no cache: the reference.

    Args:
        q: `(L, H, Dk)`; k: `(L, H, Dk)`; v: `(L, H, Dv)` (heads already repeated for GQA).

    Returns:
        `(L, H, Dv)`. Queries go `chunk` at a time so a 16K-token sequence never holds the
        full `(H, L, L)` score matrix.
    """
    n = q.shape[0]

    def block(start, qc):
        s = jnp.einsum("thd,shd->hts", qc, k) * scale
        qpos = start + jnp.arange(qc.shape[0])[:, None]
        s = jnp.where(jnp.arange(n)[None, :] <= qpos, s, MASKED)
        return jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1), v)

    if n <= chunk:
        return block(0, q)
    pad = -n % chunk  # padded queries attend like the last one; their rows are cut off
    qs = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(-1, chunk, *q.shape[1:])
    starts = jnp.arange(0, n + pad, chunk)
    blocks = jax.lax.map(lambda a: block(a[0], a[1]), (starts, qs))
    return blocks.reshape(n + pad, *blocks.shape[2:])[:n]
