"""Connector tests: `KVConnector`, `export_blocks`, `lookup`/`store`/`load`.

Every round trip is checked against a plain numpy model of the pool's buffers: rows are raw
bits (so NaN payloads and fp8 codes must survive untouched), and NSA's indexer buffer is read
and written through SGLang's page layout (per page: the fp8 keys of its tokens, then one
float32 scale per token), written out here independently of jaxkv's own codec.
"""

from __future__ import annotations

import dataclasses
import os
import re

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    BOUNDARY_ERRORS,
    CONNECTOR_KINDS,
    HOSTILE_ARG,
    INDEX_ATTR,
    INDEX_HEAD_DIM,
    bits_by_attr,
    buffer_attrs,
    connector_pool,
    fill_random_bits,
    model_load,
    names_an_argument,
    nsa_kv_row,
    random_mha_pool,
    raw_rows,
    record_path,
    roundtrip,
    run_example,
    scattered_slots,
    token_rows,
)
from hypothesis import HealthCheck, given, settings

import jaxkv
from jaxkv import MHAPool, testing
from jaxkv.connector import DiskStore, HostStore, KVConnector, min_block_count

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)
# (page_size, block_size, start_layer): token pools, paged pools with block == page, and
# blocks of two pages; stages that do not start at layer 0.
CONFIGS = ((1, None, 0), (4, None, 3), (16, None, 0), (4, 8, 1))
# Host stores here hold 1 MiB, more than ten times what any test stores: a HostStore maps and
# touches its arena, up to its capacity, when it is made.


# --------------------------------------------------------------------------------------------
# SGLang-shaped pools: plain objects holding lists of per-layer arrays


class SGLangMHAPool:
    def __init__(self, k_buffer, v_buffer, page_size):
        self.k_buffer, self.v_buffer, self.page_size = k_buffer, v_buffer, page_size


class SGLangKOnlyPool:
    def __init__(self, k_buffer, page_size):
        self.k_buffer, self.page_size = k_buffer, page_size


class SGLangMLAPool:
    def __init__(self, kv_buffer, page_size):
        self.kv_buffer, self.page_size = kv_buffer, page_size


class SGLangNSAPool:
    def __init__(self, kv_buffer, index_k_with_scale_buffer, page_size):
        self.kv_buffer, self.index_k_with_scale_buffer = kv_buffer, index_k_with_scale_buffer
        self.page_size = page_size


class NotAPool:
    def __init__(self):
        self.key_cache = [np.zeros((8, 2, 4), np.float32)]


_FOREIGN = {
    "mha": SGLangMHAPool,
    "k_only": SGLangKOnlyPool,
    "mla": SGLangMLAPool,
    "nsa": SGLangNSAPool,
}


def _foreign(kind, raw, dtype, page_size, backend):
    """An SGLang-shaped object holding `raw` bits as per-layer `backend` arrays of `dtype`
    (the indexer buffer stays uint8, as in SGLang)."""

    def layers(attr):
        out = []
        for bits in raw[attr]:
            host = bits.copy() if attr == INDEX_ATTR else bits.copy().view(dtype)
            out.append(host if backend == "numpy" else jnp.asarray(host))
        return out

    return _FOREIGN[kind](*[layers(a) for a in raw], page_size)


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("page_size,block_size,start_layer", CONFIGS)
@pytest.mark.parametrize("kind", CONNECTOR_KINDS)
def test_roundtrip_jaxkv_pools_token_and_paged(kind, page_size, block_size, start_layer):
    rng = np.random.default_rng(0)
    bs = block_size or (page_size if page_size > 1 else 16)
    size = max(64, 8 * bs)

    def make():
        return connector_pool(kind, size=size, page_size=page_size, start_layer=start_layer)

    src, dst = fill_random_bits(make(), rng), fill_random_bits(make(), rng)
    conn = KVConnector(src, HostStore(1 << 20), block_size=block_size)
    assert conn.block_size == bs
    dst = roundtrip(
        src,
        dst,
        conn,
        rng=rng,
        size=size,
        page_size=page_size,
        n_tokens=3 * bs + page_size // 2 + 1,
    )
    assert type(dst) is type(src)


