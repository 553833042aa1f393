"""`LRUHostKVPool`: the host tier (L2) of sglang-jax's HiCache, on jaxkv's host memory.

HiCache speaks page ids only: the radix cache allocates host slots (`alloc`, `free`), its
controller moves device pages into them and back, and no array crosses that boundary. Each
slot holds one device page over all layers, of every buffer family the device pool holds (the
families jaxkv's connector declares for it: `kv_buffer`, and a DSA pool's
`indexer_key_buffer`), so a page never comes back half old. The moves are two-phase, split by
which thread may touch the device pool's buffers (the forward donates them every step):

    backup:  stage_backup (gather, on the thread that owns the buffers)
             -> flush_backup (into host memory, on the controller's worker)
    load:    stage_load   (host memory to the devices, on the worker)
             -> flush_load (scatter, on the thread that owns the buffers)

Bookkeeping invariants, all under one lock:

- A slot is on the free list, or allocated, or retiring: freed while a copy into or out of its
  host memory still runs; it joins the free list when the last copy ends. So a slot's memory
  is never handed to a new owner while an old transfer touches it.
- Every allocation bumps the slot's epoch. `stage_backup` and `stage_load` note the epoch at
  entry and publish their staged pages only if it is unchanged: a slot freed and allocated
  again meanwhile gets nothing of the old owner's transfer.
- Freeing a slot drops whatever was staged for it, so a later flush finds nothing to publish.
- A slot holds a page (`filled`) only once a backup into it completed; a copy into it makes it
  empty until then.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, ClassVar, NamedTuple

import jax
import numpy as np

from jaxkv._checks import int_arg, int_vector
from jaxkv.connector import PoolLayout
from jaxkv.integrations.sglang_jax._pages_on_device import movers_for
from jaxkv.integrations.sglang_jax._pages_on_host import Batch, host_pages_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Slot:
    allocated: bool = False
    epoch: int = 0  # bumped by every allocation
    filled: bool = False  # holds a page a completed backup put there
    writers: int = 0  # copies into its host memory running now
    readers: int = 0  # copies out of its host memory running now
    lock_ref: int = 0
    listed: bool = True  # on the free list


class _Staged(NamedTuple):
    """A slot's page between the two phases of a move: row `row` of a batch."""

    batch: Batch
    row: int


@functools.cache
def lru_host_kv_pool() -> type:
    """`HiCacheHostPool` as a subclass of sglang-jax's `HostKVPool` ABC: the class
    `jaxkv.integrations.sglang_jax.LRUHostKVPool` names, made once, when first asked for (so
    importing jaxkv never imports sglang-jax).

    Raises:
        ImportError: sglang-jax cannot be imported.
    """
    try:
        from sgl_jax.srt.mem_cache.host_kv_pool import HostKVPool
    except ImportError as err:
        raise ImportError(
            "jaxkv.integrations.sglang_jax.LRUHostKVPool subclasses sglang-jax's HostKVPool "
            "(sgl_jax.srt.mem_cache.host_kv_pool), which could not be imported: put "
            f"sglang-jax's python/ folder on PYTHONPATH or install it ({err})"
        ) from err

    # The implementation comes first, so its methods are the ones the ABC sees.
    class LRUHostKVPool(HiCacheHostPool, HostKVPool):
        __doc__ = HiCacheHostPool.__doc__

    LRUHostKVPool.__module__ = "jaxkv.integrations.sglang_jax"
    LRUHostKVPool.__qualname__ = "LRUHostKVPool"
    return LRUHostKVPool


