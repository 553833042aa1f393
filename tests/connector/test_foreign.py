"""The connector on SGLang-shaped objects holding numpy and jax buffers: the logical dtype in the
layout key, sharing blocks with jaxkv pools, and loads that refuse before writing anything.

torch tensors and SGLang's own pool classes are covered by tests_sglang/ (they need torch).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import random_bits

import jaxkv
from jaxkv import UnsupportedKVCacheError, testing
from jaxkv.connector import HostStore, KVConnector

SIZE, PAGE = 32, 4
TOKENS = np.arange(16)
SLOTS = np.arange(PAGE, PAGE + 16)


class Pool:
    """An SGLang-shaped pool: per-layer lists and whatever attributes the test gives it."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _mha_layers(rng, dtype, layers=2, rows=SIZE + PAGE):
    return [random_bits(rng, (rows, 2, 8), dtype) for _ in range(layers)]


def _fp8_pool() -> jaxkv.MHAPool:
    return jaxkv.MHAPool.create(
        size=SIZE, page_size=PAGE, dtype=jnp.float8_e4m3fn, head_num=2, head_dim=8, layer_num=2
    )


@pytest.mark.parametrize(
    "dtype",
    ["float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), jnp.float8_e4m3fn],
    ids=["str", "numpy", "jnp"],
)
def test_dtype_attribute_keys_the_layout_and_shares_blocks_with_jaxkv(dtype):
    """uint8 buffers under a float8 `dtype` (SGLang's fp8 pools) key like a jaxkv fp8 pool."""
    rng = np.random.default_rng(0)
    src = Pool(k_buffer=_mha_layers(rng, np.uint8), v_buffer=_mha_layers(rng, np.uint8))
    src.page_size, src.dtype = PAGE, dtype
    conn = KVConnector(src, HostStore(1 << 20))
    assert conn.layout.dtype == "float8_e4m3fn"
    assert conn.fingerprint == KVConnector(_fp8_pool(), HostStore(1 << 20)).fingerprint
    assert conn.store(src, TOKENS, SLOTS) == 4
    dst, n = conn.load(_fp8_pool(), TOKENS, SLOTS[::-1])
    assert n == 16
    for attr in ("k_buffer", "v_buffer"):
        for li in range(2):
            got = np.asarray(getattr(dst, attr)[li])[SLOTS[::-1]]
            np.testing.assert_array_equal(got, getattr(src, attr)[li][SLOTS])
    # And back: blocks of the jaxkv pool load into the object.
    back = KVConnector(dst, HostStore(1 << 20))
    assert back.store(dst, TOKENS, SLOTS) == 4
    obj = Pool(k_buffer=_mha_layers(rng, np.uint8), v_buffer=_mha_layers(rng, np.uint8))
    obj.page_size, obj.dtype = PAGE, dtype
    back.load(obj, TOKENS, SLOTS)
    for attr in ("k_buffer", "v_buffer"):
        for li in range(2):
            np.testing.assert_array_equal(
                getattr(obj, attr)[li][SLOTS], np.asarray(getattr(dst, attr)[li])[SLOTS]
            )


def test_without_a_dtype_attribute_the_buffers_dtype_keys_the_layout():
    rng = np.random.default_rng(1)
    obj = Pool(k_buffer=_mha_layers(rng, np.uint8), v_buffer=_mha_layers(rng, np.uint8))
    obj.page_size = PAGE
    conn = KVConnector(obj, HostStore(1 << 20))
    assert conn.layout.dtype == "uint8"
    assert conn.fingerprint != KVConnector(_fp8_pool(), HostStore(1 << 20)).fingerprint
    with pytest.raises(ValueError, match="expected the layout"):
        conn.load(_fp8_pool(), TOKENS, SLOTS)


def test_a_dtype_attribute_that_is_no_dtype_is_named():
    rng = np.random.default_rng(2)
    obj = Pool(k_buffer=_mha_layers(rng, np.uint8), page_size=PAGE, dtype=object())
    with pytest.raises(ValueError, match=r"pool\.dtype: expected a dtype"):
        KVConnector(obj, HostStore(1 << 20))


def _stored_connector(rng, dtype=ml_dtypes.bfloat16):
    src = Pool(k_buffer=_mha_layers(rng, dtype), v_buffer=_mha_layers(rng, dtype), page_size=PAGE)
    conn = KVConnector(src, HostStore(1 << 20))
    assert conn.store(src, TOKENS, SLOTS) == 4
    return conn


@pytest.mark.parametrize("readonly", [("v_buffer", 0), ("v_buffer", 1), ("k_buffer", 1)])
def test_a_read_only_layer_fails_the_load_before_anything_is_written(readonly):
    rng = np.random.default_rng(3)
    conn = _stored_connector(rng)
    dst = Pool(
        k_buffer=_mha_layers(rng, ml_dtypes.bfloat16),
        v_buffer=_mha_layers(rng, ml_dtypes.bfloat16),
        page_size=PAGE,
    )
    attr, li = readonly
    getattr(dst, attr)[li].flags.writeable = False
    before = testing.buffer_bits([dst.k_buffer, dst.v_buffer])
    with pytest.raises(TypeError, match=rf"{attr}\[{li}\]: cannot write into a read-only"):
        conn.load(dst, TOKENS, SLOTS)
    testing.assert_unchanged(before, [dst.k_buffer, dst.v_buffer])


def test_jax_buffers_behind_a_read_only_attribute_fail_before_host_parts_are_written():
    rng = np.random.default_rng(4)
    conn = _stored_connector(rng)

    class Frozen:
        page_size = PAGE

        def __init__(self):
            self.k_buffer = _mha_layers(rng, ml_dtypes.bfloat16)
            self._v = [jnp.asarray(b) for b in _mha_layers(rng, ml_dtypes.bfloat16)]

        @property
        def v_buffer(self):
            return self._v

    dst = Frozen()
    before = testing.buffer_bits(dst.k_buffer)
    with pytest.raises(TypeError, match="v_buffer: Frozen does not let its jax buffers"):
        conn.load(dst, TOKENS, SLOTS)
    testing.assert_unchanged(before, dst.k_buffer)


def test_host_and_jax_parts_of_one_object_both_load():
    rng = np.random.default_rng(5)
    conn = _stored_connector(rng)
    src_k = [b.copy() for b in conn.backend.get(conn.block_hashes(TOKENS)[0]).parts["k"]]
    dst = Pool(
        k_buffer=_mha_layers(rng, ml_dtypes.bfloat16),
        v_buffer=[jnp.asarray(b) for b in _mha_layers(rng, ml_dtypes.bfloat16)],
        page_size=PAGE,
    )
    k_pointers = testing.buffer_pointers(dst.k_buffer)
    out, n = conn.load(dst, TOKENS, SLOTS)
    assert out is dst and n == 16
    testing.assert_updated_in_place(k_pointers, dst.k_buffer)  # host buffers written in place
    for li in range(2):
        np.testing.assert_array_equal(dst.k_buffer[li][SLOTS[:PAGE]].view(np.uint16), src_k[li])
    assert all(isinstance(b, jnp.ndarray) for b in dst.v_buffer)


def test_layers_of_one_family_must_agree():
    rng = np.random.default_rng(6)
    k = _mha_layers(rng, np.float32)
    mixed = Pool(k_buffer=[k[0], jnp.asarray(k[1])], page_size=PAGE)
    with pytest.raises(jaxkv.UnsupportedKVCacheError, match=r"k_buffer\[1\] is a jax buffer"):
        KVConnector(mixed, HostStore(1 << 20))
    shapes = Pool(k_buffer=[k[0], k[1][:, :1]], page_size=PAGE)
    with pytest.raises(jaxkv.UnsupportedKVCacheError, match=r"k_buffer\[1\] is a host buffer"):
        KVConnector(shapes, HostStore(1 << 20))
    dtypes = Pool(k_buffer=[k[0], np.zeros(k[1].shape, np.float16)], page_size=PAGE)
    with pytest.raises(jaxkv.UnsupportedKVCacheError, match="float16, expected"):
        KVConnector(dtypes, HostStore(1 << 20))


def test_pools_with_scale_side_buffers_are_refused():
    rng = np.random.default_rng(7)
    obj = Pool(
        k_buffer=_mha_layers(rng, np.uint8),
        v_buffer=_mha_layers(rng, np.uint8),
        k_scale_buffer=[np.ones((SIZE + PAGE, 2), np.float32)] * 2,
        page_size=PAGE,
    )
    with pytest.raises(jaxkv.UnsupportedKVCacheError, match=r"k_scale_buffer\) are not part"):
        KVConnector(obj, HostStore(1 << 20))
    obj.k_scale_buffer = None  # SGLang's unquantised pools keep the attribute at None
    KVConnector(obj, HostStore(1 << 20))


def _nsa_object(rng, index):
    kv = [random_bits(rng, (SIZE + PAGE, 1, 8), ml_dtypes.bfloat16) for _ in range(2)]
    return Pool(kv_buffer=kv, index_k_with_scale_buffer=index, page_size=PAGE)


def test_index_buffers_must_be_whole_pages():
    rng = np.random.default_rng(8)
    pages = (SIZE + PAGE) // PAGE
    good = [random_bits(rng, (pages, PAGE * (16 + 4)), np.uint8) for _ in range(2)]
    conn = KVConnector(_nsa_object(rng, good), HostStore(1 << 20))
    assert conn.layout.parts[1].row_shape == (20,)
    bad_width = [b[:, :-1] for b in good]
    with pytest.raises(jaxkv.UnsupportedKVCacheError, match="index_k_with_scale_buffer"):
        KVConnector(_nsa_object(rng, bad_width), HostStore(1 << 20))
    other_page = [b.reshape(pages // 3, -1) for b in good]  # pages of 12 tokens, not 4
    with pytest.raises(jaxkv.UnsupportedKVCacheError, match="for page_size 4"):
        KVConnector(_nsa_object(rng, other_page), HostStore(1 << 20))


def test_a_strided_index_buffer_is_read_but_not_written():
    """Index records are addressed in one flat run per buffer: a strided view is refused for
    writes (numpy would write into a copy), before any part is written."""
    rng = np.random.default_rng(9)
    pages = (SIZE + PAGE) // PAGE
    index = [random_bits(rng, (pages, PAGE * 20), np.uint8) for _ in range(2)]
    src = _nsa_object(rng, index)
    conn = KVConnector(src, HostStore(1 << 20))
    assert conn.store(src, TOKENS, SLOTS) == 4
    wide = [random_bits(rng, (pages, 2 * PAGE * 20), np.uint8) for _ in range(2)]
    dst = _nsa_object(rng, [w[:, ::2] for w in wide])
    exported = conn.export_blocks(dst, SLOTS)  # reads follow the strides
    assert exported["index_k"].shape == (4, 2, PAGE, 20)
    before = testing.buffer_bits(dst.kv_buffer)
    with pytest.raises(TypeError, match="non-contiguous index buffer"):
        conn.load(dst, TOKENS, SLOTS)
    testing.assert_unchanged(before, dst.kv_buffer)


@pytest.mark.parametrize(
    "attrs",
    [
        {"kv_buffer": (6, 4, 2, 2, 8)},  # sglang-jax's fused MHA: (pages, page_size, 2H/p, p, D)
        {"kv_buffer": (6, 2, 2, 16)},  # sglang-jax's MLA: (pages, rows per page, p, D)
        {"k_buffer": (6, 4, 2, 8), "v_buffer": (6, 4, 2, 8)},  # paged K/V
        {"k_buffer": (6, 4, 2, 2, 8)},
    ],
    ids=["fused-5d", "mla-4d", "paged-kv-4d", "k-only-5d"],
)
def test_a_paged_buffer_is_never_read_as_token_rows(attrs):
    """A lookalike with 4-D or 5-D per-layer buffers is refused, naming what was seen: read as
    token rows, its first (page) axis would move whole pages into the wrong places."""

    class Lookalike:
        page_size = 4

    pool = Lookalike()
    for attr, shape in attrs.items():
        setattr(pool, attr, [np.zeros(shape, np.float32) for _ in range(2)])
    with pytest.raises(UnsupportedKVCacheError, match=r"Unsupported KV cache type Lookalike: .*-D"):
        KVConnector(pool, HostStore(1 << 20))