@pytest.mark.parametrize("page_size,block_size", ((1, 16), (4, 8)))
@pytest.mark.parametrize("kind", CONNECTOR_KINDS)
def test_roundtrip_between_contiguous_and_scattered_slots(kind, page_size, block_size):
    """Blocks that are one run of slots and blocks that are not, in both directions."""
    rng = np.random.default_rng(12)

    def make():
        return connector_pool(kind, size=64, page_size=page_size)

    src, dst = fill_random_bits(make(), rng), fill_random_bits(make(), rng)
    conn = KVConnector(src, HostStore(1 << 20), block_size=block_size)
    tokens = rng.integers(0, 50_000, 32)
    runs = np.arange(17, 49)
    if page_size == 1:
        scattered = rng.permutation(np.arange(1, 65))[:32]
    else:  # pages in descending order: no block of two pages is one run of slots
        scattered = np.concatenate([p * 4 + np.arange(4) for p in range(16, 8, -1)])
    assert conn.store(src, tokens, runs) == 32 // block_size
    for dst_slots in (scattered, runs):
        before, src_raw = bits_by_attr(dst), bits_by_attr(src)
        dst, n = conn.load(dst, tokens, dst_slots)
        assert n == 32
        testing.assert_bits_equal(
            bits_by_attr(dst), model_load(before, src_raw, runs, dst_slots, page_size)
        )
    conn2 = KVConnector(src, HostStore(1 << 20), block_size=block_size)
    assert conn2.store(src, tokens, scattered) == 32 // block_size
    before = bits_by_attr(dst)
    dst, n = conn2.load(dst, tokens, runs)
    testing.assert_bits_equal(
        bits_by_attr(dst), model_load(before, src_raw, scattered, runs, page_size)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("kind", CONNECTOR_KINDS)
def test_roundtrip_jaxkv_pools_every_dtype(kind, dtype):
    rng = np.random.default_rng(1)

    def make():
        return connector_pool(kind, size=64, page_size=4, dtype=dtype, start_layer=2)

    src, dst = fill_random_bits(make(), rng), fill_random_bits(make(), rng)
    conn = KVConnector(src, HostStore(1 << 20), block_size=8)
    roundtrip(src, dst, conn, rng=rng, size=64, page_size=4, n_tokens=21)


@pytest.mark.parametrize("backend", ("numpy", "jax"))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("kind", CONNECTOR_KINDS)
def test_roundtrip_sglang_shaped_objects(kind, dtype, backend):
    rng = np.random.default_rng(2)
    page_size = 4

    def make():
        return bits_by_attr(
            fill_random_bits(connector_pool(kind, size=64, page_size=page_size, dtype=dtype), rng)
        )

    src = _foreign(kind, make(), dtype, page_size, backend)
    dst = _foreign(kind, make(), dtype, page_size, backend)
    conn = KVConnector(src, HostStore(1 << 20))
    assert conn.block_size == page_size
    out = roundtrip(src, dst, conn, rng=rng, size=64, page_size=page_size, n_tokens=14)
    assert out is dst
    for attr in buffer_attrs(dst):  # the object keeps its kind of buffers
        array_type = np.ndarray if backend == "numpy" else jax.Array
        assert all(isinstance(b, array_type) for b in getattr(dst, attr))


@pytest.mark.parametrize("kind", CONNECTOR_KINDS)
def test_roundtrip_sglang_shaped_token_pool_defaults_to_16(kind):
    """An object without `page_size` is a token pool: blocks of 16."""
    rng = np.random.default_rng(3)
    src, dst = (
        _foreign(
            kind,
            bits_by_attr(fill_random_bits(connector_pool(kind, size=64, page_size=1), rng)),
            jnp.bfloat16,
            1,
            "numpy",
        )
        for _ in range(2)
    )
    del src.page_size, dst.page_size
    conn = KVConnector(src, HostStore(1 << 20))
    assert conn.block_size == 16
    roundtrip(src, dst, conn, rng=rng, size=64, page_size=1, n_tokens=40)


def test_jaxkv_and_disk_roundtrip_nsa_index_bytes_with_scales(tmp_path):
    """NSA through a DiskStore: kv rows and each token's fp8 index keys and float32 scale."""
    rng = np.random.default_rng(4)

    def make():
        return connector_pool("nsa", size=64, page_size=16, dtype=jnp.float8_e4m3fn)

    src, dst = fill_random_bits(make(), rng), fill_random_bits(make(), rng)
    conn = KVConnector(src, DiskStore(tmp_path))
    tokens = rng.integers(0, 1000, 32)
    src_slots, dst_slots = np.arange(16, 48), np.arange(48, 80)
    assert conn.store(src, tokens, src_slots) == 2
    before, src_raw = bits_by_attr(dst), bits_by_attr(src)
    dst, n = conn.load(dst, tokens, dst_slots)
    assert n == 32
    testing.assert_bits_equal(
        bits_by_attr(dst), model_load(before, src_raw, src_slots, dst_slots, 16)
    )
    # The dequantised keys read back through the pool API agree as well.
    for layer in range(2):
        np.testing.assert_array_equal(
            np.asarray(dst.get_index_k(layer, dst_slots)),
            np.asarray(src.get_index_k(layer, src_slots)),
        )


@pytest.mark.parametrize("backend", ("numpy", "jax"))
def test_k_only_pools_export_and_reload(backend):
    """K-only pools have `k_buffer` and no `v_buffer`; a connector assuming both would crash."""
    rng = np.random.default_rng(5)
    pool = fill_random_bits(connector_pool("k_only", size=32, page_size=1), rng)
    assert not hasattr(pool, "v_buffer")
    conn = KVConnector(pool, HostStore(1 << 20))
    slots = np.arange(1, 17)
    exported = conn.export_blocks(pool, slots)
    assert set(exported) == {"k"}
    obj = _foreign("k_only", bits_by_attr(pool), jnp.bfloat16, 1, backend)
    obj_conn = KVConnector(obj, HostStore(1 << 20))
    np.testing.assert_array_equal(obj_conn.export_blocks(obj, slots)["k"], exported["k"])
    tokens = np.arange(16)
    assert obj_conn.store(obj, tokens, slots) == 1
    fresh = connector_pool("k_only", size=32, page_size=1)
    fresh_obj = _foreign("k_only", bits_by_attr(fresh), jnp.bfloat16, 1, backend)
    fresh_obj, n = obj_conn.load(fresh_obj, tokens, slots[::-1])
    assert n == 16
    np.testing.assert_array_equal(
        np.asarray(fresh_obj.k_buffer[1]).view(np.uint16)[slots[::-1]],
        np.asarray(pool.k_buffer[1])[slots],
    )


# --------------------------------------------------------------------------------------------
# Construction


def test_unsupported_object_raises_attribute_error_naming_the_layouts():
    with pytest.raises(jaxkv.UnsupportedKVCacheError) as info:
        KVConnector(NotAPool(), HostStore(1 << 20))
    err = info.value
    assert isinstance(err, AttributeError)
    msg = str(err)
    assert msg.startswith("Unsupported KV cache type NotAPool:")
    assert "kv_buffer" in msg and "k_buffer/v_buffer" in msg
    assert jaxkv.connector.UnsupportedKVCacheError is jaxkv.UnsupportedKVCacheError
    with pytest.raises(AttributeError, match=r"^Unsupported KV cache type object:"):
        KVConnector(object(), HostStore(1 << 20))


@pytest.mark.parametrize("page_size,want", ((1, 16), (4, 4), (16, 16), (32, 32)))
def test_block_size_defaults_to_page_size_above_one_else_16(page_size, want):
    pool = connector_pool("mha", size=64, page_size=page_size)
    assert KVConnector(pool, HostStore(1 << 20)).block_size == want


@pytest.mark.parametrize(
    "page_size,block_size", ((4, 6), (4, 2), (16, 8), (1, 0), (4, 0), (4, -4), (1, -16))
)
def test_block_size_must_be_a_positive_multiple_of_the_page_size(page_size, block_size):
    pool = connector_pool("mha", size=64, page_size=page_size)
    with pytest.raises(ValueError, match="block_size"):
        KVConnector(pool, HostStore(1 << 20), block_size=block_size)


@pytest.mark.parametrize("page_size,block_size", ((1, 1), (1, 5), (4, 12), (16, 32)))
def test_block_size_accepts_positive_multiples(page_size, block_size):
    pool = connector_pool("mha", size=64, page_size=page_size)
    assert KVConnector(pool, HostStore(1 << 20), block_size=block_size).block_size == block_size


# --------------------------------------------------------------------------------------------
# export_blocks


_ROW_SHAPES = {
    "mha": {"k": (2, 4), "v": (2, 3)},
    "k_only": {"k": (2, 4)},
    "mla": {"kv": (1, 8)},
    "nsa": {"kv": (1, 8), "index_k": (INDEX_HEAD_DIM + 4,)},
}
_EXPORT_ATTR = {"k": "k_buffer", "v": "v_buffer", "kv": "kv_buffer", "index_k": INDEX_ATTR}


@pytest.mark.parametrize(
    "dtype", (jnp.float32, jnp.bfloat16, jnp.float8_e5m2), ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize("kind", CONNECTOR_KINDS)
def test_export_blocks_shapes_dtypes_and_values(kind, dtype):
    rng = np.random.default_rng(6)
    pool = fill_random_bits(
        connector_pool(kind, size=64, page_size=4, dtype=dtype, layer_num=3, start_layer=1), rng
    )
    conn = KVConnector(pool, HostStore(1 << 20), block_size=8)
    slots = scattered_slots(rng, size=64, page_size=4, n=24)
    exported = conn.export_blocks(pool, slots)
    assert set(exported) == set(_ROW_SHAPES[kind])
    row_shapes = dict(_ROW_SHAPES[kind])
    if kind == "nsa":
        row_shapes["kv"] = nsa_kv_row(dtype)  # packed fp8 rows for fp8 pools
    raw = bits_by_attr(pool)
    for key, arr in exported.items():
        assert isinstance(arr, np.ndarray)
        want_dtype = np.uint8 if key == "index_k" else pool.store_dtype
        chex.assert_shape(arr, (3, 3, 8, *row_shapes[key]))
        assert arr.dtype == want_dtype
        attr = _EXPORT_ATTR[key]
        for layer in range(3):
            rows = token_rows(attr, raw[attr][layer], slots, 4).reshape(3, 8, *arr.shape[3:])
            np.testing.assert_array_equal(
                arr[:, layer].view(rows.dtype), rows, err_msg=f"{key} layer {layer}"
            )


def test_export_blocks_of_zero_blocks():
    pool = connector_pool("mha", size=32, page_size=1)
    exported = KVConnector(pool, HostStore(1 << 20)).export_blocks(pool, np.zeros(0, np.int32))
    chex.assert_shape(exported["k"], (0, 2, 16, 2, 4))


@pytest.mark.parametrize("n", (1, 7, 15, 17, 40))
def test_export_blocks_rejects_partial_blocks(n):
    pool = connector_pool("mha", size=64, page_size=1)
    conn = KVConnector(pool, HostStore(1 << 20))
    with pytest.raises(ValueError, match="block_size"):
        conn.export_blocks(pool, np.arange(1, n + 1))


def test_export_keeps_no_reference_to_live_buffers():
    """A live DLPack export of a pool buffer would turn the next donated update into a copy
    (a new pointer); the connector exports a staging array instead, so after an export the
    update stays in place and the export keeps its old values."""
    pool = connector_pool("mha", size=64, page_size=1, dtype=jnp.bfloat16)
    conn = KVConnector(pool, HostStore(1 << 20))
    slots = np.arange(1, 17)
    ones = jnp.ones((16, 2, 4), jnp.bfloat16)
    pool = pool.set_kv(0, slots, ones, jnp.ones((16, 2, 3), jnp.bfloat16))
    exported = conn.export_blocks(pool, slots)  # kept alive until the end of the test
    snapshot = {k: v.copy() for k, v in exported.items()}
    pointers = testing.buffer_pointers(pool)
    pool = pool.set_kv(0, slots, 2 * ones, jnp.full((16, 2, 3), 2, jnp.bfloat16))
    testing.assert_updated_in_place(pointers, pool)
    chex.assert_trees_all_equal(exported, snapshot)
    assert np.asarray(pool.get_key_buffer(0))[1, 0, 0] == 2


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="the host-side block copy reads CPU buffers through numpy views; accelerators "
    "gather on the device into pinned segments (tested on the pinned path)",
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e5m2, jnp.float32])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cpu_stores_copy_runs_of_blocks_on_the_host_bit_exact(monkeypatch, tmp_path, dtype, tier):
    """A CPU pool's blocks at contiguous slots are copied with numpy from views of the layer
    buffers, with no device gather (whose fresh output memory faulted in every page): straight
    into memory a HostStore lends (nothing copied again), else into reused staging. Runs of
    blocks that are not adjacent, NaN payloads and every layer come back bit-exact, and no view
    outlives the store (the next donated update stays in place)."""
    import jaxkv.connector.host as stores_module
    from jaxkv.connector import _transfers

    def no_device_gather(*args, **kwargs):
        raise AssertionError("the device gather ran")

    monkeypatch.setattr(_transfers, "gather_jit", no_device_gather)
    monkeypatch.setattr(_transfers, "gather_layers_jit", no_device_gather)
    if tier == "host":
        monkeypatch.setattr(stores_module, "_copy_into", None)  # a store-side copy would raise
    pool = connector_pool("mha", size=256, page_size=4, dtype=dtype, layer_num=3)
    rng = np.random.default_rng(11)
    slots = np.concatenate([np.arange(8, 40), np.arange(100, 116), np.arange(60, 76)])
    bits = np.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")
    for layer in range(3):
        # Raw bits in the pool's store dtype, NaN payloads among them.
        k = rng.integers(0, np.iinfo(bits).max, (64, 2, 4), dtype=bits).view(pool.store_dtype)
        v = rng.integers(0, np.iinfo(bits).max, (64, 2, 3), dtype=bits).view(pool.store_dtype)
        pool = pool.set_kv(layer, slots, k, v)
    want = [
        (np.asarray(pool.k_buffer[i])[slots], np.asarray(pool.v_buffer[i])[slots]) for i in range(3)
    ]
    store = HostStore(1 << 20) if tier == "host" else DiskStore(tmp_path)
    conn = KVConnector(pool, store, block_size=16)
    tokens = np.arange(64)
    assert conn.store(pool, tokens, slots) == 4
    # Staging went back for reuse (disk); a HostStore's lent memory needed none.
    assert (conn.transfer_path.staging.idle_bytes > 0) == (tier == "disk")
    pointers = testing.buffer_pointers(pool)
    pool = jax.jit(lambda p: p.set_kv(0, slots[:4], k[:4], v[:4]), donate_argnums=0)(pool)
    testing.assert_updated_in_place(pointers, pool)
    pool, n = conn.load(pool, tokens, slots + 120)
    assert n == 64
    for i, (k_want, v_want) in enumerate(want):
        np.testing.assert_array_equal(np.asarray(pool.k_buffer[i])[slots + 120], k_want)
        np.testing.assert_array_equal(np.asarray(pool.v_buffer[i])[slots + 120], v_want)


