"""The transfer primitives every path that moves KV rows uses, the connector's and the
integrations' alike: host views of device arrays (`host_view`), staging memory between pools
and stores (`StagingCache`, `aligned_empty`), where a sharded array's pieces lie
(`has_explicit_axes`, `shard_span`) and a bounded cache of compiled transfers (`CompileCache`).

Fresh host memory costs a page fault per 4 KiB page on first touch, which makes a copy into it
several times slower than memcpy into memory already touched (docs/performance.md), so
staging buffers are cached and reused.

On accelerators, blocks cross the host link through pinned host memory (`memory_kind=
"pinned_host"`): a transfer from or to pinned memory runs at the link's speed, one from
pageable numpy memory several times slower (docs/performance.md has the H200's figures). CPU
devices have the same memory kinds, so the pinned path also runs on CPU when a connector is
asked for it (`transfer="pinned"`).

A load stages each part as one `Staging` of its kind: host arrays reaching the device through a
transfer (`HostStaging`), host views of XLA-owned CPU arrays (`XlaStaging`), host views of
pinned host arrays (`PinnedStaging`), or arrays already on the device (`DeviceStaging`). Each
says how its layers reach the device and whether its memory is reused (then the write waits
for the scatter to have read it).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding


def aligned_empty(shape: tuple[int, ...], dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised host array whose data starts on an `alignment`-byte boundary.

    XLA:CPU imports a DLPack buffer without copying only when it is 64-byte aligned; numpy
    guarantees 16.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def _xla_owned_staging(
    shape: tuple[int, ...], dtype, device: jax.Device
) -> tuple[np.ndarray, jax.Array]:
    """A zeroed jax array on CPU `device` and a writable numpy view of its memory.

    Loads fill staging on the host and scatter it on the device. Importing numpy memory into
    XLA (DLPack) made XLA's worker threads hold the producer's deleter; when the thread pool
    dropped it during interpreter shutdown the process aborted ("terminate called without an
    active exception", about one run in six). Memory XLA allocated itself has no such
    deleter; jaxkv writes it only while no computation reads it (each scatter completes
    before the buffer is refilled) and never hands the array out.
    """
    arr = jax.block_until_ready(jnp.zeros(shape, dtype, device=device))
    raw = (ctypes.c_char * arr.nbytes).from_address(arr.unsafe_buffer_pointer())
    return np.frombuffer(raw, dtype=arr.dtype).reshape(shape), arr


def device_of(x: jax.Array) -> Any:
    """The one device of a single-device array (typed `Any`: jaxlib's device class ships no
    stubs a type checker can resolve)."""
    return next(iter(x.sharding.device_set))


def dlpack_view(x: Any) -> np.ndarray:
    """`np.from_dlpack(x)`: a zero-copy host view of a jax array in host memory (jax's stubs
    declare `__dlpack__` without numpy's `stream` keyword, hence `Any`)."""
    return np.from_dlpack(x)


def pinned_device(x, *, on_cpu: bool = False) -> Any:
    """The device of `x` when its blocks can cross the host link through pinned host memory:
    `x` is a jax array on one accelerator device (or CPU device, with `on_cpu`) that has a
    `pinned_host` memory. None otherwise."""
    if not isinstance(x, jax.Array) or len(x.sharding.device_set) != 1:
        return None
    dev = device_of(x)
    if dev.platform == "cpu" and not on_cpu:
        return None
    try:
        kinds = {m.kind for m in dev.addressable_memories()}
    except (AttributeError, NotImplementedError, RuntimeError):  # backends without memories
        return None
    return dev if "pinned_host" in kinds else None


def host_view(x: jax.Array, *, writable: bool = False, dtype=None) -> np.ndarray:
    """A numpy view of a single-device jax array in host memory (CPU, or pinned host) that
    keeps `x` alive.

    The view holds `x` itself rather than a DLPack capsule, so its lifetime is that of a jax
    array (which holds its client), never that of a bare buffer reference. `writable` views
    are for memory jaxkv owns: it writes them only while no transfer reads them.

    Args:
        x: the array.
        writable: whether the view may be written.
        dtype: view the bits as this dtype, of the same width (the unsigned int of a bfloat16
            or float8 array: numpy's DLPack import has no such dtypes, so the address then
            comes from XLA); default `x.dtype`, its address from DLPack (zero-copy for a
            pinned host array on a GPU).
    """
    jax.block_until_ready(x)
    if dtype is None:
        dtype = x.dtype
        address = dlpack_view(x).__array_interface__["data"][0]
    else:
        dtype = np.dtype(dtype)
        if dtype.itemsize != x.dtype.itemsize:
            raise ValueError(
                f"dtype: expected a dtype {x.dtype.itemsize} bytes wide like {x.dtype}, got {dtype}"
            )
        address = x.unsafe_buffer_pointer()
    raw: Any = (ctypes.c_char * x.nbytes).from_address(address)
    raw.owner = x  # the view's base is `raw`; this ties `x` to it
    view = np.frombuffer(raw, dtype=dtype).reshape(x.shape)
    view.flags.writeable = writable
    return view


def has_explicit_axes(sharding: jax.sharding.Sharding) -> bool:
    """Whether `sharding` lies on a mesh with explicit axes, where a gather or scatter of the
    global array must name its output sharding."""
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def shard_span(
    index: tuple[slice, ...] | None, shape: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
    """The `(start, stop)` of each axis of a shard's `index` (an `addressable_shards` entry's)
    in an array of `shape`; None: the whole array."""
    full = (slice(None),) * len(shape)
    return tuple(sl.indices(dim)[:2] for sl, dim in zip(index or full, shape))


class CompileCache:
    """Compiled transfers keyed by their signature (shapes, dtypes, shardings, sizes), the
    `max_entries` most recently used kept: a server's pools share them, and a process that
    meets many signatures (a test run, a bench) does not keep them all.

    `get(key, build)` returns the executable for `key`, calling `build()` once on a miss;
    threads asking for the same key wait for one build.
    """

    def __init__(self, max_entries: int = 256):
        if max_entries < 1:
            raise ValueError(f"max_entries: expected an int >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._built: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def get(self, key, build) -> Any:
        with self._lock:  # one build at a time: two threads asking for one key build it once
            if key in self._built:
                self._built.move_to_end(key)
                return self._built[key]
            built = self._built[key] = build()
            while len(self._built) > self.max_entries:
                self._built.popitem(last=False)
            return built

    def __len__(self) -> int:
        with self._lock:
            return len(self._built)


def _pinned_staging(shape: tuple[int, ...], dtype, dev: jax.Device) -> tuple[np.ndarray, jax.Array]:
    """A zeroed pinned host array on `dev`'s host and a writable numpy view of it (made once
    per cached slot: zeros on the device, then the device-to-pinned transfer stores use)."""
    zeros = jax.device_put(np.zeros(shape, dtype), dev)
    arr = jax.device_put(zeros, SingleDeviceSharding(dev, memory_kind="pinned_host"))
    return host_view(arr, writable=True), arr


class Staging:
    """One part's staging for a load: per layer `(n_blocks, block_size, *row)`.

    Attributes:
        host: per layer, writable host arrays the blocks are copied into (empty for
            `DeviceStaging`).
        reused: whether the memory goes back to a cache after the write, so the write must
            wait for the scatter to have read it.
    """

    host: tuple[np.ndarray, ...] = ()
    reused = True
    #: The blocks that hold data, the first ones (None: all); staging of a `bucket` of
    #: blocks holds fewer, and the scatter drops the rest.
    blocks: int | None = None

    def on_device(self, like: jax.Array) -> tuple[jax.Array, ...]:
        """The layers as jax arrays on `like`'s devices, for the scatter."""
        raise NotImplementedError

    def layer_rows(self, layer: int) -> np.ndarray:
        """Layer `layer`'s blocks that hold data, as a host array (for writes jaxkv makes
        outside XLA)."""
        return self.host[layer][: self.blocks]

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.host)


class HostStaging(Staging):
    """Plain host arrays: transferred to the device for the write (replicated over a mesh)."""

    def __init__(self, host: tuple[np.ndarray, ...]):
        self.host = host

    def on_device(self, like):
        return tuple(to_device(h, like) for h in self.host)


class XlaStaging(Staging):
    """Writable host views of XLA-owned arrays on one CPU device: the write reads the arrays
    themselves, no transfer."""

    def __init__(self, host: tuple[np.ndarray, ...], device: tuple[jax.Array, ...]):
        self.host, self._device = host, device

    def on_device(self, like):
        return self._device


class PinnedStaging(Staging):
    """Writable host views of pinned host arrays: one transfer per layer at the link's speed
    (the target names its memory kind: a plain device target raises "Memory kind
    mismatch")."""

    def __init__(self, host: tuple[np.ndarray, ...], pinned: tuple[jax.Array, ...]):
        self.host, self._pinned = host, pinned

    def on_device(self, like):
        dev = next(iter(like.sharding.device_set))
        target = SingleDeviceSharding(dev, memory_kind="device")
        return tuple(jax.device_put(list(self._pinned), target))


class DeviceStaging(Staging):
    """Arrays already on the device (a segment sent back whole): nobody reuses them, so the
    write does not wait for the scatter."""

    reused = False

    def __init__(self, device: tuple[jax.Array, ...]):
        self._device = device

    def on_device(self, like):
        return self._device

    def layer_rows(self, layer):
        return to_host(self._device[layer])


class JoinedStaging(Staging):
    """Several stagings of one part, their blocks one after another: one scatter writes them
    all (joined on the device, one concatenation per layer)."""

    def __init__(self, parts: Sequence[Staging]):
        self._parts = tuple(parts)
        self.reused = any(p.reused for p in self._parts)

    def on_device(self, like):
        layers = zip(*(p.on_device(like) for p in self._parts))
        return tuple(jnp.concatenate(per_layer) for per_layer in layers)

    def layer_rows(self, layer):
        return np.concatenate([p.layer_rows(layer) for p in self._parts])


class StagingCache:
    """Reusable staging memory for loads and stores.

    Fresh host memory costs a page fault per 4 KiB page on first touch; staging in memory
    already touched is what keeps transfers at memcpy speed. At most `max_bytes` stay idle.
    """

    def __init__(self, max_bytes: int = 256 << 20):
        self._lock = threading.Lock()
        self._idle: dict[tuple, list] = {}
        self._idle_bytes = 0
        self.max_bytes = max_bytes

    def _take(self, key: tuple, make):
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                item, nbytes = idle.pop()
                self._idle_bytes -= nbytes
                return item
        return make()

    def _give(self, key: tuple, item, nbytes: int) -> None:
        with self._lock:
            if self._idle_bytes + nbytes <= self.max_bytes:
                self._idle.setdefault(key, []).append((item, nbytes))
                self._idle_bytes += nbytes

    def take(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A 64-byte-aligned host buffer; hand it back with `give` once nothing reads it."""
        return self._take(
            ("host", tuple(shape), np.dtype(dtype).str), lambda: aligned_empty(shape, dtype)
        )

    def give(self, buf: np.ndarray) -> None:
        self._give(("host", buf.shape, buf.dtype.str), buf, buf.nbytes)

    @contextlib.contextmanager
    def borrow(self, kind: str, layers: int, shape: tuple[int, ...], dtype, device):
        """Per-layer load staging of `kind` ("host", "xla" or "pinned", see the `Staging`
        classes) for buffers on `device` (None for "host"), handed back when the block ends."""
        dtype = np.dtype(dtype)
        # Keyed by device: each shard of a mesh scatters staging on its own device.
        key = (kind, None if device is None else device.id, layers, tuple(shape), dtype.str)

        def make() -> Staging:
            if kind == "host":
                return HostStaging(tuple(aligned_empty(shape, dtype) for _ in range(layers)))
            made = _pinned_staging if kind == "pinned" else _xla_owned_staging
            pairs = [made(shape, dtype, device) for _ in range(layers)]
            host = tuple(h for h, _ in pairs)
            arrays = tuple(a for _, a in pairs)
            return PinnedStaging(host, arrays) if kind == "pinned" else XlaStaging(host, arrays)

        slot = self._take(key, make)
        try:
            yield slot
        finally:
            self._give(key, slot, slot.nbytes)

    def idle_kinds(self) -> set[str]:
        """The kinds of staging waiting for reuse ("host" buffers of stores included)."""
        with self._lock:
            return {key[0] for key, items in self._idle.items() if items}

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes


def to_host(x: jax.Array) -> np.ndarray:
    """A host numpy view of a device array: zero-copy on CPU, via pinned host memory elsewhere."""
    if len(x.sharding.device_set) > 1:
        first = min(x.sharding.device_set, key=lambda d: d.id)  # type: ignore[attr-defined]
        x = jax.device_put(x, jax.sharding.SingleDeviceSharding(first))
    dev = device_of(x)
    if dev.platform != "cpu":
        x = jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    return dlpack_view(x)


def to_device(host: np.ndarray, like: jax.Array) -> jax.Array:
    """A copy of `host` on `like`'s device, replicated over the mesh when `like` is sharded
    (the scatter then writes each shard). Single-device staging that XLA or the link reads
    directly (`XlaStaging`, `PinnedStaging`) avoids this copy."""
    devices = like.sharding.device_set
    if len(devices) > 1:
        sharding = like.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        else:
            ordered = sorted(devices, key=lambda d: d.id)  # type: ignore[attr-defined]
            mesh = jax.sharding.Mesh(np.array(ordered), ("all",))
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.device_put(host, replicated)
    return jax.device_put(host, next(iter(devices)))
