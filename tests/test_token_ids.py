"""Token ids are converted by value, one way, for every tier: the radix cache, the connector's
keys and the serving engine see the same prefix whatever the ids' container, integer dtype or
byte order (`jaxkv._checks.token_array`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_DECODER, random_mha_pool
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import RadixCache, TokenAllocator
from jaxkv._checks import token_array
from jaxkv.connector import HostStore, KVConnector

BS = 4
_DTYPES = ("u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8")


def _as(values: list[int], dtype: str, order: str, container: str):
    """`values` in `dtype` of byte `order` ("<" or ">"), as `container` holds them."""
    arr = np.array(values, dtype=np.dtype(order + dtype))
    if container == "list":
        return arr.tolist()
    if container == "jax":
        return jnp.asarray(arr.astype(np.int32))  # jax holds native 32-bit ints here
    return arr


def test_a_big_endian_prompt_is_the_same_prefix_as_its_values():
    ids = np.arange(1, 9)
    big = ids.astype(">i4")
    swapped = big.view(np.uint32)  # the ids a raw-bits key would have named
    assert not np.array_equal(swapped, ids)
    alloc = TokenAllocator(64)
    cache = RadixCache(alloc)
    slots = alloc.alloc(8)
    assert cache.insert(big, slots) == 0
    np.testing.assert_array_equal(cache.match_prefix(big).slots, slots)
    np.testing.assert_array_equal(cache.match_prefix(ids).slots, slots)
    assert cache.match_prefix(swapped.astype(np.int64)).slots.size == 0
    assert cache.insert(ids, alloc.alloc(8)) == 8  # already cached, by value


def test_the_radix_cache_writes_back_a_big_endian_prompt_under_its_values():
    pool = random_mha_pool(size=64)
    conn = KVConnector(pool, HostStore(1 << 20), block_size=BS)
    alloc = TokenAllocator(63)
    cache = RadixCache(alloc, connector=conn)
    ids = np.arange(100, 108)
    cache.insert(ids.astype(">u4"), alloc.alloc(8))
    assert cache.evict(8, pool=pool) == 8
    assert conn.lookup(ids) == 8
    assert cache.match_prefix(ids.astype(">i8")).stored_tokens == 8


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.integers(0, 127), min_size=BS, max_size=3 * BS),
    dtype=st.sampled_from(_DTYPES),
    order=st.sampled_from("<>"),
    container=st.sampled_from(("numpy", "list", "jax")),
)
def test_every_tier_sees_the_same_prefix_in_every_dtype_and_byte_order(
    values, dtype, order, container
):
    given_ids = _as(values, dtype, order, container)
    want = np.array(values, np.uint32)
    got = token_array(given_ids)
    assert got.dtype == np.uint32 and np.array_equal(got, want)
    pool = random_mha_pool(size=64)
    conn = KVConnector(pool, HostStore(1 << 16), block_size=BS)
    assert conn.block_hashes(given_ids) == conn.block_hashes(values)
    n = len(values) // BS * BS
    conn.store(pool, values, np.arange(1, len(values) + 1))
    assert conn.lookup(given_ids) == n
    alloc = TokenAllocator(63)
    cache = RadixCache(alloc, connector=conn)
    slots = alloc.alloc(len(values))
    assert cache.insert(values, slots) == 0
    match = cache.match_prefix(given_ids)
    np.testing.assert_array_equal(match.slots, slots)
    assert cache.insert(given_ids, alloc.alloc(len(values))) == len(values)


def test_native_four_byte_ids_are_viewed_and_others_converted():
    ids = np.arange(10, dtype=np.int32)
    assert np.shares_memory(token_array(ids), ids)
    big = ids.astype(">i4")
    assert not np.shares_memory(token_array(big), big)
    np.testing.assert_array_equal(token_array(big), ids)


@pytest.mark.parametrize("dtype", [">i4", "<i8", ">u8", "<u2"])
def test_the_engine_serves_a_prompt_in_any_dtype_as_its_values(dtype):
    from jaxkv.models import Decoder, DecoderConfig, Engine, Request

    model = Decoder(DecoderConfig(attention="gqa", **SMALL_DECODER))
    params = model.init_params()
    prompt = np.arange(3, 40)
    engine = Engine(model, params, pool_size=256, page_size=4, max_batch=2, max_context=64)
    plain = engine.generate([Request(prompt.astype(np.int32), 3)])[0]
    again = engine.generate([Request(prompt.astype(dtype), 3)])[0]
    native = engine.generate([Request(prompt.astype(np.int32), 3)])[0]
    np.testing.assert_array_equal(again.tokens, plain.tokens)
    np.testing.assert_array_equal(native.tokens, plain.tokens)
    assert again.device_tokens == native.device_tokens > 0


@pytest.mark.parametrize("dtype", ["<i8", ">i8", "<u8", ">u8", "<i4", ">i4", "<i2"])
def test_ids_outside_32_bits_are_refused_in_every_width_and_byte_order(dtype):
    dt = np.dtype(dtype)
    top = min(2**32 - 1, np.iinfo(dt).max)
    assert token_array(np.array([0, top], dt)).tolist() == [0, top]
    info = np.iinfo(dt)
    candidates = (-1, info.min, 2**32, info.max)
    bad = [v for v in candidates if info.min <= v <= info.max and not 0 <= v < 2**32]
    for value in bad:
        with pytest.raises(ValueError, match=r"expected ids in \[0, 2\*\*32\)"):
            token_array(np.array([7, value], dt))