@pytest.mark.parametrize("pinned", [False, True], ids=["cpu", "pinned"])
def test_a_load_never_makes_a_jitted_step_compile_again(monkeypatch, pinned):
    """jit keys its programs by whether arguments are committed to a device; a pool is
    committed from `create` on, so a load (whose staging is committed) leaves every jitted step
    holding the pool with the one program it had (a recompile would stall a later request).
    The pinned path is the accelerator's, run on CPU."""
    pool = connector_pool("mha", size=64, page_size=1, dtype=jnp.bfloat16)
    assert all(b.committed for b in pool.k_buffer + pool.v_buffer)
    ones = jnp.ones((32, 2, 4), jnp.bfloat16)

    @testing.traced_once
    def write(p, loc):
        return p.set_kv(0, loc, ones, ones[..., :3])

    step = jax.jit(write, donate_argnums=0)
    conn = KVConnector(pool, HostStore(1 << 20), transfer="pinned" if pinned else None)
    tokens, slots = np.arange(32), np.arange(1, 33)
    pool = step(pool, jnp.asarray(slots))
    assert conn.store(pool, tokens, slots) == 2
    for dst in (slots + 30, slots):
        pool, n = conn.load(pool, tokens, dst)
        assert n == 32
        pool = step(pool, jnp.asarray(dst))  # traced once: a second trace fails the test
    assert step._cache_size() == 1  # and compiled once: committed arguments keep one program


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="control of the CPU mechanism: np.from_dlpack views host memory only, so a live "
    "numpy export of a pool buffer (which makes donation copy) exists on CPU alone",
)
def test_a_live_export_of_the_buffer_itself_makes_the_update_copy():
    """Control for the test above: its pointer check can fail. A live numpy export of the pool
    buffer itself turns the next donated update into a copy (a new pointer)."""
    pool = connector_pool("mha", size=64, page_size=1, dtype=jnp.bfloat16)
    slots = np.arange(1, 17)
    ones = jnp.ones((16, 2, 4), jnp.bfloat16)
    live = np.from_dlpack(pool.k_buffer[0])
    pointers = testing.buffer_pointers(pool.k_buffer[0])
    with pytest.warns(jaxkv.CopyWarning, match="copied them whole"):  # reported, not silent
        pool = pool.set_kv(0, slots, 3 * ones, jnp.full((16, 2, 3), 3, jnp.bfloat16))
    with pytest.raises(AssertionError, match="moved"):
        testing.assert_updated_in_place(pointers, pool.k_buffer[0])
    del live


