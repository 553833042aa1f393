"""`jaxkv.testing`: each assertion passes on what it promises and fails, naming the buffer, on
what breaks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_mha_pool

from jaxkv import testing


def test_bits_equal_compares_bits_not_values():
    pool = random_mha_pool(0, size=16)
    testing.assert_bits_equal(pool, random_mha_pool(0, size=16))
    loc, zeros = np.array([3]), jnp.zeros((1, 1, 2), jnp.float32)
    plus = pool.set_kv(0, loc, zeros, zeros, donate=False)
    minus = pool.set_kv(0, loc, -zeros, zeros, donate=False)  # equal as floats
    with pytest.raises(AssertionError, match=r"k_buffer\[0\]: 2 elements differ, the first at"):
        testing.assert_bits_equal(minus, plus)
    with pytest.raises(AssertionError):
        testing.assert_bits_equal(pool, random_mha_pool(0, size=32))  # another shape


def test_in_place_and_shardings_kept_through_a_donated_step():
    pool = random_mha_pool(1, size=64)
    before, placed = testing.buffer_pointers(pool), testing.shardings(pool)
    step = jax.jit(lambda p, loc, k: p.set_kv(0, loc, k, k), donate_argnums=0)
    pool = step(pool, jnp.arange(1, 5), jnp.ones((4, 1, 2), jnp.float32))
    testing.assert_updated_in_place(before, pool)
    testing.assert_shardings_kept(placed, pool)


def test_in_place_fails_for_a_copying_update():
    pool = random_mha_pool(2, size=64)
    before = testing.buffer_pointers(pool)
    ones = jnp.ones((2, 1, 2), jnp.float32)
    copied = jax.jit(lambda p: p.set_kv(0, jnp.arange(1, 3), ones, ones))(pool)  # not donated
    with pytest.raises(AssertionError, match=r"k_buffer\[0\]: moved"):
        testing.assert_updated_in_place(before, copied)


def test_shardings_kept_fails_for_a_buffer_placed_elsewhere():
    pool = random_mha_pool(3, size=16)
    placed = testing.shardings(pool)
    moved = jax.tree_util.tree_map(
        lambda x: jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[-1])), pool
    )
    if len(jax.devices()) == 1:
        testing.assert_shardings_kept(placed, moved)  # one device: the same placement
        return
    with pytest.raises(AssertionError, match="placed as"):
        testing.assert_shardings_kept(placed, moved)


def test_traced_once_fails_on_a_second_trace():
    @testing.traced_once
    def write(pool, loc, k):
        return pool.set_kv(0, loc, k, k)

    step = jax.jit(write)
    pool = random_mha_pool(4, size=32)
    k = jnp.ones((4, 1, 2), jnp.float32)
    pool = step(pool, jnp.arange(1, 5), k)
    pool = step(pool, jnp.arange(5, 9), k)  # same shapes: the program is reused
    with pytest.raises(AssertionError):
        step(pool, jnp.arange(1, 9), jnp.ones((8, 1, 2), jnp.float32))  # another shape
