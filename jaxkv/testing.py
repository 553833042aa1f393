"""Assertions about pools for a user's own chex-checked test suite.

What a test of code that holds jaxkv pools usually needs to say: two pools hold the same bits,
a call that failed left every buffer as it was, an update kept every buffer's sharding, a
donated step updated the buffers in place, a step was traced (so compiled) only once. Each
raises `AssertionError` with what differs.

Buffers are the array leaves of a pool or of any pytree of arrays: jax arrays, numpy arrays,
or torch tensors (an SGLang pool's per-layer lists, gathered in a dict); torch is imported only
when a torch tensor is passed.

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
    >>> kept = testing.buffer_bits(pool)
    >>> testing.assert_unchanged(kept, pool)
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
    "assert_unchanged",
    "assert_updated_in_place",
    "buffer_bits",
    "buffer_pointers",
    "raw_bits",
    "shardings",
    "traced_once",
]

F = TypeVar("F", bound=Callable[..., Any])


def _buffers(tree) -> list[tuple[str, Any]]:
    """`(key path, leaf)` of every array leaf: a pool's buffers, or any pytree of arrays (a
    lone array is named "the array")."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(path) or "the array", leaf) for path, leaf in leaves]


def _is_torch(x) -> bool:
    """Whether `x` is a torch tensor, asked without importing torch."""
    return type(x).__module__.startswith("torch")


def _dtype_name(x) -> str:
    """`x`'s element type by name, so a torch tensor and a jax or numpy array compare."""
    if _is_torch(x):
        return str(x.dtype).removeprefix("torch.")
    return np.dtype(x.dtype).name


def _shape(x) -> tuple[int, ...]:
    return tuple(int(n) for n in x.shape)


def raw_bits(x) -> np.ndarray:
    """An owned host copy of `x`'s raw bits: unsigned integers of its element's width.

    bf16 comes back as uint16, fp8 as uint8, float32 as uint32, so `==` on the result tells
    signed zeros and NaN payloads apart, and numpy can hold the dtypes it lacks. The result is
    a copy, never a view: holding it keeps no buffer alive that a later donated update needs.

    Args:
        x: a jax array (any device; every shard addressable), a numpy array (or anything
            `np.asarray` reads), or a torch tensor (any device).

    Returns:
        `(*x.shape,)` of `uint8`, `uint16`, `uint32` or `uint64`. Elements of another width
        (complex128) are copied as they are (a torch tensor's as bytes, `(*x.shape, width)`).

    Example:
        >>> import jax.numpy as jnp
        >>> raw_bits(jnp.array([1.0, -0.0], jnp.bfloat16))
        array([16256, 32768], dtype=uint16)
    """
    if _is_torch(x):
        import torch  # only here: the caller holds a torch tensor, so torch is installed

        flat = x.detach().cpu().contiguous().reshape(-1)
        width = flat.element_size()
        arr = np.array(flat.view(torch.uint8).numpy(), copy=True)
        if width not in (1, 2, 4, 8):
            return arr.reshape(*_shape(x), width)
        return arr.view(f"u{width}").reshape(_shape(x))
    arr = np.array(jax.device_get(x) if isinstance(x, jax.Array) else x, copy=True)
    return arr.view(f"u{arr.dtype.itemsize}") if arr.dtype.itemsize in (1, 2, 4, 8) else arr


def _differs(name: str, got: np.ndarray, want: np.ndarray) -> AssertionError | None:
    if np.array_equal(got, want):
        return None
    diff = np.argwhere(got != want)
    return AssertionError(
        f"{name}: {len(diff)} elements differ, the first at index {tuple(int(i) for i in diff[0])}"
    )


def assert_bits_equal(actual, expected) -> None:
    """Every buffer of `actual` holds the same bits as `expected`'s (same structure, shapes and
    dtypes; NaN payloads and signed zeros included).

    Args:
        actual, expected: pools of one kind and size, or pytrees of arrays (jax, numpy or
            torch; a torch tensor and an array of the same dtype name compare).

    Raises:
        AssertionError: naming the first buffer that differs and its first differing index.
    """
    chex.assert_trees_all_equal_structs(actual, expected)
    for (name, a), (_, b) in zip(_buffers(actual), _buffers(expected)):
        if _shape(a) != _shape(b):
            raise AssertionError(f"{name}: shape {_shape(a)} is not {_shape(b)}")
        if _dtype_name(a) != _dtype_name(b):
            raise AssertionError(f"{name}: dtype {a.dtype} is not {b.dtype}")
        error = _differs(name, raw_bits(a), raw_bits(b))
        if error is not None:
            raise error


def buffer_bits(pool) -> list[np.ndarray]:
    """Per buffer, in leaf order, its `raw_bits`: take them before a call that must leave the
    buffers as they are, then check with `assert_unchanged`.

    Args:
        pool: a pool, or a pytree of jax arrays, numpy arrays or torch tensors.
    """
    return [raw_bits(leaf) for _, leaf in _buffers(pool)]


def assert_unchanged(before: list[np.ndarray], pool) -> None:
    """Every buffer of `pool` is alive and holds the bits `before` (from `buffer_bits`)
    recorded: a call that failed, or that must not write, left the buffers as they were.

    Raises:
        AssertionError: naming the first buffer deleted (donated to an update) or changed, and
            its first changed index.
    """
    now = _buffers(pool)
    if len(now) != len(before):
        raise AssertionError(f"{len(now)} buffers, expected {len(before)}")
    for (name, leaf), want in zip(now, before):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise AssertionError(f"{name}: deleted (donated to an update), expected unchanged")
        got = raw_bits(leaf)
        if got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(
                f"{name}: {got.dtype}{list(got.shape)} of bits, expected "
                f"{want.dtype}{list(want.shape)}"
            )
        error = _differs(name, got, want)
        if error is not None:
            raise error


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


def _pointers(leaf) -> tuple[int, ...]:
    if _is_torch(leaf):
        return (int(leaf.data_ptr()),)
    if isinstance(leaf, jax.Array):
        return tuple(s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards)
    return (int(np.asarray(leaf).__array_interface__["data"][0]),)


def buffer_pointers(pool) -> list[tuple[int, ...]]:
    """Per buffer, the addresses of its memory: take them before an update that must write in
    place (a donated step, a load into a caller's tensors).

    A jax array gives the device address of each of its shards; a torch tensor its
    `data_ptr()`; a numpy array the address of its data.
    """
    return [_pointers(leaf) for _, leaf in _buffers(pool)]


def assert_updated_in_place(before: list[tuple[int, ...]], pool) -> None:
    """Every buffer of `pool` lives where `before` (from `buffer_pointers`) says: a donated
    update wrote into the old memory instead of copying the buffer (O(tokens), not O(pool)),
    and an update of a caller's tensors or numpy arrays wrote into them.

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
