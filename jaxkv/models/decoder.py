"""A small decoder-only transformer in plain JAX, served from jaxkv pools.

Random weights from a fixed seed: it exists to show a real consumer of the pools (the forward
writes and reads the cache the way a serving stack does), not to produce useful text.

Example:
    >>> model = Decoder(DecoderConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
    ...                               head_dim=8, mlp_dim=32))
    >>> params = model.init_params()
    >>> params["embed"].shape
    (258, 32)
    >>> model.create_pool(size=64, page_size=16).k_buffer[0].shape
    (80, 1, 8)
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from jaxkv import MHAPool, MLAPool
from jaxkv.models import layers
from jaxkv.models.attention import VARIANTS
from jaxkv.models.tokenizer import ByteTokenizer

# Largest |logit difference| between a cached run and `Decoder.reference_logits` with K/V
# rounded to the pool's dtype (logits are of order 1-4). The two compute the same values in
# different orders, so a float32 K/V element can land on either side of a rounding boundary of
# the pool dtype; one such flip moves the value by a bf16 step (1/256 of it) or an fp8-e4m3
# step (1/16 to 1/8), hence the looser fp8 bounds (e5m2's steps are twice e4m3's). GPUs differ
# from the reference in their last float32 bits more often than XLA:CPU, so the fp8 bound
# leaves room for a few flips per sequence (the worst differences measured on both are in
# docs/performance.md).
LOGIT_BOUNDS = {
    jnp.dtype(jnp.float32): 1e-4,
    jnp.dtype(jnp.bfloat16): 5e-3,
    jnp.dtype(jnp.float16): 5e-3,
    jnp.dtype(jnp.float8_e4m3fn): 1e-1,
    jnp.dtype(jnp.float8_e5m2): 2e-1,
}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the reference decoder; hashable, so it can key compiled steps.

    `attention` picks the variant: "gqa" (grouped-query attention over an `MHAPool`: `n_heads`
    query heads, `n_kv_heads` K/V heads of `head_dim`) or "mla" (latent attention over an
    `MLAPool`: `kv_lora_rank` latent + `qk_rope_head_dim` rope values per token; queries of
    `qk_nope_head_dim + qk_rope_head_dim`, values of `v_head_dim` per head).
    """

    attention: str = "gqa"
    vocab_size: int = ByteTokenizer.vocab_size
    d_model: int = 512
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 64
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    mlp_dim: int = 1024
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self):
        if self.attention not in VARIANTS:
            raise ValueError(
                f"attention: expected one of {sorted(VARIANTS)}, got {self.attention!r}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads: expected a divisor of n_heads={self.n_heads}, got {self.n_kv_heads}"
            )
        for name in ("head_dim", "qk_rope_head_dim"):
            if getattr(self, name) % 2:
                raise ValueError(
                    f"{name}: rotary positions need an even size, got {getattr(self, name)}"
                )

    def fingerprint(self) -> str:
        """A short hash of every field, `seed` included. It names the architecture, not the
        weights (a fine-tune, or weights not from `init_params`, share it), so the `Engine`'s
        default namespace joins it with `params_fingerprint` of the weights served."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


class Decoder:
    """Pre-norm decoder: embedding, `n_layers` x (attention, SwiGLU MLP), final norm, LM head."""

    def __init__(self, cfg: DecoderConfig):
        self.cfg = cfg
        self.attention = VARIANTS[cfg.attention](cfg)

    def init_params(self) -> dict:
        """Float32 weights drawn from `jax.random.key(cfg.seed)`."""
        c = self.cfg
        keys = jax.random.split(jax.random.key(c.seed), 2 * c.n_layers + 2)
        blocks = [
            {
                "attn_norm": jnp.ones((c.d_model,), jnp.float32),
                "attn": self.attention.init(keys[2 * i]),
                "mlp_norm": jnp.ones((c.d_model,), jnp.float32),
                "mlp": layers.mlp_init(keys[2 * i + 1], c.d_model, c.mlp_dim),
            }
            for i in range(c.n_layers)
        ]
        return {
            "embed": jax.random.normal(keys[-2], (c.vocab_size, c.d_model), jnp.float32),
            "blocks": blocks,
            "final_norm": jnp.ones((c.d_model,), jnp.float32),
            "head": layers.dense(keys[-1], (c.d_model, c.vocab_size), c.d_model),
        }

    def create_pool(
        self, *, size: int, page_size: int = 1, dtype: DTypeLike = jnp.bfloat16
    ) -> MHAPool | MLAPool:
        """An empty pool of this model's cache layout (`MHAPool` or `MLAPool`).

        Args:
            size: tokens the pool holds, a positive multiple of `page_size`.
            page_size: tokens per page.
            dtype: the pool's dtype (the model computes in float32).

        Returns:
            An `MHAPool` (grouped-query attention) or `MLAPool` (latent attention).

        Raises:
            ValueError: bad sizes or an unsupported dtype (from the pool's `create`).
        """
        return self.attention.create_pool(size=size, page_size=page_size, dtype=dtype)

    def step(
        self,
        params: dict,
        pool: MHAPool | MLAPool,
        table: jax.Array,
        rows: jax.Array,
        tokens: jax.Array,
        start: jax.Array,
        n_new: jax.Array,
        loc: jax.Array,
        *,
        ctx: int,
    ) -> tuple[jax.Array, MHAPool | MLAPool]:
        """One serving step over a padded batch: prefill (T > 1) and decode (T == 1) alike.

        Each entry's `n_new[b]` tokens sit at positions `start[b] ...`; their K/V are written
        at `loc`, then every layer attends over the entry's first `start[b] + n_new[b]` tokens,
        read through `table[rows[b]]` (the request-to-token table). Jit it with the pool
        donated and every write is in place. Matmuls run at full float32 precision on every
        backend (GPUs and TPUs would otherwise round their inputs to TF32 or bf16), so the
        cached run and `reference_logits` agree everywhere.

        Args:
            params: from `init_params`.
            pool: the cache; returned updated.
            table: int32 `(rows, max_context_len)`, `ReqToTokenPool.req_to_token`.
            rows: int `(B,)` table rows; padded entries use row 0.
            tokens: int `(B, T)` new token ids (padding anything).
            start: int `(B,)` tokens already cached per entry (the position of `tokens[b, 0]`).
            n_new: int `(B,)` real new tokens per entry (0 for padded entries).
            loc: int `(B, T)` pool slots of the new tokens, `-1` past `n_new[b]`.
            ctx: static context width read per entry, at least `max(start + n_new)` and at
                most `max_context_len` (a bucket, so steps of similar lengths share a trace).

        Returns:
            `(logits (B, vocab) of each entry's last new token, pool)`.
        """
        with jax.default_matmul_precision("highest"):
            return self._step(params, pool, table, rows, tokens, start, n_new, loc, ctx)

    def _step(self, params, pool, table, rows, tokens, start, n_new, loc, ctx):
        b, t = tokens.shape
        positions = start[:, None] + jnp.arange(t)[None, :]
        slots = jnp.take(table, rows, axis=0)[:, :ctx]
        keys = jnp.arange(ctx)[None, None, :]
        mask = (keys <= positions[:, :, None]) & (keys < (start + n_new)[:, None, None])
        h = params["embed"][tokens]
        flat_loc = loc.reshape(b * t)
        for i, blk in enumerate(params["blocks"]):
            out, pool = self.attention.cached(
                blk["attn"],
                layers.rms_norm(h, blk["attn_norm"]),
                positions,
                pool,
                pool.start_layer + i,
                flat_loc,
                slots,
                mask,
            )
            h = h + out
            h = h + layers.mlp(blk["mlp"], layers.rms_norm(h, blk["mlp_norm"]))
        last = jnp.take_along_axis(h, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
        return layers.rms_norm(last, params["final_norm"]) @ params["head"], pool

    def reference_logits(
        self, params: dict, tokens: ArrayLike, kv_dtype: DTypeLike | None = None
    ) -> jax.Array:
        """Logits `(L, vocab)` at every position of `tokens (L,)`, recomputing the whole
        sequence with no cache. With `kv_dtype`, K and V (MLA: the latent and rope rows) are
        rounded as a pool of that dtype stores them, so the result matches what a cached run
        reads back up to float32 rounding.

        Args:
            params: from `init_params`.
            tokens: int token ids `(L,)`.
            kv_dtype: round K and V as a pool of this dtype would; `None` keeps float32.

        Returns:
            float32 logits `(L, vocab_size)`.
        """
        with jax.default_matmul_precision("highest"):
            return self._reference(params, tokens, kv_dtype)

    def _reference(self, params, tokens, kv_dtype):
        h = params["embed"][tokens]
        for blk in params["blocks"]:
            x = layers.rms_norm(h, blk["attn_norm"])
            h = h + self.attention.reference(blk["attn"], x, kv_dtype)
            h = h + layers.mlp(blk["mlp"], layers.rms_norm(h, blk["mlp_norm"]))
        return layers.rms_norm(h, params["final_norm"]) @ params["head"]
