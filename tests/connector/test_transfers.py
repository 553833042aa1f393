"""Transfer paths: one chosen per connector from the pool's placement (or the caller's
`transfer`), every store and load going through it, each path round-tripping bit-exact."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import random_mha_pool, raw_rows

import jaxkv
from jaxkv.connector import HostStore, KVConnector

BS = 4


def _has_pinned_cpu() -> bool:
    return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}


def test_the_path_follows_the_pool_placement():
    on_cpu = jax.default_backend() == "cpu"
    mha = KVConnector(random_mha_pool(0, size=32), HostStore(1 << 20), block_size=BS)
    assert mha.transfer_path.name == ("cpu" if on_cpu else "pinned")
    nsa = jaxkv.NSAPool.create(
        size=64, page_size=16, kv_lora_rank=16, qk_rope_head_dim=8, index_head_dim=16, layer_num=1
    )
    # Index records live inside pages (not token-major): no numpy copy of row runs.
    assert KVConnector(nsa, HostStore(1 << 20)).transfer_path.name == (
        "gather" if on_cpu else "pinned"
    )


def test_foreign_host_buffers_take_the_foreign_path():
    class Pool:
        k_buffer = [np.zeros((33, 2, 4), np.float32)]
        v_buffer = [np.zeros((33, 2, 4), np.float32)]

    conn = KVConnector(Pool(), HostStore(1 << 20), block_size=BS)
    assert conn.transfer_path.name == "foreign"
    with pytest.raises(ValueError, match="transfer: expected None for a pool whose buffers"):
        KVConnector(Pool(), HostStore(1 << 20), transfer="gather")


@pytest.mark.parametrize("transfer", ["fast", "", 1])
def test_an_unknown_transfer_is_refused(transfer):
    with pytest.raises(ValueError, match="transfer: expected None or one of"):
        KVConnector(random_mha_pool(0, size=32), HostStore(1 << 20), transfer=transfer)


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="the cpu path needs a CPU device")
def test_the_cpu_path_is_refused_off_cpu():
    with pytest.raises(ValueError, match="transfer: 'cpu' needs"):
        KVConnector(random_mha_pool(0, size=32), HostStore(1 << 20), transfer="cpu")


@pytest.mark.parametrize("transfer", [None, "gather", "pinned", "cpu"])
def test_every_path_round_trips_bit_exact_and_touches_no_other_row(transfer):
    if transfer == "pinned" and not _has_pinned_cpu() and jax.default_backend() == "cpu":
        pytest.skip("this jax has no pinned_host memory on CPU devices")
    if transfer == "cpu" and jax.default_backend() != "cpu":
        pytest.skip("the cpu path needs a CPU device")
    pool = random_mha_pool(3, size=64)
    conn = KVConnector(pool, HostStore(1 << 20), block_size=BS, transfer=transfer)
    if transfer is not None:
        assert conn.transfer_path.name == transfer
    tokens, src = np.arange(16), np.arange(1, 17)
    dst = np.array([40, 41, 42, 43, 20, 21, 22, 23, 50, 51, 52, 53, 30, 31, 32, 33])
    want = raw_rows(pool, src)
    others = np.setdiff1d(np.arange(65), dst)
    kept = raw_rows(pool, others)
    assert conn.store(pool, tokens, src) == 4
    pool, n = conn.load(pool, tokens, dst)
    assert n == 16
    assert np.array_equal(raw_rows(pool, dst), want)
    assert np.array_equal(raw_rows(pool, others), kept)


# --------------------------------------------------------------------------------------------
# Transfers compile per bucket of blocks, and precompile compiles them ahead


@pytest.mark.parametrize("transfer", [None, "gather"])
def test_precompile_compiles_every_bucket_and_changes_no_entry(transfer):
    from jaxkv.connector._block_kernels import gather_jit, scatter_donated
    from jaxkv.testing import assert_bits_equal

    src = random_mha_pool(size=1024, layer_num=2, seed=3)
    conn = KVConnector(src, HostStore(1 << 24), block_size=16, transfer=transfer)
    dst = random_mha_pool(size=1024, layer_num=2, seed=4)
    before = jax.tree.map(lambda x: np.array(x, copy=True), dst)  # copies: no view held
    dst = conn.precompile(dst, max_blocks=40)  # buckets 1, 2, 4 ... 64
    assert_bits_equal(dst, before)
    compiled = scatter_donated._cache_size(), gather_jit._cache_size()
    rng = np.random.default_rng(0)
    for n in (3, 37, 64):
        tokens = np.arange(n * 16) + 1000 * n
        conn.store(src, tokens, np.arange(1, n * 16 + 1))
        # Blocks as runs of slots, then scattered slots (no block a run): both compiled ahead.
        for slots in (np.arange(1, n * 16 + 1), rng.permutation(np.arange(1, 1025))[: n * 16]):
            dst, got = conn.load(dst, tokens, slots)
            assert got == n * 16
            want = raw_rows(src, np.arange(1, got + 1))
            np.testing.assert_array_equal(raw_rows(dst, slots), want)
    # Block counts of 3, 37 and 64 ran at buckets of 4 and 64 blocks, compiled ahead. The
    # "pinned" path (the default on a GPU or TPU) keeps its snapshot at the exact block count,
    # a segment a store keeps as it is: only its loads run at a bucket.
    if conn.transfer_path.name == "pinned":
        compiled, now = compiled[0], scatter_donated._cache_size()
    else:
        now = scatter_donated._cache_size(), gather_jit._cache_size()
    assert now == compiled


def test_precompile_checks_its_arguments():
    pool = random_mha_pool(size=64)
    conn = KVConnector(pool, HostStore(1 << 20))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_blocks"):
            conn.precompile(pool, max_blocks=bad)
    conn.close()
    with pytest.raises(RuntimeError):
        conn.precompile(pool, max_blocks=1)
