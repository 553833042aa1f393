"""All or nothing: failing pool calls change nothing, consumed pools refuse every use,
non-finite inputs follow one rule per dtype, and bad arguments are named.

The fuzzer over every public pool call is tests/pools/test_pool_fuzz.py; these are the cases it
cannot reach, such as views held across an update. Connector loads that must change nothing
(foreign pools that refuse a write, faults between the steps of a load) are in
tests/connector/test_pool_views.py.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    HOST_VIEWS,
    SETTERS,
    buffer_names,
    call_setter,
    decode_ref,
    fill_all,
    host,
    make_pool,
    quantize_index_ref,
    row_buffer_names,
)

import jaxkv

# ---- consumed pools ---------------------------------------------------------------------------


def _readers(pool, layer):
    """Every public reader of `pool` that reads `layer` (as zero-argument callables)."""
    loc = np.array([1])
    calls = [lambda: pool.get_key_buffer(layer)]
    if not isinstance(pool, jaxkv.KOnlyPool):
        calls += [lambda: pool.get_value_buffer(layer), lambda: pool.get_kv_buffer(layer)]
    if hasattr(pool, "kv_buffer"):
        calls.append(lambda: pool.get_mla_kv(layer, loc))
    if hasattr(pool, "index_k_with_scale_buffer"):
        calls.append(lambda: pool.get_index_k(layer, loc))
    return calls


@pytest.mark.parametrize(
    "hold_view", [False, pytest.param(True, marks=HOST_VIEWS)], ids=["plain", "view-held"]
)
def test_a_consumed_pool_refuses_every_read_and_update(pool_kind, pool_dtype, hold_view):
    """Every dtype (float32 included), every layer (not only the replaced one), whether or not
    a numpy view kept XLA from reusing the buffer: the old handle raises ConsumedPoolError."""
    rng = np.random.default_rng(0)
    old = make_pool(pool_kind, pool_dtype)
    setter = next(iter(SETTERS[pool_kind]))
    view = np.asarray(getattr(old, buffer_names(pool_kind)[0])[0]) if hold_view else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = call_setter(old, setter, 0, np.array([1, 2]), rng)
    copies = [w for w in caught if issubclass(w.category, jaxkv.CopyWarning)]
    assert len(copies) == (1 if hold_view else 0)
    if hold_view:
        # Pointed at the caller's line, not at jaxkv's own code.
        assert not copies[0].filename.startswith(os.path.dirname(jaxkv.__file__))
    assert old.consumed and not new.consumed
    for layer in (0, 1):
        for read in _readers(old, layer):
            with pytest.raises(jaxkv.ConsumedPoolError, match="consumed by an earlier update"):
                read()
        for name in SETTERS[pool_kind]:
            with pytest.raises(jaxkv.ConsumedPoolError, match="use the returned pool"):
                call_setter(old, name, layer, np.array([3]), rng)
    for layer in (0, 1):  # the new pool is intact
        for read in _readers(new, layer):
            jax.block_until_ready(read())
    del view


def test_consumed_is_a_runtime_error_and_donate_false_consumes_nothing():
    rng = np.random.default_rng(1)
    old = make_pool("mha", jnp.float32)
    kept = call_setter(old, "set_kv", 0, np.array([1]), rng, donate=False)
    assert not old.consumed
    jax.block_until_ready(old.get_key_buffer(0))
    kept.set_k(1, np.array([2]), np.ones((1, 2, 4), np.float32))
    with pytest.raises(RuntimeError):  # what a deleted buffer raised before: still caught
        kept.get_key_buffer(0)


def test_float32_readers_return_a_copy_that_survives_the_next_update(pool_kind):
    """A float32 pool's buffer is already in the logical dtype; its readers still hand out a
    new array, as the bitcast of every other dtype does, so a donation cannot delete it."""
    rng = np.random.default_rng(2)
    pool = make_pool(pool_kind, jnp.float32)
    pool = fill_all(pool, pool_kind, 0, np.array([1, 2]), rng)
    held = pool.get_key_buffer(0)
    want = host(held)
    assert held is not pool.buffers(row_buffer_names(pool_kind)[0])[0]
    fill_all(pool, pool_kind, 0, np.array([1, 2]), rng)
    np.testing.assert_array_equal(host(held), want)


def test_a_stray_update_through_an_old_handle_cannot_break_the_new_pool():
    """The old pool shares layer 1 with the new one; an update of layer 1 through the old
    handle would donate the new pool's buffer. It raises instead, and the new pool reads."""
    rng = np.random.default_rng(3)
    old = make_pool("mha", jnp.float32)
    new = call_setter(old, "set_kv", 0, np.array([1]), rng)
    with pytest.raises(jaxkv.ConsumedPoolError):
        call_setter(old, "set_kv", 1, np.array([1]), rng)
    assert not new.buffers("k_buffer")[1].is_deleted()
    jax.block_until_ready(new.get_kv_buffer(1))


