"""Staging memory between pools and stores: host views of device arrays and back.

Fresh host memory costs a page fault per 4 KiB page on first touch (32 MiB of records copied
into fresh buffers ran at 1.8 GB/s here, against 7.4 GB/s for memcpy into touched memory), so
staging buffers are cached and reused.

On accelerators, blocks cross the host link through pinned host memory (`memory_kind=
"pinned_host"`): a transfer from or to pinned memory runs at link speed (52 and 48 GB/s for
512 MiB on an H200), one from pageable numpy memory at 3.4-7.8 GB/s. CPU devices have the
same memory kinds, so the accelerator path also runs on CPU when `PINNED_ON_CPU` is set.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

# Runs the accelerator path (pinned host staging, segments) on CPU devices too; for tests.
PINNED_ON_CPU = False


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


def pinned_device(x) -> jax.Device | None:
    """The device of `x` when its blocks should cross the host link through pinned host
    memory: `x` is a jax array on one accelerator device (any device when `PINNED_ON_CPU`)
    that has a `pinned_host` memory. None otherwise."""
    if not isinstance(x, jax.Array) or len(x.sharding.device_set) != 1:
        return None
    dev = next(iter(x.sharding.device_set))
    if dev.platform == "cpu" and not PINNED_ON_CPU:
        return None
    try:
        kinds = {m.kind for m in dev.addressable_memories()}
    except (AttributeError, NotImplementedError, RuntimeError):  # backends without memories
        return None
    return dev if "pinned_host" in kinds else None


def host_view(x: jax.Array, *, writable: bool = False) -> np.ndarray:
    """A numpy view of a jax array in host memory (CPU, or pinned host) that keeps `x` alive.

    The address comes from DLPack (np.from_dlpack of a pinned host array is zero-copy on GPU),
    but the view holds `x` itself rather than the DLPack capsule, so its lifetime is that of a
    jax array (which holds its client), never that of a bare buffer reference. `writable`
    views are for staging that jaxkv owns: it writes them only while no transfer reads them.
    """
    jax.block_until_ready(x)
    address = np.from_dlpack(x).__array_interface__["data"][0]
    raw = (ctypes.c_char * x.nbytes).from_address(address)
    raw.owner = x  # the view's base is `raw`; this ties `x` to it
    view = np.frombuffer(raw, dtype=x.dtype).reshape(x.shape)
    view.flags.writeable = writable
    return view


def _pinned_staging(shape: tuple[int, ...], dtype, dev: jax.Device) -> tuple[np.ndarray, jax.Array]:
    """A zeroed pinned host array on `dev`'s host and a writable numpy view of it (made once
    per cached slot: zeros on the device, then the device-to-pinned transfer stores use)."""
    zeros = jax.device_put(np.zeros(shape, dtype), dev)
    arr = jax.device_put(zeros, SingleDeviceSharding(dev, memory_kind="pinned_host"))
    return host_view(arr, writable=True), arr


class StagingSlot(NamedTuple):
    """Staging of one part for a load, per layer `(n_blocks, block_size, *row)`: host arrays,
    and the jax arrays that reach the device without a host copy: on a single CPU device the
    XLA-owned arrays sharing the host arrays' memory (`device`), on an accelerator pinned host
    arrays sharing it (`pinned`). Device-side staging has `device` and no host arrays."""

    host: tuple[np.ndarray, ...]
    device: tuple[jax.Array, ...] | None
    pinned: tuple[jax.Array, ...] | None = None


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
    def borrow_layers(self, layers: int, shape: tuple[int, ...], dtype, like: jax.Array | None):
        """Per-layer staging for a load into buffers like `like` (None: host buffers only)."""
        dtype = np.dtype(dtype)
        pinned = pinned_device(like)
        one = like is not None and len(like.sharding.device_set) == 1
        dev = next(iter(like.sharding.device_set)) if one else None
        xla = pinned is None and dev is not None and dev.platform == "cpu"
        # Keyed by device: each shard of a mesh scatters staging on its own device.
        if pinned is not None:
            kind = ("pinned", pinned.id)
        else:
            kind = ("xla", dev.id) if xla else ("host",)
        key = (*kind, layers, tuple(shape), dtype.str)

        def make():
            if pinned is not None:
                pairs = [_pinned_staging(shape, dtype, pinned) for _ in range(layers)]
                return StagingSlot(tuple(h for h, _ in pairs), None, tuple(p for _, p in pairs))
            if not xla:
                return StagingSlot(tuple(aligned_empty(shape, dtype) for _ in range(layers)), None)
            pairs = [_xla_owned_staging(shape, dtype, dev) for _ in range(layers)]
            return StagingSlot(tuple(h for h, _ in pairs), tuple(d for _, d in pairs))

        slot = self._take(key, make)
        try:
            yield slot
        finally:
            self._give(key, slot, sum(h.nbytes for h in slot.host))


def to_host(x: jax.Array) -> np.ndarray:
    """A host numpy view of a device array: zero-copy on CPU, via pinned host memory elsewhere."""
    if len(x.sharding.device_set) > 1:
        first = min(x.sharding.device_set, key=lambda d: d.id)
        x = jax.device_put(x, jax.sharding.SingleDeviceSharding(first))
    dev = next(iter(x.devices()))
    if dev.platform != "cpu":
        x = jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    return np.from_dlpack(x)


def on_device(slot: StagingSlot, like: jax.Array) -> tuple[jax.Array, ...]:
    """A slot's layers on `like`'s devices: its device arrays; else its pinned arrays moved to
    device memory (a plain device target would raise "Memory kind mismatch"); else transfers
    of its host buffers (meshes)."""
    if slot.device is not None:
        return slot.device
    if slot.pinned is not None:
        dev = next(iter(like.sharding.device_set))
        return tuple(
            jax.device_put(list(slot.pinned), SingleDeviceSharding(dev, memory_kind="device"))
        )
    return tuple(to_device(h, like) for h in slot.host)


def to_device(host: np.ndarray, like: jax.Array) -> jax.Array:
    """A copy of `host` on `like`'s device, replicated over the mesh when `like` is sharded
    (the scatter then writes each shard). Single-device staging goes through
    `StagingCache.borrow_layers` instead, without this copy."""
    devices = like.sharding.device_set
    if len(devices) > 1:
        sharding = like.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        else:
            mesh = jax.sharding.Mesh(np.array(sorted(devices, key=lambda d: d.id)), ("all",))
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.device_put(host, replicated)
    return jax.device_put(host, next(iter(devices)))
