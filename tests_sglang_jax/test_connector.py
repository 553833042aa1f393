"""jaxkv's `KVConnector` over sglang-jax's own pools, as sglang-jax builds them.

For every configuration of sgljax_pools.CONFIGS, a prefix written by sglang-jax's own writers
is stored through the connector and loaded into other slots: it must come back bit-exact where
sglang-jax's layout places it, with no other entry of any buffer changed (the padding page,
padding columns and rows, the other layers, the indexer keys), every buffer keeping its
sharding and, updated in place, its memory. Beside that: blocks keyed by the pool's own
layout and shard coordinates, `export_blocks` in token rows, and the refusals (data-parallel
pages, buffers that disagree with the pool's attributes, lookalike objects of other classes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sgljax_pools as sp

from jaxkv import testing
from jaxkv.connector import HostStore, KVConnector
from jaxkv.errors import UnsupportedKVCacheError

# One MHA and one MLA configuration, for the checks that do not depend on the sizes.
_ONE_EACH = ("mha-bf16-p4", "mla-bf16-p4-lora512")


def _fill(cfg, pool, rng) -> None:
    """Distinct data in every usable slot of every layer (indexer keys included), written by
    sglang-jax's own writers where it has them, so a row written in the wrong place shows."""
    slots = list(sp.usable_slots(cfg))
    if cfg.kind == "mha" and not cfg.writable:
        fill = [sp.random_values(rng, sp.buffer_shape(cfg), cfg.jnp_dtype) for _ in pool.kv_buffer]
        # jnp.array copies into memory XLA owns (a numpy array put on the CPU device may be
        # aliased, and aliased memory cannot be donated to an in-place update).
        pool.replace_buffer([jax.device_put(jnp.array(b), pool.kv_sharding) for b in fill])
        return
    for layer in range(cfg.layer_num):
        if cfg.kind == "mha":
            shape = (len(slots), cfg.head_num, cfg.model_head_dim)
            k = sp.random_values(rng, shape, cfg.jnp_dtype)
            sp.write_mha(pool, layer, slots, k, sp.random_values(rng, shape, cfg.jnp_dtype))
        else:
            all_pages = list(range(1, sp.pages(cfg)))
            kv_c = sp.random_values(rng, (len(slots), cfg.kv_lora_rank), cfg.jnp_dtype)
            k_pe = sp.random_values(rng, (len(slots), cfg.qk_rope_head_dim), cfg.jnp_dtype)
            sp.write_mla(pool, layer, all_pages, kv_c, k_pe)
    for i in range(cfg.num_indexer_layers):
        keys = sp.random_values(rng, (len(slots), cfg.indexer_key_dim), cfg.jnp_dtype)
        sp.write_indexer(pool, i, list(range(1, sp.pages(cfg))), keys)


def _round_trip_slots(cfg) -> tuple[list[int], list[int]]:
    """A two-page prefix and the pages it is loaded into (one page each where the pool has only
    two usable pages)."""
    src, dst = sp.ROUND_TRIP_PAGES
    if sp.pages(cfg) - 1 < len(src) + len(dst):
        src, dst = (1,), (2,)
    page = cfg.page_size
    return [p * page + o for p in src for o in range(page)], [
        p * page + o for p in dst for o in range(page)
    ]


def _filled(cfg, rng):
    pool = sp.build(cfg)
    _fill(cfg, pool, rng)
    return pool


@pytest.mark.parametrize("cfg", sp.params())
def test_round_trip_moves_exactly_the_prefix(cfg, rng):
    pool = _filled(cfg, rng)
    before = sp.pool_bits(pool)
    placed = testing.shardings(sp.buffers(pool))
    src, dst = _round_trip_slots(cfg)
    tokens = rng.integers(0, 50_000, len(src)).tolist()
    conn = KVConnector(pool, HostStore(1 << 26), block_size=cfg.page_size)
    assert conn.store(pool, tokens, src) == len(src) // cfg.page_size
    pointers = testing.buffer_pointers(sp.buffers(pool))
    new, loaded = conn.load(pool, tokens, dst)
    assert new is pool and loaded == len(src)
    testing.assert_shardings_kept(placed, sp.buffers(pool))
    testing.assert_updated_in_place(pointers, sp.buffers(pool))  # the donated buffers reused
    after = sp.pool_bits(pool)
    for attr, layers in before.items():
        for layer, (old, got) in enumerate(zip(layers, after[attr])):
            want = old.copy()
            for s, d in zip(src, dst):
                want[sp.token_index(cfg, d)] = old[sp.token_index(cfg, s)]
            wrong = np.flatnonzero((want != got).reshape(want.shape[0], -1).any(axis=1))
            assert not wrong.size, f"{attr}[{layer}]: pages {wrong.tolist()} hold wrong data"