@HOST_VIEWS
def test_a_dlpack_export_held_across_an_update_is_reported():
    pool = make_pool("mha", jnp.bfloat16)
    export = np.from_dlpack(pool.k_buffer[0])
    with pytest.warns(jaxkv.CopyWarning, match="copied them whole"):
        new = pool.set_k(0, np.array([1]), np.ones((1, 2, 4), np.float32))
    assert not export.any()  # the export still holds the old (zero) rows
    assert new.get_key_buffer(0)[1].astype(jnp.float32).tolist() == [[1.0] * 4] * 2
    with pytest.raises(jaxkv.ConsumedPoolError):
        pool.get_key_buffer(0)


# ---- non-finite inputs ------------------------------------------------------------------------


def test_an_inf_index_key_saturates_and_spares_the_finite_keys():
    """One inf (or NaN) key must not turn its token's finite keys into NaN: the scale is taken
    over the finite keys, an inf is stored as code +-448 (reads back as the largest finite
    magnitude) and a NaN stays in its own key."""
    pool = make_pool("nsa", jnp.bfloat16)
    x = np.tile(np.linspace(-3, 3, 8, dtype=np.float32), (3, 1))
    x[0, 0], x[1, 7], x[2, 3] = np.inf, -np.inf, np.nan
    got = np.asarray(pool.set_index_k(0, np.array([1, 2, 3]), x).get_index_k(0, [1, 2, 3]))
    finite = np.isfinite(x)
    ref = np.asarray(quantize_index_ref(np.where(finite, x, 0)))
    want = decode_ref(ref[:, :8], jnp.float8_e4m3fn) * ref[:, 8:].copy().view("<f4")
    np.testing.assert_array_equal(got[finite], want[finite])
    np.testing.assert_allclose([got[0, 0], got[1, 7]], [3.0, -3.0], rtol=1e-6)
    assert np.isnan(got[2, 3])


def test_an_inf_latent_value_saturates_and_spares_its_packed_tile():
    pool = make_pool("nsa", jnp.float8_e4m3fn)
    rank = pool.kv_lora_rank
    nope = np.linspace(-2, 2, 2 * rank, dtype=np.float32).reshape(2, 1, rank)
    nope[0, 0, 5], nope[1, 0, 9] = np.inf, np.nan
    rope = np.ones((2, 1, pool.qk_rope_head_dim), np.float32)
    got_nope, _ = pool.set_mla_kv(0, np.array([1, 2]), nope, rope).get_mla_kv(0, [1, 2])
    got = np.asarray(got_nope)
    assert np.isnan(got).sum() == 1 and np.isnan(got[1, 0, 9])
    amax = np.max(np.abs(np.where(np.isfinite(nope[0]), nope[0], 0)))
    np.testing.assert_allclose(got[0, 0, 5], amax, rtol=1e-6)
    assert np.isfinite(np.delete(got.reshape(-1), rank + 9)).all()


