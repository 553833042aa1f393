"""What sglang-jax's KV pools look like, checked on the pools themselves (test_connector.py
moves their blocks through jaxkv's connector).

For every configuration of sgljax_pools.CONFIGS:

* test_buffers: the buffers as built (shapes, dtypes, page size, packing, head_dim, dp size,
  the sharding and its Explicit mesh axes) against the layout facts of sgljax_pools;
* test_writes_land_where_the_layout_says: tokens written at chosen slots through sglang-jax's
  own write path land, bit for bit, exactly where the facts place them (slot -> page and
  offset -> token row; K and V of each head, or the latent's two segments; every padding row,
  padding column and padding page left zero);
"""

from __future__ import annotations

import numpy as np
import pytest
import sgljax_pools as sp
from jax.sharding import AxisType

from jaxkv import testing

# ---- the buffers as built ------------------------------------------------------------------


@pytest.mark.parametrize("cfg", sp.params())
def test_buffers(cfg):
    pool = sp.build(cfg)
    assert pool.page_size == cfg.page_size
    assert pool.dp_size == cfg.dp
    assert pool.start_layer == 0
    assert len(pool.kv_buffer) == cfg.layer_num
    want_axes = {"data": cfg.dp, "tensor": cfg.tp}
    for buf in pool.kv_buffer:
        assert tuple(buf.shape) == sp.buffer_shape(cfg)
        assert buf.dtype == cfg.jnp_dtype
        assert buf.sharding.spec == sp.spec(cfg)
        assert dict(buf.sharding.mesh.shape) == want_axes
        assert all(t == AxisType.Explicit for t in buf.sharding.mesh.axis_types)
    assert pool.kv_sharding.spec == sp.spec(cfg)
    if cfg.kind == "mha":
        # The pool keeps the head_dim it is given; packing is the shape's fourth axis.
        assert (pool.head_num, pool.head_dim) == (cfg.head_num, cfg.head_dim)
        assert sp.buffer_shape(cfg)[3] == sp.packing(cfg)
    else:
        nope, rope = sp.latent_dims(cfg)
        assert (pool.nope_dim, pool.rope_dim, pool.kv_dim) == (nope, rope, nope + rope)
        assert sp.buffer_shape(cfg)[2] == sp.packing(cfg)
        assert len(pool.indexer_key_buffer) == cfg.num_indexer_layers
        for buf in pool.indexer_key_buffer:
            assert tuple(buf.shape) == sp.indexer_shape(cfg)
            assert buf.dtype == cfg.jnp_dtype
            assert buf.sharding.spec == sp.spec(cfg)


@pytest.mark.parametrize("cfg", sp.params(lambda c: c.tp > 1))
def test_heads_split_over_the_tensor_axis(cfg, rng):
    """Each tensor-parallel device holds whole heads, K and V together, contiguous."""
    pool = sp.build(cfg)
    slots = list(sp.usable_slots(cfg))[:5]
    k = sp.random_values(rng, (len(slots), cfg.head_num, cfg.model_head_dim), cfg.jnp_dtype)
    v = sp.random_values(rng, k.shape, cfg.jnp_dtype)
    sp.write_mha(pool, 0, slots, k, v)
    shards = sorted(pool.kv_buffer[0].addressable_shards, key=lambda s: s.index[2].start or 0)
    assert len(shards) == cfg.tp
    per_shard = sp.buffer_shape(cfg)[2] // cfg.tp
    for d, shard in enumerate(shards):
        assert shard.data.shape == (*sp.buffer_shape(cfg)[:2], per_shard, *sp.buffer_shape(cfg)[3:])
        local = testing.raw_bits(shard.data)
        for t, s in enumerate(slots):
            for h in range(cfg.head_num):
                if sp.head_device(cfg, h) != d:
                    continue
                for which, x in ((0, k), (1, v)):
                    col, lane = sp.kv_index(cfg, h, which)
                    got = local[(*sp.token_index(cfg, s), col - d * per_shard, lane)]
                    np.testing.assert_array_equal(got, testing.raw_bits(x[t, h]))
    assert {sp.head_device(cfg, h) for h in range(cfg.head_num)} == set(range(cfg.tp))


# ---- where sglang-jax's own writes put a token ---------------------------------------------


def _mha_expected(cfg, slots, k, v) -> np.ndarray:
    """The MHA buffer after writing `k`, `v` at `slots` into zeros, from the layout facts."""
    out = np.zeros(sp.buffer_shape(cfg), testing.raw_bits(k).dtype)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        for h in range(cfg.head_num):
            for which, x in ((0, k), (1, v)):
                idx = (*sp.token_index(cfg, s), *sp.kv_index(cfg, h, which))
                out[idx][: cfg.model_head_dim] = testing.raw_bits(
                    x[t, h]
                )  # columns past it stay zero
    return out


