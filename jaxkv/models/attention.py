"""The two attention variants of the reference decoder, each over its jaxkv pool.

Each variant has three faces:

* `create_pool`: the pool its cache lives in (`MHAPool` for grouped-query attention, `MLAPool`
  for latent attention);
* `cached`: one layer of a serving step. It writes the step's new K/V (or latent) rows into
  the pool at slots `loc` with the pool's own setter, then reads the whole context back
  through the request-to-token table (`slots`, a paged gather by slot) and attends under a
  mask built from positions and sequence lengths;
* `reference`: the same layer over a whole sequence with no cache at all, written
  independently (heads repeated instead of grouped; MLA's keys and values expanded instead of
  absorbed), so the tests compare two different computations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import MHAPool, MLAPool
from jaxkv.models import layers


class GQA:
    """Grouped-query attention: `n_heads` query heads share `n_kv_heads` K/V heads, with
    rotary positions on the whole head. Its cache is an `MHAPool` of `n_kv_heads` heads."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.groups = cfg.n_heads // cfg.n_kv_heads
        self.scale = 1.0 / np.sqrt(cfg.head_dim)

    def init(self, key: jax.Array) -> dict:
        c = self.cfg
        kq, kk, kv, ko = jax.random.split(key, 4)
        return {
            "q": layers.dense(kq, (c.d_model, c.n_heads, c.head_dim), c.d_model),
            "k": layers.dense(kk, (c.d_model, c.n_kv_heads, c.head_dim), c.d_model),
            "v": layers.dense(kv, (c.d_model, c.n_kv_heads, c.head_dim), c.d_model),
            "o": layers.dense(ko, (c.n_heads, c.head_dim, c.d_model), c.n_heads * c.head_dim),
        }

    def create_pool(self, *, size: int, page_size: int, dtype) -> MHAPool:
        c = self.cfg
        sizes = dict(head_num=c.n_kv_heads, head_dim=c.head_dim, layer_num=c.n_layers)
        return MHAPool.create(size=size, page_size=page_size, dtype=dtype, **sizes)

    def _qkv(self, p, x, positions):
        theta = self.cfg.rope_theta
        q = layers.rope(jnp.einsum("...td,dhk->...thk", x, p["q"]), positions, theta)
        k = layers.rope(jnp.einsum("...td,dhk->...thk", x, p["k"]), positions, theta)
        v = jnp.einsum("...td,dhk->...thk", x, p["v"])
        return q, k, v

    def cached(self, p, x, positions, pool, layer, loc, slots, mask):
        """One layer of a serving step.

        Args:
            x: `(B, T, d_model)` normed hidden states of the step's tokens.
            positions: int `(B, T)`.
            pool: the `MHAPool`; returned updated.
            layer: global layer id.
            loc: int `(B * T,)` slots receiving the new K/V; `-1` for padding (dropped).
            slots: int `(B, C)` the context's slots, from the request-to-token table.
            mask: bool `(B, T, C)`, which context entries each token attends to.

        Returns:
            `(out (B, T, d_model), pool)`.
        """
        b, t, _ = x.shape
        q, k, v = self._qkv(p, x, positions)
        kv_heads, dim = self.cfg.n_kv_heads, self.cfg.head_dim
        pool = pool.set_kv(layer, loc, k.reshape(b * t, kv_heads, dim), v.reshape(b * t, -1, dim))
        kc = layers.gather_rows(pool.get_key_buffer(layer), slots)  # (B, C, Hkv, D)
        vc = layers.gather_rows(pool.get_value_buffer(layer), slots)

        def attend(q, mask):  # q (B, T', Hkv, G, D), mask (B, T', C)
            s = jnp.einsum("btkgd,bckd->bkgtc", q, kc) * self.scale
            s = jnp.where(mask[:, None, None], s, layers.MASKED)
            return jnp.einsum("bkgtc,bckd->btkgd", jax.nn.softmax(s, axis=-1), vc)

        o = layers.over_query_chunks(attend, q.reshape(b, t, kv_heads, self.groups, dim), mask)
        return jnp.einsum("bthd,hde->bte", o.reshape(b, t, -1, dim), p["o"]), pool

    def reference(self, p, x, kv_dtype):
        """The layer over one whole sequence `x (L, d_model)` without a cache; K and V pass
        through `kv_dtype` as a pool of that dtype would store them."""
        q, k, v = self._qkv(p, x, jnp.arange(x.shape[0]))
        k = jnp.repeat(layers.round_through(k, kv_dtype), self.groups, axis=1)
        v = jnp.repeat(layers.round_through(v, kv_dtype), self.groups, axis=1)
        o = layers.causal_attention(q, k, v, self.scale)
        return jnp.einsum("thd,hde->te", o, p["o"])