# --------------------------------------------------------------------------------------------
# lookup / store / load


@pytest.fixture
def mha():
    """A filled token pool, a HostStore connector on it, 4 blocks of token ids and slots."""
    rng = np.random.default_rng(7)
    pool = fill_random_bits(connector_pool("mha", size=128, page_size=1), rng)
    store = HostStore(1 << 20)
    conn = KVConnector(pool, store)
    tokens = rng.integers(0, 30_000, 64)
    slots = rng.permutation(np.arange(1, 129))[:64]
    return pool, store, conn, tokens, slots


def test_lookup_counts_whole_leading_blocks(mha):
    pool, store, conn, tokens, slots = mha
    assert conn.lookup(tokens) == 0
    assert conn.store(pool, tokens[:40], slots[:40]) == 2  # the 8-token tail is not stored
    assert conn.lookup(tokens) == 32
    assert conn.lookup(tokens[:40]) == 32
    assert conn.lookup(tokens[:31]) == 16
    assert conn.lookup(tokens[:15]) == 0
    assert conn.lookup([]) == 0
    assert conn.lookup(tokens.tolist()) == 32
    assert conn.lookup(tokens.astype(np.int32)) == 32
    changed = tokens.copy()
    changed[20] += 1
    assert conn.lookup(changed) == 16
    changed[0] += 1
    assert conn.lookup(changed) == 0


def test_lookup_stops_at_the_first_gap(tmp_path):
    rng = np.random.default_rng(8)
    pool = fill_random_bits(connector_pool("mha", size=64, page_size=1), rng)
    store = DiskStore(tmp_path)
    conn = KVConnector(pool, store)
    tokens, slots = rng.integers(0, 9999, 64), np.arange(1, 65)
    assert conn.store(pool, tokens, slots) == 4
    os.unlink(record_path(tmp_path, conn.block_hashes(tokens)[1]))
    assert conn.lookup(tokens) == 16
    dst = connector_pool("mha", size=64, page_size=1)
    before = bits_by_attr(dst)
    dst, n = conn.load(dst, tokens, slots)
    assert n == 16
    testing.assert_bits_equal(
        bits_by_attr(dst), model_load(before, bits_by_attr(pool), slots[:16], slots[:16], 1)
    )


def test_lookup_changes_no_data(mha):
    pool, store, conn, tokens, slots = mha
    conn.store(pool, tokens, slots)
    held = {k: v for k, v in store.stats().items() if k in ("blocks", "bytes", "blocks_stored")}
    raw = testing.buffer_bits(pool)
    for _ in range(3):
        assert conn.lookup(tokens) == 64
        assert conn.lookup(tokens[::-1]) == 0
    after = store.stats()
    assert {k: after[k] for k in held} == held
    testing.assert_unchanged(raw, pool)


def test_store_returns_newly_written_blocks_and_skips_present_ones(mha):
    pool, store, conn, tokens, slots = mha
    assert conn.store(pool, tokens[:32], slots[:32]) == 2
    assert conn.store(pool, tokens[:32], slots[:32]) == 0
    assert store.stats()["blocks_stored"] == 2
    assert conn.store(pool, tokens[:63], slots[:63]) == 1  # block 2 is new, 3 is partial
    assert conn.store(pool, tokens, slots) == 1
    assert conn.store(pool, tokens, slots) == 0
    st = store.stats()
    assert st["blocks_stored"] == st["blocks"] == 4
    assert conn.stats()["blocks_stored"] == 4
    assert conn.store(pool, tokens[:15], slots[:15]) == 0


def test_skipped_blocks_keep_the_first_data_written(mha):
    """A present block is not overwritten, even from different rows."""
    pool, store, conn, tokens, slots = mha
    conn.store(pool, tokens[:16], slots[:16])
    first = conn.export_blocks(pool, slots[:16])
    other = slots[16:32]
    assert conn.store(pool, tokens[:16], other) == 0
    dst = connector_pool("mha", size=128, page_size=1)
    dst, n = conn.load(dst, tokens[:16], slots[:16])
    assert n == 16
    chex.assert_trees_all_equal(conn.export_blocks(dst, slots[:16]), first)


