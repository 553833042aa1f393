"""Assertions about pools for a user's own chex-checked test suite.

What a test of code that holds jaxkv pools usually needs to say: two pools hold the same bits,
an update kept every buffer's sharding, a donated step updated the buffers in place, a step was
traced (so compiled) only once. Each raises `AssertionError` with what differs.

It needs chex, as any chex-checked suite does (`pip install "jaxkv[test]"`).

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jaxkv import MHAPool
    >>> from jaxkv import testing
    >>> pool = MHAPool.create(size=32, head_num=2, head_dim=4, layer_num=1)
    >>> pointers, placed = testing.buffer_pointers(pool), testing.shardings(pool)
    >>> @testing.traced_once
    ... def write(pool, loc, k):
    ...     return pool.set_kv(0, loc, k, k)
    >>> step = jax.jit(write, donate_argnums=0)
    >>> k = jnp.ones((4, 2, 4), jnp.bfloat16)
    >>> pool = step(pool, jnp.arange(1, 5), k)
    >>> pool = step(pool, jnp.arange(5, 9), k)     # same shapes: no second trace
    >>> testing.assert_updated_in_place(pointers, pool)
    >>> testing.assert_shardings_kept(placed, pool)
    >>> testing.assert_bits_equal(pool, pool)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import chex
import jax
import numpy as np

__all__ = [
    "assert_bits_equal",
    "assert_shardings_kept",
    "assert_updated_in_place",
    "buffer_pointers",
    "shardings",
    "traced_once",
]

F = TypeVar("F", bound=Callable[..., Any])


def _buffers(tree) -> list[tuple[str, jax.Array]]:
    """`(key path, leaf)` of every array leaf: a pool's buffers, or any pytree of arrays."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


def _bits(x) -> np.ndarray:
    """The raw bits of `x` on the host (bf16, fp8 and float NaN payloads compared exactly)."""
    arr = np.asarray(x)
    return arr.view(f"u{arr.dtype.itemsize}") if arr.dtype.itemsize in (1, 2, 4, 8) else arr


def assert_bits_equal(actual, expected) -> None:
    """Every buffer of `actual` holds the same bits as `expected`'s (same structure, shapes and
    dtypes; NaN payloads and signed zeros included).

    Args:
        actual, expected: pools of one kind and size, or pytrees of arrays.

    Raises:
        AssertionError: naming the first buffer that differs and its first differing row.
    """
    chex.assert_trees_all_equal_structs(actual, expected)
    for (name, a), (_, b) in zip(_buffers(actual), _buffers(expected)):
        chex.assert_equal_shape([a, b])
        if a.dtype != b.dtype:
            raise AssertionError(f"{name}: dtype {a.dtype} is not {b.dtype}")
        got, want = _bits(a), _bits(b)
        if not np.array_equal(got, want):
            diff = np.argwhere(got != want)
            raise AssertionError(
                f"{name}: {len(diff)} elements differ, the first at index "
                f"{tuple(int(i) for i in diff[0])}"
            )


def shardings(pool) -> list[jax.sharding.Sharding]:
    """Every buffer's sharding, in leaf order: take it before an update that donates them."""
    return [leaf.sharding for _, leaf in _buffers(pool)]


def assert_shardings_kept(before: list[jax.sharding.Sharding], pool) -> None:
    """Every buffer of `pool` is placed as `before` (from `shardings`) says.

    Raises:
        AssertionError: naming the first buffer placed otherwise.
    """
    now = _buffers(pool)
    if len(now) != len(before):
        raise AssertionError(f"{len(now)} buffers, expected {len(before)}")
    for (name, leaf), want in zip(now, before):
        ndim = leaf.ndim
        if not leaf.sharding.is_equivalent_to(want, ndim):
            raise AssertionError(f"{name}: placed as {leaf.sharding}, expected {want}")


def buffer_pointers(pool) -> list[tuple[int, ...]]:
    """Per buffer, the device addresses of its shards: take them before a donated update."""
    return [
        tuple(s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards)
        for _, leaf in _buffers(pool)
    ]


def assert_updated_in_place(before: list[tuple[int, ...]], pool) -> None:
    """Every buffer of `pool` lives where `before` (from `buffer_pointers`) says: a donated
    update wrote into the old memory instead of copying the buffer (O(tokens), not O(pool)).

    Raises:
        AssertionError: naming the first buffer that moved.
    """
    now = buffer_pointers(pool)
    names = [name for name, _ in _buffers(pool)]
    if len(now) != len(before):
        raise AssertionError(f"{len(now)} buffers, expected {len(before)}")
    for name, got, want in zip(names, now, before):
        if got != want:
            raise AssertionError(f"{name}: moved (copied) by the update, not written in place")


def traced_once(fn: F) -> F:
    """`fn`, failing (`AssertionError`) when it is traced a second time: put it under `jax.jit`
    to check that a step over pools of one shape compiles once (a pool's metadata is static,
    so equal shapes and placements share one program).

    Like `chex.assert_max_traces(fn, n=1)`, but counted per function object: chex counts per
    source text, so a step defined inside a parametrized test would count the traces of every
    parametrization together.
    """
    traces = 0

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        nonlocal traces
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            traces += 1
            if traces > 1:
                raise AssertionError(
                    f"{fn.__name__} was traced {traces} times, expected once: an argument "
                    "changed shape, dtype, placement or a static value"
                )
        return fn(*args, **kwargs)

    return cast(F, counted)
