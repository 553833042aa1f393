"""jaxkv's float32 division: the IEEE quotient on every backend.

XLA:GPU's division is not correctly rounded and XLA:CPU's simplifier turns divisions by a
broadcast into reciprocal multiplications, so `_dtypes.divide` corrects the backend's estimate
from its exact residual. The backend here may already divide exactly, so the correction itself
is tested by feeding it estimates perturbed by a few ulps: without it, they stay wrong.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import flush_subnormals

from jaxkv import _dtypes, testing

TINY = np.finfo(np.float32).tiny


def _ieee(x, y) -> np.ndarray:
    """numpy's IEEE quotient, with subnormal inputs and results flushed (sign kept) and every
    NaN the quiet NaN 0x7FC00000 (the sign and payload of a NaN are the hardware's own)."""
    with np.errstate(all="ignore"):
        return flush_subnormals(flush_subnormals(x) / flush_subnormals(y))


@pytest.mark.parametrize("ulps", [1, 2, 4, 8])
def test_correction_turns_perturbed_estimates_into_the_ieee_quotient(ulps):
    rng = np.random.default_rng(ulps)
    n = 1 << 16
    a = rng.uniform(0.5, 1.0, n).astype(np.float32)
    b = rng.uniform(0.5, 1.0, n).astype(np.float32)
    want = a / b
    step = rng.integers(-ulps, ulps + 1, n).astype(np.int32)
    estimate = (want.view(np.int32) + step).view(np.float32)
    assert np.mean(estimate != want) > 0.5  # the input really is wrong
    got = jax.jit(_dtypes.correct_quotient)(estimate, a, b)
    testing.assert_bits_equal(got, want)


@pytest.mark.parametrize("spread", [3, 40, 90], ids=["narrow", "wide", "overflowing"])
def test_divide_is_the_ieee_quotient_over_the_whole_range(spread):
    rng = np.random.default_rng(spread)
    n = 1 << 16
    with np.errstate(over="ignore"):  # beyond float32's range: inf, also a case to divide
        x = (rng.standard_normal(n) * np.exp(rng.uniform(-spread, spread, n))).astype(np.float32)
        y = (rng.standard_normal(n) * np.exp(rng.uniform(-spread, spread, n))).astype(np.float32)
    testing.assert_bits_equal(jax.jit(_dtypes.divide)(x, y), _ieee(x, y))


def test_divide_by_a_broadcast_scalar_is_not_a_reciprocal_multiply():
    x = np.random.default_rng(3).standard_normal(1 << 14).astype(np.float32)
    for scale in (0.37, 3.0, 448.0, 1e-3):
        want = _ieee(x, np.float32(scale))
        testing.assert_bits_equal(jax.jit(_dtypes.divide)(x, np.float32(scale)), want)
        testing.assert_bits_equal(_dtypes.divide(x, scale), want)  # eager too


def test_divide_special_values_follow_ieee_with_subnormals_as_zero():
    x = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 1e-38, 2e-38, 3.4e38, -1.0, 7.0],
        np.float32,
    )
    for y in (0.37, 0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 1e-30, 3e38, -2.0):
        got = np.asarray(jax.jit(_dtypes.divide)(x, np.float32(y)))
        want = _ieee(x, np.full_like(x, y))
        # One NaN, whatever the inputs' NaNs.
        testing.assert_bits_equal({f"x / {y}": got}, {f"x / {y}": want})


def _with_bits(*words) -> np.ndarray:
    return np.array(words, np.uint32).view(np.float32)


def test_nan_results_are_one_quiet_nan_whatever_the_operands_nans():
    # x86 propagates an operand's NaN (sign and payload), NVIDIA GPUs return 0x7FFFFFFF: the
    # library returns 0x7FC00000 for every NaN result, so the stored bits agree.
    nans = _with_bits(0xFFC00000, 0x7FC00001, 0xFF800001, 0x7FFFFFFF)
    quiet = np.full(4, 0x7FC00000, np.uint32)
    for fn in (_dtypes.divide, _dtypes.multiply):
        got = np.asarray(jax.jit(fn)(nans, np.float32(3.0))).view(np.uint32)
        np.testing.assert_array_equal(got, quiet)
    zero_by_zero = np.asarray(jax.jit(_dtypes.divide)(np.float32(0.0), np.float32(-0.0)))
    assert zero_by_zero.view(np.uint32) == 0x7FC00000


def test_products_treat_subnormal_inputs_and_results_as_zero():
    # XLA:CPU flushes subnormals in hardware and XLA:GPU does not; `multiply` flushes them itself
    # so both backends store the same bits.
    sub = _with_bits(0x00000001, 0x80400000, 0x007FFFFF)  # subnormal inputs, signs kept
    got = np.asarray(jax.jit(_dtypes.multiply)(sub, np.float32(2.0**100)))
    np.testing.assert_array_equal(got.view(np.uint32), [0, 0x80000000, 0])
    tiny = np.float32(TINY)
    got = np.asarray(jax.jit(_dtypes.multiply)(np.array([tiny, -tiny]), np.float32(0.25)))
    np.testing.assert_array_equal(got.view(np.uint32), [0, 0x80000000])  # subnormal results
    x = np.random.default_rng(5).standard_normal(4096).astype(np.float32)
    testing.assert_bits_equal(jax.jit(_dtypes.multiply)(x, np.float32(0.37)), x * np.float32(0.37))