def test_load_returns_the_longest_prefix_and_leaves_other_rows(mha):
    pool, store, conn, tokens, slots = mha
    conn.store(pool, tokens[:32], slots[:32])
    rng = np.random.default_rng(9)
    dst = fill_random_bits(connector_pool("mha", size=128, page_size=1), rng)
    dst_slots = rng.permutation(np.arange(1, 129))[:64]
    before = bits_by_attr(dst)
    dst, n = conn.load(dst, tokens, dst_slots)
    assert n == 32
    testing.assert_bits_equal(
        bits_by_attr(dst), model_load(before, bits_by_attr(pool), slots[:32], dst_slots[:32], 1)
    )
    # Diverging after the first block: only that block is a hit.
    other = tokens.copy()
    other[16:] = rng.integers(30_000, 40_000, 48)
    before = bits_by_attr(dst)
    dst, n = conn.load(dst, other, dst_slots)
    assert n == 16
    testing.assert_bits_equal(
        bits_by_attr(dst), model_load(before, bits_by_attr(pool), slots[:16], dst_slots[:16], 1)
    )


def test_load_with_nothing_stored_is_a_no_op(mha):
    pool, store, conn, tokens, slots = mha
    dst = fill_random_bits(connector_pool("mha", size=128, page_size=1), np.random.default_rng(10))
    before = testing.buffer_bits(dst)
    dst, n = conn.load(dst, tokens, slots)
    assert n == 0
    testing.assert_unchanged(before, dst)


@pytest.mark.parametrize("method", ("store", "load"))
@pytest.mark.parametrize("n_slots", (63, 65, 0))
def test_slots_and_token_ids_must_have_equal_length(mha, method, n_slots):
    pool, store, conn, tokens, slots = mha
    conn.store(pool, tokens, slots)
    bad = np.arange(1, n_slots + 1)
    with pytest.raises(ValueError, match="slots"):
        getattr(conn, method)(pool, tokens, bad)


def test_salt_isolates_tenants(mha):
    pool, store, conn, tokens, slots = mha
    assert conn.store(pool, tokens, slots, salt="a") == 4
    assert conn.lookup(tokens, salt="a") == 64
    for other in ("b", None, "", b"b"):
        assert conn.lookup(tokens, salt=other) == 0
        dst = connector_pool("mha", size=128, page_size=1)
        assert conn.load(dst, tokens, slots, salt=other)[1] == 0
    assert conn.store(pool, tokens, slots, salt="b") == 4  # a separate copy for tenant b
    dst = connector_pool("mha", size=128, page_size=1)
    assert conn.load(dst, tokens, slots, salt="a")[1] == 64


def test_interleaved_tenants_hash_each_prompt_once(mha, monkeypatch):
    """A serving loop's lookup, load and store of one prompt hash its blocks once, also when
    two tenants' (or a sharded pool's groups') requests interleave: a chain is kept per root."""
    from jaxkv.connector import _hashing

    pool, store, conn, tokens, slots = mha
    chains = []
    chain = _hashing.chain
    monkeypatch.setattr(_hashing, "chain", lambda *a: chains.append(a[1]) or chain(*a))
    for salt in ("a", "b"):
        assert conn.store(pool, tokens, slots, salt=salt) == 4
    assert len(chains) == 2
    for salt in ("a", "b", "a", "b"):
        assert conn.lookup(tokens, salt=salt) == 64
        dst = connector_pool("mha", size=128, page_size=1)
        assert conn.load(dst, tokens[:32], slots[:32], salt=salt)[1] == 32
    assert len(chains) == 2, "each salt's chain was kept across the other's requests"


def test_load_rejects_records_of_other_blocks():
    """A store that does not verify (a HostStore holding a record under another block's key)
    still never gets its data loaded: the connector checks each record's tokens."""
    rng = np.random.default_rng(11)
    pool = fill_random_bits(connector_pool("mha", size=64, page_size=1), rng)
    store = HostStore(1 << 20)
    conn = KVConnector(pool, store)
    a, b = rng.integers(0, 999, 32), rng.integers(1000, 1999, 32)
    conn.store(pool, a, np.arange(1, 33))
    key_a0 = conn.block_hashes(a)[0]
    key_b0 = conn.block_hashes(b)[0]
    record = store.get(key_a0)
    store.put(dataclasses.replace(record, key=key_b0))
    assert conn.lookup(b) == 16  # present by key...
    dst = connector_pool("mha", size=64, page_size=1)
    before = testing.buffer_bits(dst)
    dst, n = conn.load(dst, b, np.arange(1, 33))
    assert n == 0  # ...but never loaded
    testing.assert_unchanged(before, dst)
    assert conn.stats()["verification_failures"] == 1


def test_load_rejects_a_pool_of_another_layout(mha):
    pool, store, conn, tokens, slots = mha
    other = connector_pool("mha", size=128, page_size=1, dtype=jnp.float16)
    with pytest.raises(ValueError, match="pool"):
        conn.load(other, tokens, slots)
    with pytest.raises(ValueError, match="pool"):
        conn.store(other, tokens, slots)


def test_layout_mismatch_names_each_differing_field():
    pool = MHAPool.create(size=64, page_size=16, head_num=8, head_dim=4, layer_num=2)
    conn = KVConnector(pool, HostStore(1 << 20))
    other = MHAPool.create(size=64, page_size=1, head_num=4, head_dim=4, layer_num=2)
    with pytest.raises(ValueError, match="expected the layout") as err:
        conn.store(other, np.arange(16), np.arange(16))
    message = str(err.value)
    assert "page_size: expected 16, got 1" in message
    assert "head_num: expected 8, got 4" in message
    for same in ("kind:", "dtype:", "layer_num:", "head_dim:", "v_head_dim:"):
        assert same not in message  # only the fields that differ are named


def test_layout_mismatch_with_a_foreign_pool_names_the_rows_that_differ():
    pool = MHAPool.create(size=32, head_num=2, head_dim=4, layer_num=1)
    conn = KVConnector(pool, HostStore(1 << 20))
    foreign = _Foreign(
        k_buffer=[np.zeros((33, 2, 8), np.uint16)],
        v_buffer=[np.zeros((33, 2, 4), np.uint16)],
        dtype="bfloat16",
    )
    with pytest.raises(ValueError, match=r"k rows: expected \(2, 4\) uint16, got \(2, 8\)"):
        conn.export_blocks(foreign, np.arange(16))