def test_non_finite_values_follow_the_dtype_rule(pool_dtype):
    """fp8 pools saturate +-inf to +-finfo.max; 16- and 32-bit pools keep inf; NaN stays NaN;
    finite inputs never become NaN."""
    dtype = pool_dtype
    pool = make_pool("mha", dtype)
    k = np.array([np.inf, -np.inf, np.nan, 1.5, -2.0, 1e30, 0.0, -1e-3], np.float32)
    k = k.reshape(1, 2, 4)
    got = np.asarray(pool.set_k(0, np.array([1]), k).get_key_buffer(0)[1].astype(jnp.float32))
    big = float(ml_dtypes.finfo(dtype).max) if jnp.dtype(dtype).itemsize == 1 else np.inf
    assert got.reshape(-1)[0] == big and got.reshape(-1)[1] == -big
    assert np.isnan(got.reshape(-1)[2])
    assert not np.isnan(got.reshape(-1)[3:]).any()


# ---- arguments at the boundary ----------------------------------------------------------------


@pytest.mark.parametrize(
    "scale, error, match",
    [
        (0.0, ValueError, "finite positive"),
        (-1.0, ValueError, "finite positive"),
        (np.inf, ValueError, "finite positive"),
        (np.nan, ValueError, "finite positive"),
        ("2", TypeError, "real scalar"),
        (True, TypeError, "real scalar"),
        (1j, TypeError, "real scalar"),
        ([1.0, 2.0], ValueError, "scalar scale"),
    ],
)
def test_bad_scales_are_named_and_change_nothing(scale, error, match):
    pool = make_pool("mha", jnp.float8_e4m3fn)
    k = np.ones((1, 2, 4), np.float32)
    v = np.ones((1, 2, 3), np.float32)
    with pytest.raises(error, match=f"v_scale: expected .*{match}"):
        pool.set_kv(0, np.array([1]), k, v, v_scale=scale)
    assert not pool.consumed
    assert not np.asarray(pool.get_key_buffer(0).astype(jnp.float32)).any()


def test_good_scales_of_every_kind_are_accepted():
    pool = make_pool("mha", jnp.float8_e4m3fn)
    k = np.full((1, 2, 4), 4.0, np.float32)
    for scale in (
        2,
        np.float32(2.0),
        np.array(2.0),
        jnp.float32(2.0),
        np.int64(2),
        ml_dtypes.bfloat16(2),
    ):
        pool = pool.set_k(0, np.array([1]), k, k_scale=scale)
        assert float(pool.get_key_buffer(0)[1, 0, 0].astype(jnp.float32)) == 2.0


@pytest.mark.parametrize(
    "loc, error, match",
    [
        (None, TypeError, "loc: expected an integer array"),
        ("1", TypeError, "loc: expected an integer array"),
        ([[1], [2, 3]], ValueError, "loc: expected an integer array"),
        ([1, "a"], TypeError, "loc: expected an integer array, got dtype"),
        (np.array([1, None], object), TypeError, "loc: expected integer slots"),
        (np.array([1.0]), TypeError, "loc: expected an integer array"),
        (np.array([[1]]), ValueError, r"loc: expected shape \(T,\)"),
    ],
)
def test_bad_slots_are_named(loc, error, match):
    pool = make_pool("mla", jnp.bfloat16)
    with pytest.raises(error, match=match):
        pool.set_k(0, loc, np.ones((1, 1, 8), np.float32))
    assert not pool.consumed


def test_python_ints_beyond_int64_are_dropped_like_other_out_of_range_slots():
    pool = make_pool("mha", jnp.float32)
    k = np.arange(16, dtype=np.float32).reshape(2, 2, 4)
    new = pool.set_k(np.int64(1), [2**70, np.uint64(3)], k)
    got = host(new.get_key_buffer(1))
    np.testing.assert_array_equal(got[3], k[1])
    assert not np.delete(got, 3, axis=0).any()


def test_a_sharding_that_is_no_placement_is_named():
    with pytest.raises(TypeError, match="sharding: expected None, a jax.Device"):
        jaxkv.MHAPool.create(size=8, head_num=1, head_dim=2, layer_num=1, sharding="x")
