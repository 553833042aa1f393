"""The reference decoder served through jaxkv pools equals its uncached reference.

Greedy generation through the pools (paged writes, reads through the request-to-token table,
bucketed batches of requests with different lengths) must pick the same tokens as a forward
pass that recomputes each whole sequence with no cache, and its logits must stay within a
bound (`jaxkv.models.LOGIT_BOUNDS`: bf16 5e-3, fp8-e4m3 1e-1). The reference rounds
K/V through the pool dtype as the pool stores them; against an exact float32 reference the
differences are the cache dtype's own error, checked with a looser bound.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_DECODER as SMALL

from jaxkv.models import (
    LOGIT_BOUNDS,
    ByteTokenizer,
    Decoder,
    DecoderConfig,
    Engine,
    Request,
    bucket,
)

DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def small_model(attention: str) -> tuple[Decoder, dict]:
    model = Decoder(DecoderConfig(attention=attention, **SMALL))
    return model, model.init_params()


_REF = {}


def reference(model, params, seq, kv_dtype):
    """Logits at every position of `seq`, padded to 64 tokens so lengths share one compile
    (the model is causal: padding after the sequence changes nothing before it)."""
    key = (model.cfg, kv_dtype)
    if key not in _REF:
        _REF[key] = jax.jit(model.reference_logits, static_argnums=2)
    padded = np.zeros(max(64, bucket(len(seq))), np.int32)
    padded[: len(seq)] = seq
    return np.asarray(_REF[key](params, padded, kv_dtype))[: len(seq)]


def mixed_requests(rng, new_tokens=5):
    """Four prompts of different lengths, served as one padded batch."""
    return [Request(rng.integers(0, 256, n).astype(np.int32), new_tokens) for n in (23, 5, 40, 17)]


_SERVED = {}


def served(attention: str, page_size: int, dtype: str):
    """`mixed_requests` served once per (attention, page size, pool dtype), with the model,
    params and engine that served them: the tests that check a run share it rather than
    compiling its steps again."""
    key = (attention, page_size, dtype)
    if key not in _SERVED:
        model, params = small_model(attention)
        requests = mixed_requests(np.random.default_rng(7))
        engine = Engine(
            model, params, pool_size=512, page_size=page_size, dtype=DTYPES[dtype],
            max_batch=4, max_context=96,
        )  # fmt: skip
        _SERVED[key] = model, params, requests, engine, engine.generate(requests)
    return _SERVED[key]


# Every pair of (attention, page size, pool dtype) values appears once: each factor changes its
# own part of the step, and every two of them meet (a full cross product compiles twice as many
# engines for no further pairing).
@pytest.mark.parametrize(
    "attention,page_size,dtype",
    [("gqa", 1, "bf16"), ("gqa", 16, "fp8"), ("mla", 1, "fp8"), ("mla", 16, "bf16")],
)
def test_cached_generation_equals_uncached_reference(attention, page_size, dtype):
    model, params, requests, engine, results = served(attention, page_size, dtype)
    for req, res in zip(requests, results):
        assert res.tokens.shape == (req.max_new_tokens,)
        seq = np.concatenate([req.prompt, res.tokens[:-1]])
        logits = reference(model, params, seq, DTYPES[dtype])[len(req.prompt) - 1 :]
        np.testing.assert_array_equal(res.tokens, np.argmax(logits, -1))
        np.testing.assert_allclose(
            res.logits, logits, rtol=0, atol=LOGIT_BOUNDS[jnp.dtype(DTYPES[dtype])]
        )
    # Every slot went back when its request finished: to the allocator, or to the prefix
    # cache, unlocked, which holds the finished requests' pages until the room is needed.
    tree = engine.tree_cache
    assert engine.allocator.available_size() + tree.total_size() == 512
    assert tree.protected_size() == 0 and tree.total_size() > 0


# The bf16 runs of the cover above, one per attention variant (page sizes 1 and 16).
@pytest.mark.parametrize("attention,page_size", [("gqa", 1), ("mla", 16)])
def test_cache_dtype_error_against_exact_float32(attention, page_size):
    # Without rounding K/V in the reference, the difference is the pool dtype's own error:
    # measured up to 0.008 (bf16) on these models; the bound leaves room.
    model, params, requests, _, results = served(attention, page_size, "bf16")
    for req, res in zip(requests, results):
        seq = np.concatenate([req.prompt, res.tokens[:-1]])
        logits = reference(model, params, seq, None)[len(req.prompt) - 1 :]
        np.testing.assert_allclose(res.logits, logits, rtol=0, atol=2e-2)


def test_float32_pool_matches_exact_reference_closely():
    # A float32 pool stores K/V exactly: only float32 summation order differs.
    model, params = small_model("gqa")
    rng = np.random.default_rng(5)
    req = Request(rng.integers(0, 256, 19).astype(np.int32), 4)
    engine = Engine(
        model, params, pool_size=128, page_size=1, dtype=jnp.float32, max_batch=1,
        max_context=32,
    )  # fmt: skip
    (res,) = engine.generate([req])
    seq = np.concatenate([req.prompt, res.tokens[:-1]])
    logits = reference(model, params, seq, None)[len(req.prompt) - 1 :]
    np.testing.assert_allclose(res.logits, logits, rtol=0, atol=1e-4)


def test_mla_latent_attention_equals_expanded_heads():
    # The absorbed (latent) attention of a serving step and the reference's per-head K/V are
    # the same function; compare one prefill step's logits directly on a float32 pool.
    model, params = small_model("mla")
    tokens = np.random.default_rng(1).integers(0, 256, 12).astype(np.int32)
    pool = model.create_pool(size=64, page_size=1, dtype=jnp.float32)
    table = np.zeros((2, 16), np.int32)
    table[1, :12] = np.arange(1, 13)
    logits, _ = jax.jit(model.step, static_argnames="ctx")(
        params, pool, jnp.asarray(table), np.array([1]), tokens[None], np.array([0]),
        np.array([12]), np.arange(1, 13)[None], ctx=16,
    )  # fmt: skip
    ref = jax.jit(model.reference_logits)(params, tokens)[-1]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(ref), rtol=0, atol=1e-4)


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo, pools")
    assert ids[0] == tok.bos_id and ids.dtype == np.int32
    assert tok.decode(np.append(ids, tok.eos_id)) == "héllo, pools"
    assert tok.encode("ab", bos=False).tolist() == [97, 98]


def test_bucket_sizes():
    assert [bucket(n) for n in (1, 16, 17, 200, 256, 257, 700)] == [16, 16, 32, 256, 256, 512, 768]


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="attention: expected one of"):
        DecoderConfig(attention="mqa")
    with pytest.raises(ValueError, match="n_kv_heads: expected a divisor of n_heads=8"):
        DecoderConfig(n_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim: rotary positions need an even size"):
        DecoderConfig(head_dim=63)


def test_reference_attention_in_query_chunks_equals_one_block():
    # Long references go `chunk` queries at a time (a 16K sequence never holds all scores).
    from jaxkv.models import layers

    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1300, 4, 8)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1300, 4, 6)), jnp.float32)
    chunked = layers.causal_attention(q, k, v, 0.3, chunk=512)
    whole = layers.causal_attention(q, k, v, 0.3, chunk=4096)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=0, atol=1e-5)