@pytest.mark.parametrize("cfg", sp.params(lambda c: c.kind == "mha" and c.writable))
def test_mha_writes_land_where_the_layout_says(cfg, rng):
    pool = sp.build(cfg)
    # Every usable slot once, scrambled, with a padding token (-1) among them.
    slots = [int(s) for s in rng.permutation(np.asarray(sp.usable_slots(cfg)))]
    slots.insert(len(slots) // 2, -1)
    k = sp.random_values(rng, (len(slots), cfg.head_num, cfg.model_head_dim), cfg.jnp_dtype)
    v = sp.random_values(rng, k.shape, cfg.jnp_dtype)
    sp.write_mha(pool, 0, slots, k, v)

    got = testing.raw_bits(pool.get_fused_kv_buffer(0))  # what sglang-jax's attention reads
    np.testing.assert_array_equal(got, _mha_expected(cfg, slots, k, v))
    assert not testing.raw_bits(pool.kv_buffer[1]).any()  # the other layer untouched
    # The padding page and any head_dim padding hold zeros.
    assert not got[0].any()
    assert not got[..., cfg.model_head_dim :].any()
    # Token rows: the first two axes flattened; row = slot.
    rows = got.reshape(-1, *got.shape[2:])
    for s in slots[:8]:
        if s >= 0:
            np.testing.assert_array_equal(rows[sp.token_row(cfg, s)], got[sp.token_index(cfg, s)])


@pytest.mark.parametrize("cfg", sp.params(lambda c: not c.writable))
def test_mha_pool_below_128_is_not_writable_by_sglang_jax(cfg, rng):
    """A pool built at a head_dim below 128 keeps it, but sglang-jax's write path pads K and V
    to 128 first, so its own writes are refused (its model runner never builds such a
    pool) and the pool keeps its zeros."""
    pool = sp.build(cfg)
    assert pool.kv_buffer[0].shape[-1] == cfg.head_dim
    k = sp.random_values(rng, (3, cfg.head_num, cfg.model_head_dim), cfg.jnp_dtype)
    with pytest.raises((ValueError, TypeError)):  # K and V padded to 128 do not fit
        sp.write_mha(pool, 0, [cfg.page_size, cfg.page_size + 1, -1], k, k)
    assert not testing.raw_bits(pool.kv_buffer[0]).any()


def _mla_pages(cfg) -> tuple[list[int], int]:
    """Pages out of order (page indirection shows) and a token count ending mid-page on an
    odd offset (so a packed row is half written)."""
    pages = [3, 1, 4]
    return pages, 2 * cfg.page_size + cfg.page_size // 2 + 1


@pytest.mark.parametrize("cfg", sp.params(lambda c: c.kind == "mla"))
def test_mla_writes_land_where_the_layout_says(cfg, rng):
    pool = sp.build(cfg)
    page_ids, n = _mla_pages(cfg)
    kv_c = sp.random_values(rng, (n, cfg.kv_lora_rank), cfg.jnp_dtype)
    k_pe = sp.random_values(rng, (n, cfg.qk_rope_head_dim), cfg.jnp_dtype)
    slots = sp.write_mla(pool, 0, page_ids, kv_c, k_pe)
    assert slots == [
        page_ids[t // cfg.page_size] * cfg.page_size + t % cfg.page_size for t in range(n)
    ]

    nope, _ = sp.latent_dims(cfg)
    want = np.zeros(sp.buffer_shape(cfg), testing.raw_bits(kv_c).dtype)
    for t, s in enumerate(slots):
        want[sp.token_index(cfg, s)][: cfg.kv_lora_rank] = testing.raw_bits(kv_c[t])
        want[sp.token_index(cfg, s)][nope : nope + cfg.qk_rope_head_dim] = testing.raw_bits(k_pe[t])
    got = testing.raw_bits(pool.get_fused_kv_buffer(0))
    np.testing.assert_array_equal(got, want)  # padding columns, rows and pages stay zero
    assert not testing.raw_bits(pool.kv_buffer[1]).any()

    # sglang-jax's own split of the latent: c_kv and k_pe views of the two segments.
    c_view, pe_view = pool.get_kv_buffer(0)
    for t, s in enumerate(slots):
        np.testing.assert_array_equal(
            testing.raw_bits(c_view)[sp.token_index(cfg, s)], testing.raw_bits(kv_c[t])
        )
        np.testing.assert_array_equal(
            testing.raw_bits(pe_view)[sp.token_index(cfg, s)], testing.raw_bits(k_pe[t])
        )
    # Token rows: the first three axes flattened, page_rows rows a page.
    rows = got.reshape(-1, got.shape[-1])
    assert rows.shape[0] == sp.pages(cfg) * sp.page_rows(cfg)
    for s in slots:
        np.testing.assert_array_equal(rows[sp.token_row(cfg, s)], got[sp.token_index(cfg, s)])


@pytest.mark.parametrize("cfg", sp.params(lambda c: c.indexer_key_dim > 0))
def test_indexer_keys_land_where_the_layout_says(cfg, rng):
    """DSA's indexer keys: one paged buffer per indexer layer, tokens placed as the latent's,
    the key padded to 128 columns."""
    pool = sp.build(cfg)
    page_ids, n = _mla_pages(cfg)
    keys = sp.random_values(rng, (n, cfg.indexer_key_dim), cfg.jnp_dtype)
    slots = sp.write_indexer(pool, 0, page_ids, keys)
    want = np.zeros(sp.indexer_shape(cfg), testing.raw_bits(keys).dtype)
    for t, s in enumerate(slots):
        want[sp.token_index(cfg, s)][: cfg.indexer_key_dim] = testing.raw_bits(keys[t])
    np.testing.assert_array_equal(testing.raw_bits(pool.get_indexer_key_buffer(0)), want)
    assert not any(testing.raw_bits(b).any() for b in pool.kv_buffer)  # the latent untouched