class _Foreign:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def test_a_subclass_of_a_pool_kind_goes_through_the_connector():
    class MyPool(MHAPool):
        """A user's pool: its kind is inherited, whatever its name."""

    pool = MyPool.create(size=64, head_num=2, head_dim=4, layer_num=2)
    assert type(pool) is MyPool
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((16, 2, 4)), jnp.bfloat16)
    pool = pool.set_kv(0, np.arange(1, 17), k, k)
    conn = KVConnector(pool, HostStore(1 << 20))
    plain = MHAPool.create(size=64, head_num=2, head_dim=4, layer_num=2)
    assert conn.fingerprint == KVConnector(plain, HostStore(1)).fingerprint  # same blocks
    tokens = np.arange(16)
    assert conn.store(pool, tokens, np.arange(1, 17)) == 1
    pool, n = conn.load(pool, tokens, np.arange(20, 36))
    assert n == 16 and type(pool) is MyPool
    got = np.asarray(pool.k_buffer[0])
    np.testing.assert_array_equal(got[20:36], got[1:17])
    step = jax.jit(lambda p, loc, k: p.set_kv(1, loc, k, k), donate_argnums=0)
    pool = step(pool, jnp.arange(1, 17), k)  # a pytree like MHAPool
    assert type(pool) is MyPool
    np.testing.assert_array_equal(np.asarray(pool.k_buffer[1])[1:17], got[1:17])


def test_connector_stats(mha):
    pool, store, conn, tokens, slots = mha
    conn.store(pool, tokens[:48], slots[:48])
    conn.lookup(tokens)
    dst = connector_pool("mha", size=128, page_size=1)
    dst, n = conn.load(dst, tokens, slots)
    st = conn.stats()
    block_bytes = 2 * 16 * 2 * (4 + 3) * 2  # layers * tokens * heads * (k + v dims) * 2 bytes
    assert st["blocks_stored"] == 3 and st["bytes_stored"] == 3 * block_bytes
    assert st["blocks_loaded"] == 3 and st["bytes_loaded"] == 3 * block_bytes
    assert st["lookups"] == 1 and st["lookup_hits"] == 3 and st["lookup_misses"] == 1
    assert st["loads"] == 1 and st["hits"] == 3 == st["blocks_loaded"] and st["misses"] == 1
    assert st["verification_failures"] == 0
    assert st["store"] == store.stats()


# --------------------------------------------------------------------------------------------
# The accelerator path (pinned host memory), run on CPU devices


@pytest.fixture
def pinned(monkeypatch):
    """Runs the accelerator transfer path on CPU: blocks leave the device as segments in
    pinned host memory, and loads send them back (or stage them in pinned memory).

    Yields the calls made to `segment_staging` (segments sent back whole); connectors made
    while it is active take the pinned path."""
    from jaxkv.connector import _transfers

    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in kinds:
        pytest.skip("this jax has no pinned_host memory on CPU devices")
    calls = []
    original = _transfers.PinnedPath.segment_staging

    def spy(self, segment, keys, index, device):
        calls.append(np.asarray(index).copy())
        return original(self, segment, keys, index, device)

    monkeypatch.setattr(_transfers.PinnedPath, "segment_staging", spy)
    made = KVConnector.__init__

    def pinned_init(self, *args, **kwargs):
        made(self, *args, **{"transfer": "pinned", **kwargs})

    monkeypatch.setattr(KVConnector, "__init__", pinned_init)
    return calls


@pytest.mark.parametrize("page_size,block_size", ((1, 16), (4, 8)))
@pytest.mark.parametrize("kind", CONNECTOR_KINDS)
def test_pinned_store_keeps_the_transfer_output_and_load_sends_it_back(
    pinned, kind, page_size, block_size
):
    rng = np.random.default_rng(20)

    def make():
        return connector_pool(kind, size=64, page_size=page_size)

    src, dst = fill_random_bits(make(), rng), fill_random_bits(make(), rng)
    store = HostStore(1 << 20, preallocate_bytes=0)
    conn = KVConnector(src, store, block_size=block_size)
    tokens = rng.integers(0, 50_000, 32)
    src_slots = scattered_slots(rng, size=64, page_size=page_size, n=32)
    dst_slots = scattered_slots(rng, size=64, page_size=page_size, n=32)
    assert conn.store(src, tokens, src_slots) == 32 // block_size
    records = [store.get(k) for k in conn.block_hashes(tokens)]
    segment = records[0].source[0]
    assert all(r.source == (segment, j) for j, r in enumerate(records))
    for name, arr in segment.arrays.items():
        assert arr.sharding.memory_kind == "pinned_host"
        for j, record in enumerate(records):  # the records are the transfer's own memory
            part = record.parts[name]
            assert part.ctypes.data == segment.host[name][j].ctypes.data
            assert not part.flags.writeable
    assert store.memory_bytes == segment.nbytes  # kept whole, no arena, no copy
    before, src_raw = bits_by_attr(dst), bits_by_attr(src)
    dst, n = conn.load(dst, tokens, dst_slots)
    assert n == 32 and len(pinned) == 1  # one segment, sent back whole
    testing.assert_bits_equal(
        bits_by_attr(dst), model_load(before, src_raw, src_slots, dst_slots, page_size)
    )


def test_pinned_load_of_a_few_blocks_stages_them_in_pinned_memory(pinned):
    rng = np.random.default_rng(21)
    src = fill_random_bits(connector_pool("mha", size=256, page_size=1), rng)
    dst = fill_random_bits(connector_pool("mha", size=256, page_size=1), rng)
    conn = KVConnector(src, HostStore(1 << 22))
    tokens = rng.integers(0, 50_000, 256)
    src_slots, dst_slots = np.arange(1, 257), rng.permutation(np.arange(1, 257))
    assert conn.store(src, tokens, src_slots) == 16  # one segment of 16 blocks
    src_raw = bits_by_attr(src)
    before = bits_by_attr(dst)
    dst, n = conn.load(dst, tokens[:16], dst_slots[:16])  # 1 block of 16: below the 1/8 share
    assert n == 16 and pinned == []
    assert "pinned" in conn.transfer_path.staging.idle_kinds(), "went through pinned staging"
    testing.assert_bits_equal(
        bits_by_attr(dst), model_load(before, src_raw, src_slots[:16], dst_slots[:16], 1)
    )
    before = bits_by_attr(dst)
    dst, n = conn.load(dst, tokens[:64], dst_slots[:64])  # 4 of 16 blocks: the segment, whole
    assert n == 64 and len(pinned) == 1
    np.testing.assert_array_equal(pinned[0], np.arange(4))
    testing.assert_bits_equal(
        bits_by_attr(dst), model_load(before, src_raw, src_slots[:64], dst_slots[:64], 1)
    )