class HiCacheHostPool:
    """HiCache's host pool, with the constructor and behaviour of sglang-jax's
    `LRUHostKVPool`, holding pages in jaxkv's host memory.

    Used as `jaxkv.integrations.sglang_jax.LRUHostKVPool`, this class with sglang-jax's
    `HostKVPool` ABC for a base (its `copy_from_device`, for prefill-decode handoff, raises
    `NotImplementedError`, as in sglang-jax's own pool).

    `pool_size` slots of one device page each (all layers, every buffer family: a DSA pool's
    indexer keys move with its KV). On CPU devices the pages live in a host arena allocated
    and touched at construction, and move as numpy copies of their bits between it and the
    device buffers (host memory too). On accelerators they live in the pinned host arrays
    their backups landed in, and move as compiled gathers and scatters of whole pages, one
    call over all layers of a family per power-of-two chunk of the page count, with the device
    pool's own shardings. `precompile_transfers` compiles every call ahead.

    The slots are page ids: `alloc`/`free` (batched) and `reserve`/`release` (one) hand them
    out and take them back, `inc_lock_ref`/`dec_lock_ref` pin them. Victims are chosen by the
    radix cache, never here: a full pool answers None.

    Args:
        device_pool: sglang-jax's `MHATokenToKVPool` or `MLATokenToKVPool`, whose buffer
            families are the ones `jaxkv.connector.PoolLayout.declared_for` lists; any other
            object moves its `kv_buffer` alone. A family is a list of per-layer arrays whose
            axis 0 is the page (`layer_num` of them in `kv_buffer`), all of one shape, dtype
            and `NamedSharding`. Its buffers are read at each transfer and replaced (donated)
            by each load.
        pool_size: host slots, in pages (> 0).
        page_size: tokens a page, as the device pool's `page_size`.
        layer_num: as the device pool's: one buffer a layer.
        per_layer_shape: one page of one layer, `kv_buffer[0].shape[1:]`. The device pool's
            buffers are what is moved; a different value is logged and not used.
        dtype: the buffers' dtype (likewise logged, not used, when it differs).
        mesh, partition_spec: the device pool's sharding (`kv_sharding`).
        pool_name: a name for the logs.

    Raises:
        ValueError: `pool_size` not a positive int; `page_size`, `layer_num`, `mesh` or
            `partition_spec` not those of the device pool; buffers of a family of different
            shapes, dtypes or shardings; families of different page counts; buffers on
            accelerators without pinned host memory.
        TypeError: buffers not on a `NamedSharding`.
        UnsupportedKVCacheError: sglang-jax's pool with buffers unlike its attributes.
    """

    # The class the install hook put this one in place of in sglang-jax's `host_kv_pool`
    # module (sglang-jax's own `LRUHostKVPool`), which `uninstall` puts back.
    replaced: ClassVar[Any] = None

    def __init__(
        self,
        device_pool: Any,
        pool_size: int,
        page_size: int,
        layer_num: int,
        per_layer_shape: tuple[int, ...],
        dtype: Any,
        mesh: Any,
        partition_spec: Any,
        *,
        pool_name: str = "hicache",
    ) -> None:
        pool_size = int_arg("pool_size", pool_size)
        declared = PoolLayout.declared_for(device_pool)
        self._families = [b.attr for b in declared.buffers] if declared else ["kv_buffer"]
        self._movers = movers = movers_for(device_pool, self._families)
        mover = movers[0]  # the KV buffers: they count the layers and set the sharding
        _check_same(
            "layer_num", int_arg("layer_num", layer_num), "layer count", mover.layers, device_pool
        )
        own_page_size = getattr(device_pool, "page_size", page_size)
        _check_same(
            "page_size", int_arg("page_size", page_size), "page_size", own_page_size, device_pool
        )
        given = jax.sharding.NamedSharding(mesh, partition_spec)
        if not given.is_equivalent_to(mover.buffer_sharding, 1 + len(mover.page_shape)):
            raise ValueError(
                f"mesh, partition_spec: expected the device pool's sharding "
                f"{mover.buffer_sharding}, got {given}"
            )
        if tuple(per_layer_shape) != mover.page_shape or np.dtype(dtype) != mover.dtype:
            logger.warning(
                "host pool %s: per_layer_shape, dtype: the device pool's pages are %s%s, got "
                "%s%s; moving the device pool's pages",
                pool_name,
                mover.dtype,
                list(mover.page_shape),
                np.dtype(dtype),
                list(per_layer_shape),
            )
        self._kv_pool = device_pool
        self._pool_size = pool_size
        self._pool_name = pool_name
        self._host = host_pages_for(pool_size, movers)
        logger.info(
            "host pool %s: %d pages of %d bytes (%s)",
            pool_name,
            pool_size,
            self.page_nbytes,
            ", ".join(f"{m.name}: {m.layers} x {m.dtype}{list(m.page_shape)}" for m in movers),
        )

        self._lock = threading.Lock()
        self._slots = [_Slot() for _ in range(pool_size)]
        self._free: collections.deque[int] = collections.deque(range(pool_size))
        self._backups: dict[int, _Staged] = {}  # staged by stage_backup, for flush_backup
        self._loads: dict[int, _Staged] = {}  # staged by stage_load, for flush_load
        self._last_full_log = 0.0

    # ---- slots -------------------------------------------------------------------------------

    def reserve(self) -> int | None:
        """One free slot, now allocated; None when none is free."""
        with self._lock:
            if not self._free:
                self._log_full(1)
                return None
            return self._allocate()

    def release(self, buffer_id: int) -> None:
        """Frees the slot `buffer_id` (see `free`)."""
        self._release([self._id("buffer_id", buffer_id)], "buffer_id")

    def alloc(self, need_pages: int) -> np.ndarray | None:
        """`need_pages` free slots, now allocated (int64 ids), or None, allocating nothing,
        when fewer are free."""
        need = int_arg("need_pages", need_pages)
        with self._lock:
            if len(self._free) < need:
                self._log_full(need)
                return None
            return np.asarray([self._allocate() for _ in range(need)], np.int64)

    def free(self, host_page_ids: Iterable[int]) -> None:
        """Frees the slots `host_page_ids` (repeats count once), dropping their pages and
        whatever was staged for them; all or none.

        Raises:
            ValueError: an id out of range.
            RuntimeError: an id already free, or locked (`inc_lock_ref`).
        """
        ids = self._ids("host_page_ids", list(host_page_ids), distinct=False)
        self._release(list(dict.fromkeys(ids)), "page id")

    def available_size(self) -> int:
        """Free slots (pages)."""
        with self._lock:
            return len(self._free)

    def total_size(self) -> int:
        """All slots (pages), free or not."""
        return self._pool_size

    @property
    def page_nbytes(self) -> int:
        """The host bytes one slot's page holds: every layer of every buffer family."""
        return sum(mover.page_nbytes for mover in self._movers)

    def inc_lock_ref(self, buffer_id: int) -> None:
        """Pins the allocated slot `buffer_id`: `free` refuses it until `dec_lock_ref`."""
        slot = self._id("buffer_id", buffer_id)
        with self._lock:
            self._allocated(slot, "buffer_id").lock_ref += 1

    def dec_lock_ref(self, buffer_id: int) -> None:
        """Undoes one `inc_lock_ref`; RuntimeError when the slot is not pinned."""
        slot = self._id("buffer_id", buffer_id)
        with self._lock:
            state = self._allocated(slot, "buffer_id")
            if state.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref: buffer_id={slot} is not locked (lock_ref=0)")
            state.lock_ref -= 1

    # ---- backup: device pages to host slots --------------------------------------------------

    def copy_into(self, device_indices: list[int], host_buffer_ids: list[int]) -> None:
        """Copies device pages into allocated slots, pairwise (`stage_backup`, then
        `flush_backup`, on this thread)."""
        self.stage_backup(device_indices, host_buffer_ids)
        self.flush_backup(host_buffer_ids)

    def stage_backup(self, device_indices: list[int], host_buffer_ids: list[int]) -> None:
        """Phase 1 of a backup: gathers the device pages on the devices, for the slots.

        Runs on the thread that owns the device pool's buffers, which it reads; returns once
        the gathered pages are materialized. A slot freed (and perhaps allocated again) before
        the gather ends gets nothing.

        Raises:
            ValueError: lengths differ; an id or device page out of range; a repeated slot.
            RuntimeError: a slot not allocated.
        """
        ids = self._ids("host_buffer_ids", host_buffer_ids)
        pages = self._device_pages("device_indices", device_indices, distinct=False)
        _check_pairs("device_indices", pages, "host_buffer_ids", ids)
        if not ids:
            return
        with self._lock:
            epochs = [self._allocated(slot, "host_buffer_ids").epoch for slot in ids]
        # Returns once the copy is done: the buffers may be donated after this.
        staged = _rows_of(self._host.gather(self._buffers(), pages))
        with self._lock:
            for slot, epoch, entry in zip(ids, epochs, staged):
                if self._current(slot, epoch):
                    self._backups[slot] = entry

    def flush_backup(self, host_buffer_ids: list[int]) -> None:
        """Phase 2 of a backup: puts the pages staged for the slots into host memory.

        Touches no device buffer, so it runs on the controller's worker. A slot freed while
        its page is copied ends up empty.

        Raises:
            ValueError: an id out of range, or repeated.
            RuntimeError: nothing staged for a slot (`stage_backup` first), or a slot being
                read by `stage_load` or written by another `flush_backup` right now. Nothing is
                flushed then.
        """
        ids = self._ids("host_buffer_ids", host_buffer_ids)
        if not ids:
            return
        with self._lock:
            for slot in ids:
                if slot not in self._backups:
                    raise RuntimeError(
                        f"flush_backup: nothing staged for host buffer_id={slot}; "
                        f"stage_backup must run first (or the slot was freed since)"
                    )
                state = self._slots[slot]
                if state.readers or state.writers:
                    doing = "read by stage_load" if state.readers else "written by flush_backup"
                    raise RuntimeError(f"flush_backup: host buffer_id={slot} is being {doing}")
            staged = [self._backups.pop(slot) for slot in ids]
            for slot in ids:
                state = self._slots[slot]
                state.writers += 1
                state.filled = False
        done = False
        try:
            for batch, slots, rows in _by_batch(ids, staged):
                self._host.keep(slots, batch, rows)
            done = True
        finally:
            with self._lock:
                for slot in ids:
                    state = self._slots[slot]
                    state.writers -= 1
                    state.filled = done and state.allocated
                    self._settle(slot)

    # ---- load: host slots to device pages ----------------------------------------------------

    def copy_to_device(self, host_buffer_ids: list[int], device_indices: list[int]) -> None:
        """Copies slots' pages into device pages, pairwise (`stage_load`, then `flush_load`,
        on this thread)."""
        host_buffer_ids = list(host_buffer_ids)
        self.stage_load(host_buffer_ids)
        self.flush_load(host_buffer_ids, device_indices)

    def stage_load(self, host_buffer_ids: list[int]) -> None:
        """Phase 1 of a load: stages the slots' pages for `flush_load` (on accelerators,
        copies them onto the devices), as they are now: a backup into a slot before the flush
        leaves the staged page as it was.

        Touches no device buffer, so it runs on the controller's worker while the forward
        runs. A slot freed (and perhaps allocated again) meanwhile gets nothing staged.

        Raises:
            ValueError: an id out of range, or repeated.
            RuntimeError: a slot not allocated, holding no page, or being written by
                `flush_backup` right now.
        """
        ids = self._ids("host_buffer_ids", host_buffer_ids)
        if not ids:
            return
        with self._lock:
            epochs = []
            for slot in ids:
                state = self._allocated(slot, "host_buffer_ids")
                if state.writers:
                    raise RuntimeError(
                        f"stage_load: host buffer_id={slot} is being written by flush_backup"
                    )
                if not state.filled:
                    raise RuntimeError(
                        f"stage_load: host buffer_id={slot} holds no page (back a device page "
                        f"up into it first)"
                    )
                epochs.append(state.epoch)
            for slot in ids:
                self._slots[slot].readers += 1
        batches: list[Batch] = []
        done = False
        try:
            batches = self._host.fetch(np.asarray(ids, np.int64))  # returns once they are ready
            done = True
        finally:
            with self._lock:
                for slot in ids:
                    self._slots[slot].readers -= 1
                    self._settle(slot)
                for slot, epoch, entry in zip(ids, epochs, _rows_of(batches) if done else []):
                    if self._current(slot, epoch):
                        self._loads[slot] = entry

    def flush_load(self, host_buffer_ids: list[int], device_indices: list[int]) -> None:
        """Phase 2 of a load: scatters the pages staged for the slots into the device pages,
        replacing (donating) the device pool's buffers.

        Runs on the thread that owns the buffers, where no forward holds them.

        Raises:
            ValueError: lengths differ; an id or device page out of range; a repeated id or
                device page.
            RuntimeError: nothing staged for a slot (`stage_load` first). Nothing is written
                then.
        """
        ids = self._ids("host_buffer_ids", host_buffer_ids)
        pages = self._device_pages("device_indices", device_indices, distinct=True)
        _check_pairs("device_indices", pages, "host_buffer_ids", ids)
        if not ids:
            return
        with self._lock:
            for slot in ids:
                if slot not in self._loads:
                    raise RuntimeError(
                        f"flush_load: nothing staged for host buffer_id={slot}; stage_load "
                        f"must run first (or the slot was freed since)"
                    )
            staged = [self._loads.pop(slot) for slot in ids]
        buffers = self._buffers()
        for batch, positions, rows in _by_batch(range(len(ids)), staged):
            # Donates the buffers it reads and puts the new ones in their place before any
            # further call (or error) can leave the pool holding donated arrays.
            self._host.scatter(buffers, batch, rows, pages[positions])
        jax.block_until_ready(buffers)

    def precompile_transfers(self, max_pages: int | None = None) -> None:
        """Compiles every call a transfer of up to `max_pages` pages can use (default and cap:
        the most a transfer can move, min(pool_size, device pages)), so no compilation lands on
        the scheduler while serving. Moves no data and allocates no slot.
        """
        cap = min(self._pool_size, self._movers[0].pages)
        if max_pages is not None:
            cap = min(cap, int_arg("max_pages", max_pages, low=0))
        started = time.perf_counter()
        calls = self._host.precompile(cap)
        logger.info(
            "host pool %s: compiled %d transfer call(s) (up to %d pages) in %.1f s",
            self._pool_name,
            calls,
            cap,
            time.perf_counter() - started,
        )

    def _buffers(self) -> list[list[jax.Array]]:
        """The device pool's per-layer lists, one per family, as it holds them now (the forward
        replaces their entries every step; a load replaces them in these lists)."""
        return [getattr(self._kv_pool, attr) for attr in self._families]

    # ---- bookkeeping (callers hold the lock) -------------------------------------------------

    def _allocate(self) -> int:
        slot = self._free.popleft()
        state = self._slots[slot]
        state.allocated, state.listed, state.filled = True, False, False
        state.epoch += 1
        return slot

    def _release(self, ids: list[int], what: str) -> None:
        with self._lock:
            for slot in ids:
                state = self._slots[slot]
                if not state.allocated:
                    raise RuntimeError(f"double free of {what}={slot} (it is not allocated)")
                if state.lock_ref:
                    raise RuntimeError(
                        f"free of locked {what}={slot} (lock_ref={state.lock_ref}); "
                        f"dec_lock_ref it first"
                    )
            for slot in ids:
                state = self._slots[slot]
                state.allocated = state.filled = False
                self._backups.pop(slot, None)
                self._loads.pop(slot, None)
                self._settle(slot)

    def _settle(self, slot: int) -> None:
        """Puts a freed slot on the free list once no copy touches its memory."""
        state = self._slots[slot]
        if not (state.allocated or state.listed or state.writers or state.readers):
            self._host.drop(slot)
            state.listed = True
            self._free.append(slot)

    def _current(self, slot: int, epoch: int) -> bool:
        state = self._slots[slot]
        return state.allocated and state.epoch == epoch

    def _allocated(self, slot: int, name: str) -> _Slot:
        state = self._slots[slot]
        if not state.allocated:
            raise RuntimeError(f"{name}: buffer_id={slot} is not allocated (alloc or reserve it)")
        return state

    def _log_full(self, need: int) -> None:
        # At most once a second: a full pool is routine (the radix cache evicts, then retries).
        now = time.monotonic()
        if now - self._last_full_log >= 1.0:
            self._last_full_log = now
            logger.info(
                "host pool %s: %d page(s) asked for, %d free of %d; the cache evicts to make room",
                self._pool_name,
                need,
                len(self._free),
                self._pool_size,
            )

    # ---- argument checks ---------------------------------------------------------------------

    def _id(self, name: str, value) -> int:
        return int_arg(name, value, low=0, high=self._pool_size - 1, expected=self._id_range())

    def _id_range(self) -> str:
        return f"a host page id in [0, {self._pool_size})"

    def _ids(self, name: str, values, *, distinct: bool = True) -> list[int]:
        ids = int_vector(name, values, "host page ids")
        bad = ids[(ids < 0) | (ids >= self._pool_size)]
        if bad.size:
            raise ValueError(
                f"{name}: expected host page ids in [0, {self._pool_size}), got {bad[0]}"
            )
        out = [int(i) for i in ids]
        if distinct:
            _check_distinct(name, out)
        return out

    def _device_pages(self, name: str, values, *, distinct: bool) -> np.ndarray:
        pages = int_vector(name, values, "device page ids")
        n = self._movers[0].pages
        bad = pages[(pages < 0) | (pages >= n)]
        if bad.size:
            raise ValueError(
                f"{name}: expected device page ids in [0, {n}) (the buffers' page axis), "
                f"got {bad[0]}"
            )
        if distinct:
            _check_distinct(name, pages.tolist())
        return pages.astype(np.int64)


