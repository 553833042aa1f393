"""Structural performance checks: updates are in place and compile once per shape.

The documented cost: an update costs O(T), not O(pool). We check the structure that makes that
true rather than timing anything: a donated update writes into the very buffer it was given
(same device pointer), and a second call with a pool of equal shapes reuses the compiled code.
"""

from __future__ import annotations

import functools
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SETTERS, call_setter, host, make_pool, setter_args

from jaxkv import testing

DTYPES = [jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn)]


def _layer(pool, names, layer):
    """The buffers `names` of one layer of `pool`, by name."""
    return {name: getattr(pool, name)[layer] for name in names}


def _scales(kind, name):
    """Scale keywords to pass (traced under jit), so the scaled path is checked too."""
    if name == "set_k":
        return {"k_scale": 0.5}
    if name == "set_kv":
        return {"k_scale": 0.5, "v_scale": 2.0} if kind == "mha" else {"k_scale": 0.5}
    return {}


@pytest.fixture
def no_unusable_donations():
    """Turns JAX's "donated buffers were not usable" warning (a silent copy) into an error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*[Dd]onated buffers were not usable.*")
        yield


@pytest.mark.parametrize("pool_dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.usefixtures("no_unusable_donations")
def test_donated_jit_update_keeps_buffer_pointers_and_traces_once(pool_setter, pool_dtype):
    kind, name = pool_setter
    written = SETTERS[kind][name]

    @testing.traced_once
    def step(pool, loc, args, scales):
        return getattr(pool, name)(1, loc, *args, **scales)

    step = jax.jit(step, donate_argnums=0)
    loc = jnp.array([3, -1, 5, 2], jnp.int32)
    rng = np.random.default_rng(0)
    for _ in range(2):  # the second pool is a new one of equal shapes
        pool = make_pool(kind, pool_dtype)
        before = testing.buffer_pointers(_layer(pool, written, 1))
        args = setter_args(pool, name, len(loc), rng)
        new = step(pool, loc, args, _scales(kind, name))
        testing.assert_updated_in_place(before, _layer(new, written, 1))
        for buffer in written:
            assert np.any(host(getattr(new, buffer)[1])), "the update landed"
            assert getattr(pool, buffer)[1].is_deleted(), "the input pool was donated"


@pytest.mark.usefixtures("no_unusable_donations")
def test_eager_donating_update_keeps_buffer_pointers(pool_setter):
    kind, name = pool_setter
    written = SETTERS[kind][name]
    pool = make_pool(kind, jnp.bfloat16)
    rng = np.random.default_rng(1)
    for layer in (0, 1):
        before = testing.buffer_pointers(_layer(pool, written, layer))
        pool = call_setter(pool, name, layer, np.array([4, 1, -1]), rng, **_scales(kind, name))
        testing.assert_updated_in_place(before, _layer(pool, written, layer))
        for buffer in written:
            assert np.any(host(getattr(pool, buffer)[layer])), "the update landed"


def test_donated_jit_step_over_all_buffers_stays_in_place(pool_kind):
    """A decode-style step writing every buffer of every layer keeps every pointer."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pool, loc, values):
        for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
            done = set()
            for name, writes in SETTERS[pool_kind].items():
                if not done.issuperset(writes):
                    pool = getattr(pool, name)(layer, loc, *values[name])
                    done.update(writes)
        return pool

    pool = make_pool(pool_kind, jnp.float8_e5m2, start_layer=4)
    rng = np.random.default_rng(2)
    loc = jnp.array([1, 2, 9], jnp.int32)
    values = {name: setter_args(pool, name, 3, rng) for name in SETTERS[pool_kind]}
    before = testing.buffer_pointers(pool)
    pool = step(pool, loc, values)
    testing.assert_updated_in_place(before, pool)


def test_eager_update_of_a_new_equal_pool_does_not_recompile(pool_setter, caplog):
    kind, name = pool_setter
    rng = np.random.default_rng(3)
    call_setter(make_pool(kind), name, 0, np.array([1, 2]), rng)  # warm up
    fresh = make_pool(kind)
    args = setter_args(fresh, name, 2, rng)
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles(True):
        new = getattr(fresh, name)(1, np.array([5, 6]), *args)
        jax.block_until_ready(new)
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert compiles == []