def test_pinned_load_waits_for_the_device_only_when_host_staging_is_reused(pinned, monkeypatch):
    """A segment sent back whole is staging nobody reuses: the load returns with its scatter
    queued, and the caller's next step runs behind it. Pinned staging is reused by the next
    load, so that path waits for the scatter to have read it."""
    waits = []
    wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waits.append(1) or wait(x))
    rng = np.random.default_rng(24)
    src = fill_random_bits(connector_pool("mha", size=256, page_size=1), rng)
    conn = KVConnector(src, HostStore(1 << 22))
    tokens = rng.integers(0, 50_000, 256)
    slots = np.arange(1, 257)
    assert conn.store(src, tokens, slots) == 16
    src_raw = bits_by_attr(src)
    for n_tokens, segments, waited in ((256, 1, False), (16, 1, True)):
        dst = fill_random_bits(connector_pool("mha", size=256, page_size=1), rng)
        before, waits[:] = bits_by_attr(dst), []
        dst, n = conn.load(dst, tokens[:n_tokens], slots[:n_tokens])
        assert n == n_tokens and len(pinned) == segments and bool(waits) == waited
        want = model_load(before, src_raw, slots[:n_tokens], slots[:n_tokens], 1)
        testing.assert_bits_equal(bits_by_attr(dst), want)


def test_pinned_load_spanning_segments_and_disk_records(pinned, tmp_path):
    """A prefix stored by two calls (two segments) loads bit-exact; so do records from disk,
    which carry no segment and go through pinned staging."""
    rng = np.random.default_rng(22)
    src = fill_random_bits(connector_pool("nsa", size=128, page_size=16), rng)
    tokens = rng.integers(0, 50_000, 64)
    src_slots = np.arange(16, 80)
    for store in (HostStore(1 << 22), DiskStore(tmp_path)):
        dst = fill_random_bits(connector_pool("nsa", size=128, page_size=16), rng)
        conn = KVConnector(src, store)
        assert conn.store(src, tokens[:32], src_slots[:32]) == 2
        assert conn.store(src, tokens, src_slots) == 2  # blocks 2 and 3: a second segment
        calls = len(pinned)
        dst_slots = np.concatenate([p * 16 + np.arange(16) for p in (7, 2, 5, 1)])
        before, src_raw = bits_by_attr(dst), bits_by_attr(src)
        dst, n = conn.load(dst, tokens, dst_slots)
        assert n == 64
        assert len(pinned) - calls == (2 if isinstance(store, HostStore) else 0)
        testing.assert_bits_equal(
            bits_by_attr(dst), model_load(before, src_raw, src_slots, dst_slots, 16)
        )


def test_a_pinned_load_of_segments_and_other_records_is_one_write(pinned, monkeypatch):
    """Two segments sent back whole and a record staged on the host reach the pool in one
    scatter: when staging the last record fails, the pool is neither changed nor consumed."""
    from jaxkv.connector import _transfers

    rng = np.random.default_rng(23)
    src = fill_random_bits(connector_pool("mha", size=128, page_size=1), rng)
    store = HostStore(1 << 22)
    conn = KVConnector(src, store, block_size=16)
    tokens = rng.integers(0, 50_000, 48)
    assert conn.store(src, tokens[:16], np.arange(1, 17)) == 1  # segment 1
    assert conn.store(src, tokens[:32], np.arange(1, 33)) == 1  # segment 2
    plain = KVConnector(src, store, block_size=16, transfer="gather")  # a copied record
    assert plain.store(src, tokens, np.arange(1, 49)) == 1
    dst = fill_random_bits(connector_pool("mha", size=128, page_size=1), rng)
    before, kept = bits_by_attr(dst), testing.buffer_bits(dst)
    real = _transfers.as_one_array

    def failing(arrays):
        raise MemoryError("no staging")

    monkeypatch.setattr(_transfers, "as_one_array", failing)
    with pytest.raises(MemoryError):
        conn.load(dst, tokens, np.arange(60, 108))
    assert not dst.consumed  # the segments were staged, but nothing was written
    testing.assert_unchanged(kept, dst)
    del pinned[:]
    monkeypatch.setattr(_transfers, "as_one_array", real)
    src_raw = bits_by_attr(src)
    dst, n = conn.load(dst, tokens, np.arange(60, 108))
    assert n == 48 and len(pinned) == 2
    want = model_load(before, src_raw, np.arange(1, 49), np.arange(60, 108), 1)
    testing.assert_bits_equal(bits_by_attr(dst), want)


@pytest.mark.parametrize("kind", ("mha", "nsa"))
def test_pinned_roundtrip_sglang_shaped_jax_buffers(pinned, kind):
    rng = np.random.default_rng(23)

    def make():
        return bits_by_attr(
            fill_random_bits(connector_pool(kind, size=64, page_size=4, dtype=jnp.bfloat16), rng)
        )

    src = _foreign(kind, make(), jnp.bfloat16, 4, "jax")
    dst = _foreign(kind, make(), jnp.bfloat16, 4, "jax")
    conn = KVConnector(src, HostStore(1 << 20))
    out = roundtrip(src, dst, conn, rng=rng, size=64, page_size=4, n_tokens=14)
    assert out is dst and len(pinned) == 1


# --------------------------------------------------------------------------------------------
# min_block_count


def test_min_block_count():
    assert min_block_count([5, 3, 9]) == 3
    assert min_block_count([7]) == 7
    assert min_block_count((0, 4)) == 0
    assert min_block_count(np.array([8, 6])) == 6
    assert min_block_count(iter([2, 1])) == 1
    with pytest.raises(ValueError):
        min_block_count([])
    with pytest.raises(ValueError):
        min_block_count([3, -1])


# --------------------------------------------------------------------------------------------
# The example program


def test_example_offload_reload_runs(capsys):
    assert run_example("offload_reload.py") == 0
    assert "bit-exact: True" in capsys.readouterr().out