def _check_same(name: str, value: int, what: str, expected: int, device_pool: Any) -> None:
    if value != expected:
        raise ValueError(
            f"{name}: expected the device pool's {what} ({expected}, "
            f"{type(device_pool).__name__}), got {value}"
        )


def _check_pairs(name_a: str, a, name_b: str, b) -> None:
    if len(a) != len(b):
        raise ValueError(
            f"{name_a}, {name_b}: expected as many device pages as host ids, got {len(a)} and "
            f"{len(b)}"
        )


def _check_distinct(name: str, values: list[int]) -> None:
    seen: set[int] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{name}: expected distinct ids, got {value} more than once")
        seen.add(value)


def _rows_of(batches: list[Batch]) -> list[_Staged]:
    """(batch, row) of each page of `batches`, in order."""
    return [_Staged(batch, row) for batch in batches for row in range(batch.size)]


def _by_batch(keys: Iterable[int], staged: list[_Staged]):
    """(batch, keys, rows) for each batch among `staged`, in first-seen order: the keys (as an
    int64 array) whose pages sit in that batch, and their rows in it."""
    groups: dict[int, tuple[Batch, list[int], list[int]]] = {}
    for key, entry in zip(keys, staged):
        group = groups.setdefault(id(entry.batch), (entry.batch, [], []))
        group[1].append(key)
        group[2].append(entry.row)
    return [
        (batch, np.asarray(members, np.int64), np.asarray(rows, np.int64))
        for batch, members, rows in groups.values()
    ]