class MLA:
    """DeepSeek-style multi-head latent attention over an `MLAPool`.

    Each token's cache entry is one latent row: `kv_lora_rank` values (the RMS-normed
    compressed K/V) and `qk_rope_head_dim` rotary key values shared by all heads, written with
    `set_mla_kv`. Served attention is computed from the latent: the query's no-rope part is
    absorbed into the latent space through the K up-projection, scores are taken against the
    latent and rope rows read from the pool, and the weighted latent is expanded by the V
    up-projection (no per-head K or V is ever materialised for the context).
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.scale = 1.0 / np.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)

    def init(self, key: jax.Array) -> dict:
        c = self.cfg
        kq, kd, ku, kv, ko = jax.random.split(key, 5)
        r, nope, rope_dim = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim
        return {
            "q": layers.dense(kq, (c.d_model, c.n_heads, nope + rope_dim), c.d_model),
            "kv_down": layers.dense(kd, (c.d_model, r + rope_dim), c.d_model),
            "kv_norm": jnp.ones((r,), jnp.float32),
            "k_up": layers.dense(ku, (r, c.n_heads, nope), r),
            "v_up": layers.dense(kv, (r, c.n_heads, c.v_head_dim), r),
            "o": layers.dense(ko, (c.n_heads, c.v_head_dim, c.d_model), c.n_heads * c.v_head_dim),
        }

    def create_pool(self, *, size: int, page_size: int, dtype) -> MLAPool:
        c = self.cfg
        sizes = dict(kv_lora_rank=c.kv_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim)
        return MLAPool.create(
            size=size, page_size=page_size, dtype=dtype, layer_num=c.n_layers, **sizes
        )

    def _project(self, p, x, positions):
        """Queries split into no-rope and rope parts, the latent and the shared rope key."""
        c = self.cfg
        q = jnp.einsum("...td,dhk->...thk", x, p["q"])
        q_nope = q[..., : c.qk_nope_head_dim]
        q_rope = layers.rope(q[..., c.qk_nope_head_dim :], positions, c.rope_theta)
        down = x @ p["kv_down"]
        latent = layers.rms_norm(down[..., : c.kv_lora_rank], p["kv_norm"])
        k_rope = layers.rope(down[..., None, c.kv_lora_rank :], positions, c.rope_theta)[..., 0, :]
        return q_nope, q_rope, latent, k_rope

    def cached(self, p, x, positions, pool, layer, loc, slots, mask):
        """One layer of a serving step; arguments as in `GQA.cached`, the pool an `MLAPool`."""
        c = self.cfg
        b, t, _ = x.shape
        q_nope, q_rope, latent, k_rope = self._project(p, x, positions)
        pool = pool.set_mla_kv(
            layer, loc, latent.reshape(b * t, 1, -1), k_rope.reshape(b * t, 1, -1)
        )
        rows = layers.gather_rows(pool.get_key_buffer(layer), slots)  # (B, C, 1, R + P)
        ctx_latent, ctx_rope = rows[:, :, 0, : c.kv_lora_rank], rows[:, :, 0, c.kv_lora_rank :]
        q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, p["k_up"])

        def attend(q_latent, q_rope, mask):
            s = jnp.einsum("bthr,bcr->bhtc", q_latent, ctx_latent)
            s = (s + jnp.einsum("bthp,bcp->bhtc", q_rope, ctx_rope)) * self.scale
            s = jnp.where(mask[:, None], s, layers.MASKED)
            return jnp.einsum("bhtc,bcr->bthr", jax.nn.softmax(s, axis=-1), ctx_latent)

        o_latent = layers.over_query_chunks(attend, q_latent, q_rope, mask)
        o = jnp.einsum("bthr,rhv->bthv", o_latent, p["v_up"])
        return jnp.einsum("bthv,hve->bte", o, p["o"]), pool

    def reference(self, p, x, kv_dtype):
        """Uncached, non-absorbed: per-head K and V expanded from the latent for every token."""
        c = self.cfg
        q_nope, q_rope, latent, k_rope = self._project(p, x, jnp.arange(x.shape[0]))
        latent = layers.round_through(latent, kv_dtype)
        k_rope = layers.round_through(k_rope, kv_dtype)
        k_nope = jnp.einsum("lr,rhn->lhn", latent, p["k_up"])
        k_rope = jnp.broadcast_to(k_rope[:, None], (*k_nope.shape[:2], c.qk_rope_head_dim))
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        v = jnp.einsum("lr,rhv->lhv", latent, p["v_up"])
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        o = layers.causal_attention(q, k, v, self.scale)
        return jnp.einsum("lhv,hve->le", o, p["o"])


VARIANTS: dict[str, type[GQA] | type[MLA]] = {"gqa": GQA, "mla": MLA}