@pytest.mark.parametrize("cfg", sp.params(lambda c: c.name in ("mha-bf16-p4", "mla-bf16-p4-dsa")))
def test_export_blocks_are_the_token_rows(cfg, rng):
    pool = _filled(cfg, rng)
    src, _ = _round_trip_slots(cfg)
    conn = KVConnector(pool, HostStore(1 << 26), block_size=cfg.page_size)
    blocks = conn.export_blocks(pool, src)
    n = len(src) // cfg.page_size
    families = {"kv": pool.kv_buffer}
    if cfg.indexer_key_dim:
        families["index_k"] = pool.indexer_key_buffer
    assert sorted(blocks) == sorted(families)
    for key, layers in families.items():
        got = blocks[key]
        assert got.shape[:3] == (n, len(layers), cfg.page_size)
        for li, buf in enumerate(layers):
            host = testing.raw_bits(buf)
            want = np.stack([host[sp.token_index(cfg, s)] for s in src])
            row = want.shape[1:]
            np.testing.assert_array_equal(got[:, li].reshape(-1, *row).view(want.dtype), want)


def test_blocks_are_keyed_by_the_shard_coordinates(rng):
    """Heads split over two devices are stored per shard, keyed by which heads each holds: a
    pool of the same model on one device misses them instead of reading half-rows."""
    cfg = sp.BY_NAME["mha-bf16-p4-tp2"]
    pool = _filled(cfg, rng)
    src, _ = _round_trip_slots(cfg)
    tokens = rng.integers(0, 50_000, len(src)).tolist()
    store = HostStore(1 << 26)
    tp2 = KVConnector(pool, store, block_size=cfg.page_size)
    assert tp2.store(pool, tokens, src) == len(src) // cfg.page_size
    assert tp2.lookup(tokens) == len(src)
    one = sp.build(dataclasses.replace(cfg, name="tp1", tp=1))
    tp1 = KVConnector(one, store, block_size=cfg.page_size)
    assert tp1.lookup(tokens) == 0
    # The attributes describe the keys stored: unequal fingerprints, as the blocks are not
    # shared; each block under one key per shard, the keys the store holds.
    assert tp2.fingerprint != tp1.fingerprint
    keys = tp2.block_keys(tokens)
    assert len(keys) == len(src) // cfg.page_size and {len(k) for k in keys} == {2}
    assert len(store) == 2 * len(keys)
    assert all(store.contains(k) for block in keys for k in block)
    assert not any(store.contains(h) for h in tp2.block_hashes(tokens))
    assert tp1.block_keys(tokens) == [[h] for h in tp1.block_hashes(tokens)]


def test_data_parallel_pages_are_refused():
    cfg = sp.BY_NAME["mha-bf16-p4"]
    pool = sp.build(cfg)
    pool.dp_size = 2  # rank-local pages: a slot does not name one row of the buffer
    with pytest.raises(UnsupportedKVCacheError, match="dp_size=2"):
        KVConnector(pool, HostStore(1 << 20))


@pytest.mark.parametrize("cfg", sp.params(lambda c: c.name in _ONE_EACH))
def test_buffers_that_disagree_with_the_attributes_are_refused(cfg):
    pool = sp.build(cfg)
    pool.page_size = 2 * cfg.page_size  # the buffers were made for the other page size
    with pytest.raises(UnsupportedKVCacheError, match=r"kv_buffer\[0\] has shape"):
        KVConnector(pool, HostStore(1 << 20))


class _Lookalike:
    """An object of another class holding sglang-jax-shaped buffers."""

    def __init__(self, layers, page_size):
        self.kv_buffer = layers
        self.page_size = page_size


@pytest.mark.parametrize("cfg", sp.params(lambda c: c.name in _ONE_EACH))
def test_lookalike_paged_buffers_are_refused_not_guessed(cfg):
    pool = sp.build(cfg)
    fake = _Lookalike(list(pool.kv_buffer), cfg.page_size)
    with pytest.raises(UnsupportedKVCacheError, match="does not guess") as err:
        KVConnector(fake, HostStore(1 << 20))
    assert "layout=" in str(err.value)


def test_a_fresh_process_describes_sglang_jax_pools_without_importing_the_integration():
    """The connector finds sglang-jax's layouts by the pool class's module: the caller imports
    neither jaxkv's integration nor anything but sglang-jax's pool and the connector."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, sgljax_pools as sp\n"
        "from jaxkv.connector import HostStore, KVConnector\n"
        "cfg = sp.BY_NAME['mha-bf16-p4']\n"
        "pool = sp.build(cfg)\n"
        "assert 'jaxkv.integrations.sglang_jax.layouts' not in sys.modules\n"
        "conn = KVConnector(pool, HostStore(1 << 20))\n"
        "print(conn.layout.kind)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "sglang-jax-mha"