def test_connector_stats_count_block_hits_misses_and_the_stores_failures(tmp_path):
    rng = np.random.default_rng(12)
    pool = fill_random_bits(connector_pool("mha", size=128, page_size=1), rng)
    store = DiskStore(tmp_path / "blocks", capacity_bytes=None)
    conn = KVConnector(pool, store)
    tokens = rng.integers(0, 999, 64)
    assert conn.store(pool, tokens[:32], np.arange(1, 33)) == 2
    assert conn.lookup(tokens) == 32  # 2 of 4 full blocks
    st = conn.stats()
    assert (st["lookup_hits"], st["lookup_misses"]) == (2, 2)
    assert (st["hits"], st["misses"], st["loads"]) == (0, 0, 0)  # lookups are not loads
    # Damage the second stored block on disk: the load stops after the first one.
    second = conn.block_hashes(tokens)[1]
    path = tmp_path / "blocks" / second[:2] / f"{second}.kvb"
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    dst = connector_pool("mha", size=128, page_size=1)
    dst, n = conn.load(dst, tokens, np.arange(40, 104))
    assert n == 16
    st = conn.stats()
    assert (st["hits"], st["misses"], st["loads"]) == (1, 3, 1)
    assert (st["lookup_hits"], st["lookup_misses"], st["lookups"]) == (2, 2, 1)
    assert st["verification_failures"] == 1 == st["store"]["verification_failures"]
    assert st["evictions"] == st["store"]["evictions"] == 0
    assert st["io_errors"] == 0 and st["pending_blocks"] == 0


def test_lookup_and_load_from_a_block_on_skip_the_blocks_held_elsewhere():
    """A prefix cache holds a prompt's first blocks on the device: the connector is asked for
    the blocks after them only, keyed by the whole prefix's chain, and reads no other key."""
    pool = random_mha_pool(7, size=64)
    full = HostStore(1 << 20)
    conn = KVConnector(pool, full, block_size=4)
    tokens, src = np.arange(100, 116), np.arange(1, 17)
    assert conn.store(pool, tokens, src) == 4
    keys = conn.block_hashes(tokens)
    later = HostStore(1 << 20)  # holds blocks 1.. only: block 0 lives on the device
    for key in keys[1:]:
        later.put(full.get(key))
    asked = []
    get_many = later.get_many
    later.get_many = lambda ks, **kw: asked.extend(ks) or get_many(ks, **kw)
    conn = KVConnector(pool, later, block_size=4)
    assert conn.lookup(tokens) == 0
    assert conn.lookup(tokens, start=4) == 12 and conn.lookup(tokens, start=8) == 8
    assert conn.lookup(tokens, start=16) == 0
    want = raw_rows(pool, src[4:])
    dst = np.arange(40, 52)
    others = raw_rows(pool, np.setdiff1d(np.arange(65), dst))
    pool, n = conn.load(pool, tokens, dst, start=4)
    assert n == 12 and asked == keys[1:]
    assert np.array_equal(raw_rows(pool, dst), want)
    assert np.array_equal(raw_rows(pool, np.setdiff1d(np.arange(65), dst)), others)
    for bad in (2, -4, 20, 4.0, True):
        with pytest.raises(ValueError, match="start: expected a multiple of block_size=4"):
            conn.lookup(tokens, start=bad)
    with pytest.raises(ValueError, match=r"slots: expected shape \(12,\)"):
        conn.load(pool, tokens, np.arange(40, 56), start=4)


# --------------------------------------------------------------------------------------------
# Hostile arguments: `block_hashes`, `lookup`, `store` and `load` give the right result, or a
# ValueError/TypeError/IndexError naming the argument and change neither store nor pool

FUZZ_BLOCK = 4


def _fuzz_pool() -> MHAPool:
    return random_mha_pool(0, size=32)


@pytest.fixture(scope="module")
def fuzz_conn():
    return KVConnector(_fuzz_pool(), HostStore(1 << 20), block_size=FUZZ_BLOCK)


_TOKENS = st.one_of(
    st.lists(st.integers(0, 50), max_size=3 * FUZZ_BLOCK).map(np.array),
    HOSTILE_ARG,
    st.lists(st.integers(2**32 - 2, 2**32 + 2), min_size=1, max_size=FUZZ_BLOCK).map(np.array),
)


@settings(
    max_examples=6 * settings.default.max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    st.sampled_from(["block_hashes", "lookup", "store", "load"]),
    _TOKENS,
    st.one_of(
        st.none(), HOSTILE_ARG, st.lists(st.integers(-2, 40), max_size=3 * FUZZ_BLOCK).map(np.array)
    ),
    st.one_of(st.none(), st.sampled_from(["", "t", b"t"]), HOSTILE_ARG),
)
def test_fuzz_connector(fuzz_conn, method, tokens, slots, salt):
    conn = fuzz_conn
    store = conn.backend
    kept = dict(store.stats())
    src = _fuzz_pool()
    before = testing.buffer_bits(src)
    args = {"block_hashes": (tokens,), "lookup": (tokens,)}.get(method, (src, tokens, slots))
    try:
        out = getattr(conn, method)(*args, salt=salt)
    except BOUNDARY_ERRORS as err:
        assert names_an_argument(err, ("token_ids", "slots", "salt")), f"{err!r}"
        after = store.stats()
        assert (after["blocks"], after["blocks_stored"]) == (kept["blocks"], kept["blocks_stored"])
        testing.assert_unchanged(before, src)
        return
    assert salt is None or isinstance(salt, (str, bytes)), f"salt {salt!r} was taken"
    n_blocks = len(np.asarray(tokens)) // FUZZ_BLOCK
    if method == "block_hashes":
        assert len(out) == n_blocks and all(re.fullmatch("[0-9a-f]{64}", h) for h in out)
    elif method == "lookup":
        assert out % FUZZ_BLOCK == 0 and 0 <= out <= n_blocks * FUZZ_BLOCK
    elif method == "store":
        assert 0 <= out <= n_blocks
        assert conn.lookup(tokens, salt=salt) == n_blocks * FUZZ_BLOCK
    else:
        pool, n = out
        assert n == conn.lookup(tokens, salt=salt)
        # Bit-exact: what was loaded at slots[:n] is what the source pool held there when
        # the blocks were stored (every store in this test stores from `_fuzz_pool()`).
        got = np.array(pool.k_buffer[0])[np.asarray(slots)[:n]]
        want = np.array(_fuzz_pool().k_buffer[0])[np.asarray(slots)[:n]]
        np.testing.assert_array_equal(got, want)


def test_a_connector_given_another_store_uses_it_from_the_next_call():
    pool = MHAPool.create(size=64, head_num=1, head_dim=2, layer_num=1, dtype=jnp.float32)
    tokens, slots = np.arange(16), np.arange(1, 17)
    first, second = HostStore(1 << 20), HostStore(1 << 20)
    conn = KVConnector(pool, first, block_size=8)
    assert conn.store(pool, tokens, slots) == 2
    conn.backend = second
    assert conn.backend is second and conn.lookup(tokens) == 0
    assert conn.store(pool, tokens, slots) == 2 and len(second) == 2
    with pytest.raises(TypeError, match="store: expected a BlockStore"):
        conn.backend = {}
    assert conn.backend is second
