"""Pool views: how a load writes blocks into a pool. A jaxkv pool is consumed by the donated
scatter that writes it; another framework's object is written in place or has its jax buffers
swapped, and a load that cannot write every buffer of it (an attribute that cannot be
reassigned, a deleted or read-only buffer, a fault between two writes) leaves all of them as they
were.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import HOST_VIEWS, fill_all, host, make_pool

import jaxkv
from jaxkv import testing
from jaxkv.connector import HostStore, KVConnector, _pool_views

SIZE, PAGE = 32, 4
TOKENS = np.arange(16)
SLOTS = np.arange(PAGE, PAGE + 16)


@pytest.mark.parametrize(
    "hold_view", [False, pytest.param(True, marks=HOST_VIEWS)], ids=["plain", "view-held"]
)
def test_a_connector_load_consumes_the_jaxkv_pool_it_writes(hold_view):
    src = make_pool("mha", jnp.bfloat16, size=SIZE, page_size=PAGE)
    src = fill_all(src, "mha", 0, SLOTS, np.random.default_rng(4), donate=False)
    conn = KVConnector(src, HostStore(1 << 20))
    assert conn.store(src, TOKENS, SLOTS) == 4
    dst = make_pool("mha", jnp.bfloat16, size=SIZE, page_size=PAGE)
    view = np.asarray(dst.v_buffer[1]) if hold_view else None  # CPU: aliases the buffer
    if hold_view:
        with pytest.warns(jaxkv.CopyWarning):
            new, n = conn.load(dst, TOKENS, SLOTS)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", jaxkv.CopyWarning)  # nothing forced a copy
            new, n = conn.load(dst, TOKENS, SLOTS)
    assert n == 16 and dst.consumed
    for call in (lambda: dst.get_key_buffer(1), lambda: conn.load(dst, TOKENS, SLOTS)):
        with pytest.raises(jaxkv.ConsumedPoolError):
            call()
    np.testing.assert_array_equal(host(new.k_buffer[0])[SLOTS], host(src.k_buffer[0])[SLOTS])
    del view


# ---- foreign pools: all or nothing ------------------------------------------------------------


def _layers(rng, n=2):
    return [rng.standard_normal((SIZE + PAGE, 2, 8)).astype(ml_dtypes.bfloat16) for _ in range(n)]


class _Obj:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _connector(rng):
    src = _Obj(k_buffer=_layers(rng), v_buffer=_layers(rng), page_size=PAGE)
    conn = KVConnector(src, HostStore(1 << 20))
    assert conn.store(src, TOKENS, SLOTS) == 4
    return conn


def _kept(obj):
    """Every layer's bits and memory, which a refused load must leave as they were."""
    layers = {a: getattr(obj, a) for a in ("k_buffer", "v_buffer")}
    return testing.buffer_bits(layers), testing.buffer_pointers(layers)


def _assert_kept(obj, kept) -> None:
    layers = {a: getattr(obj, a) for a in ("k_buffer", "v_buffer")}
    testing.assert_unchanged(kept[0], layers)
    testing.assert_updated_in_place(kept[1], layers)  # no buffer swapped for a copy


class _OnlySameSetter:
    """A pool whose `v_buffer` setter accepts only the sequence it already holds (a setter that
    validates): setting the attribute to itself succeeds, a new sequence is refused."""

    page_size = PAGE

    def __init__(self, k, v):
        self.k_buffer, self._v = k, v

    @property
    def v_buffer(self):
        return self._v

    @v_buffer.setter
    def v_buffer(self, value):
        if value is not self._v:
            raise AttributeError("v_buffer is fixed after construction")


NT = collections.namedtuple("NT", "k_buffer v_buffer page_size")


@dataclasses.dataclass(frozen=True)
class _FrozenPool:
    k_buffer: list
    v_buffer: list
    page_size: int = PAGE


@pytest.mark.parametrize("make", ["namedtuple", "frozen", "same-only-setter"])
def test_jax_buffers_that_cannot_be_reassigned_are_never_donated(make):
    rng = np.random.default_rng(5)
    conn = _connector(rng)
    k, v = ([jnp.asarray(b) for b in _layers(rng)] for _ in range(2))
    dst = {
        "namedtuple": lambda: NT(k, v, PAGE),
        "frozen": lambda: _FrozenPool(k, v),
        "same-only-setter": lambda: _OnlySameSetter(k, v),
    }[make]()
    before = _kept(dst)
    with pytest.raises(TypeError, match="does not let its jax buffers be replaced"):
        conn.load(dst, TOKENS, SLOTS)
    _assert_kept(dst, before)


def test_a_deleted_jax_layer_fails_the_load_before_any_part_is_donated():
    rng = np.random.default_rng(6)
    conn = _connector(rng)
    dst = _Obj(
        k_buffer=[jnp.asarray(b) for b in _layers(rng)],
        v_buffer=[jnp.asarray(b) for b in _layers(rng)],
        page_size=PAGE,
    )
    dst.v_buffer[1].delete()
    bits, pointers = testing.buffer_bits(dst.k_buffer), testing.buffer_pointers(dst.k_buffer)
    with pytest.raises(jaxkv.ConsumedPoolError, match=r"v_buffer\[1\]"):
        conn.load(dst, TOKENS, SLOTS)
    testing.assert_unchanged(bits, dst.k_buffer)
    testing.assert_updated_in_place(pointers, dst.k_buffer)


def test_a_read_only_host_v_leaves_jax_k_untouched():
    rng = np.random.default_rng(7)
    conn = _connector(rng)
    v = _layers(rng)
    v[1].flags.writeable = False
    dst = _Obj(k_buffer=[jnp.asarray(b) for b in _layers(rng)], v_buffer=v, page_size=PAGE)
    before = _kept(dst)
    with pytest.raises(TypeError, match=r"v_buffer\[1\]: cannot write into a read-only"):
        conn.load(dst, TOKENS, SLOTS)
    _assert_kept(dst, before)


def test_a_fault_in_the_device_step_puts_the_written_host_rows_back(monkeypatch):
    """Host K is written in place before the jax V scatter; when that scatter fails (injected
    here: a device error, out of memory), K's overwritten rows are restored."""
    rng = np.random.default_rng(8)
    conn = _connector(rng)
    dst = _Obj(
        k_buffer=_layers(rng), v_buffer=[jnp.asarray(b) for b in _layers(rng)], page_size=PAGE
    )
    before = _kept(dst)

    def fail(*args, **kwargs):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(_pool_views, "scatter_donated", fail)
    with pytest.raises(RuntimeError, match="injected device fault"):
        conn.load(dst, TOKENS, SLOTS)
    _assert_kept(dst, before)
