"""`jaxkv.testing`: each assertion passes on what it promises and fails, naming the buffer, on
what breaks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_mha_pool, run_python

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


def test_raw_bits_is_an_owned_copy_of_the_bits():
    x = jnp.array([1.0, -0.0, 0.0, jnp.nan], jnp.bfloat16)
    bits = testing.raw_bits(x)
    assert bits.dtype == np.uint16 and bits.shape == (4,)
    assert bits.tolist() == [0x3F80, 0x8000, 0x0000, 0x7FC0]  # -0.0 and 0.0 told apart
    assert testing.raw_bits(jnp.zeros((2, 3), jnp.float8_e4m3fn)).dtype == np.uint8
    host = np.arange(4, dtype=np.float32)
    copy = testing.raw_bits(host)
    host[0] = 7.0
    assert copy[0] == 0, "a copy, not a view of the array"
    pool = random_mha_pool(5, size=16)
    kept = testing.raw_bits(pool.k_buffer[0])
    pool.set_kv(0, np.array([1]), np.ones((1, 1, 2), np.float32), np.ones((1, 1, 2), np.float32))
    assert kept.any(), "readable after its buffer was donated"


def test_raw_bits_reads_torch_tensors():
    torch = pytest.importorskip("torch")
    t = torch.tensor([[1.0, -0.0], [float("nan"), 2.0]], dtype=torch.bfloat16)
    j = jnp.array([[1.0, -0.0], [jnp.nan, 2.0]], jnp.bfloat16)
    np.testing.assert_array_equal(testing.raw_bits(t), testing.raw_bits(j))
    testing.assert_bits_equal({"k": [t]}, {"k": [j]})
    with pytest.raises(
        AssertionError, match=r"\['k'\]\[0\]: 1 elements differ, the first at index \(0, 1\)"
    ):
        testing.assert_bits_equal({"k": [t]}, {"k": [j.at[0, 1].set(0.0)]})  # -0.0 is not 0.0


def test_importing_jaxkv_testing_does_not_import_torch():
    out = run_python("-c", "import sys, jaxkv.testing; print('torch' in sys.modules)", timeout=120)
    assert out.stdout.split()[-1] == "False"


def test_unchanged_passes_for_a_call_that_wrote_nothing():
    pool = random_mha_pool(6, size=16)
    before = testing.buffer_bits(pool)
    nothing = np.zeros((1, 1, 2), np.float32)
    pool = pool.set_kv(0, np.array([-1]), nothing, nothing)  # slot -1: dropped
    testing.assert_unchanged(before, pool)


def test_unchanged_fails_naming_a_changed_or_donated_buffer():
    pool = random_mha_pool(7, size=16)
    before = testing.buffer_bits(pool)
    zeros = np.zeros((1, 1, 2), np.float32)
    new = pool.set_kv(0, np.array([3]), zeros, zeros)
    with pytest.raises(AssertionError, match=r"k_buffer\[0\]: deleted"):
        testing.assert_unchanged(before, pool)  # its layer-0 buffers were donated
    with pytest.raises(AssertionError, match=r"k_buffer\[0\]: \d+ elements differ, the first at"):
        testing.assert_unchanged(before, new)
    with pytest.raises(AssertionError, match="buffers, expected"):
        testing.assert_unchanged(before[:1], new)


def test_unchanged_and_in_place_read_host_arrays():
    layers = {"k_buffer": [np.zeros((4, 2), np.float32) for _ in range(2)]}
    bits, pointers = testing.buffer_bits(layers), testing.buffer_pointers(layers)
    layers["k_buffer"][1][2] = 1.0  # written in place
    testing.assert_updated_in_place(pointers, layers)
    with pytest.raises(AssertionError, match=r"\['k_buffer'\]\[1\]: 2 elements differ"):
        testing.assert_unchanged(bits, layers)
    layers["k_buffer"][0] = layers["k_buffer"][0].copy()  # replaced, not written
    with pytest.raises(AssertionError, match=r"\['k_buffer'\]\[0\]: moved"):
        testing.assert_updated_in_place(pointers, layers)


def test_in_place_reads_torch_tensors():
    torch = pytest.importorskip("torch")
    layers = [torch.zeros(4, 2, dtype=torch.bfloat16) for _ in range(2)]
    pointers = testing.buffer_pointers(layers)
    layers[0][1] = 3.0
    testing.assert_updated_in_place(pointers, layers)
    layers[1] = layers[1].clone()
    with pytest.raises(AssertionError, match=r"\[1\]: moved"):
        testing.assert_updated_in_place(pointers, layers)
