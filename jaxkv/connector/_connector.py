"""`KVConnector`: store and reload KV blocks of a prefix, keyed by chained token hashes.

Example:
    >>> import numpy as np
    >>> from jaxkv import MHAPool
    >>> from jaxkv.connector import HostStore, KVConnector
    >>> pool = MHAPool.create(size=256, head_num=2, head_dim=8, layer_num=2)
    >>> conn = KVConnector(pool, HostStore(1 << 20))
    >>> tokens, slots = np.arange(40), np.arange(1, 41)
    >>> conn.store(pool, tokens, slots)      # the full blocks (16 tokens each): blocks written
    2
    >>> pool, n = conn.load(pool, tokens, np.arange(101, 141))   # tokens copied back, bit-exact
    >>> n
    32
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
from jax.typing import ArrayLike

from jaxkv._checks import bool_arg, int_arg, int_vector, is_int, text_arg
from jaxkv._pool_base import PoolBase
from jaxkv.connector import _hashing, _shards
from jaxkv.connector._block_kernels import bucket
from jaxkv.connector._keys import BlockKeys, keys_fingerprint
from jaxkv.connector._pool_views import PoolView, view_of
from jaxkv.connector._records import BlockRecord
from jaxkv.connector._store_calls import StoreCalls, checked_store
from jaxkv.connector._transfers import Snapshot, TransferPath, choose_path, gather_blocks
from jaxkv.connector._writes import BackgroundWrites
from jaxkv.connector.layout import PoolLayout, describe
from jaxkv.connector.stores import BlockStore

# A pool `load` writes into: it returns one of its type (a jaxkv pool, or the foreign one).
Pool = TypeVar("Pool")


class KVConnector(BlockKeys):
    """Moves whole blocks of KV between a pool and a `BlockStore`.

    Args:
        pool: a jaxkv pool; sglang-jax's `MHATokenToKVPool` or `MLATokenToKVPool` (described
            from their own attributes); an object with SGLang-style per-layer buffers
            (`kv_buffer` [+ `index_k_with_scale_buffer`], `k_buffer` + `v_buffer`, or
            `k_buffer`); or any pool whose buffers `layout` declares.
        store: where blocks go (`HostStore`, `DiskStore`, `RedisStore`, `TieredStore`, or any
            `BlockStore` subclass).
        block_size: tokens per block; defaults to the pool's page size when above 1, else 16;
            must be a positive multiple of the page size.
        namespace: names the model whose KV the blocks hold, and must identify its WEIGHTS,
            not only its architecture: two pools of one layout fed by different weights (a
            fine-tune, another checkpoint, another quantisation) hold different KV for the
            same tokens, and only the namespace keeps their blocks apart. Put the checkpoint's
            identity in it, e.g. `f"llama-3-8b-instruct@{checkpoint_sha256[:16]}"`; the
            default `"default"` is only safe for a store that one model's weights ever use.
        shard: which shard of a model this pool holds, for per-rank pools of tensor-parallel
            deployments (e.g. "tp3of8"); jaxkv pools keep "full". A jaxkv pool placed over
            several devices is moved shard by shard, each under its own coordinates (see
            "Sharded pools" below).
        max_pending: `store_async` calls whose writes may be in flight at once (>= 1).
        layout: a `PoolLayout` declaring the buffers of a pool jaxkv does not recognise
            (paged buffers, fused K/V, a plain list of per-layer arrays); None describes
            the pool from what it is. A pool with 4-D or 5-D buffers of an unknown class is
            refused (`UnsupportedKVCacheError`) rather than guessed; declare its layout.
        transfer: how blocks cross between the pool and host memory: None (default) picks
            from the pool's placement ("pinned" on a device with pinned host memory, "cpu"
            for a jaxkv pool on one CPU device, else "gather"); "gather" forces the device
            gather, "pinned" the pinned host path (also on CPU devices, which have that
            memory kind: the accelerators' path, run where it can be tested). See
            `transfer_path`.
        strict: raise I/O errors of the store (`OSError`, after counting them) from `lookup`,
            `store`, `load`, and from `flush` and the futures of `store_async`. By default a
            failed read is a miss (the loaded prefix ends there) and a failed write is a
            dropped block, both counted in `stats()["io_errors"]` and logged on the `jaxkv`
            logger: a cache that fails must not fail the request it was meant to speed up.

    Sharded pools: when `pool`'s buffers span several devices, or sit on a mesh with explicit
    axes (sglang-jax's), `store`, `store_async`, `lookup` and `load` run on the shards this
    process addresses, never gathering a buffer.
    Each distinct shard is keyed under its coordinates (a head-sharded shard's layout names
    its heads, e.g. "k.1=2:4/8,v.1=2:4/8"), so blocks stored at one tensor-parallel degree are
    misses at another rather than wrong data; a shard holding whole rows (a replicated
    buffer) keeps the one-device keys. Each shard is stored once, by the process holding its
    replica 0, and loaded into every replica this process holds. A load copies the prefix
    every shard of this process holds; across processes, agree on one length first (gather
    each process's `lookup` and take `min_block_count`), then load that many tokens.
    `block_keys` lists a block's per-shard keys.

    Attributes:
        fingerprint: the layout of the keys blocks are stored under (hex digest, with the
            block size): two connectors with equal fingerprints (and namespaces) share
            blocks. For a pool on one device it is its layout's; for a sharded pool it covers
            every shard's layout, so a pool spread over 8 devices and the same model on one
            device differ, as their keys do.
        layout: the pool's layout (whole rows, whatever the sharding).

    Raises:
        UnsupportedKVCacheError: `pool` has none of the accepted buffer attributes, buffers
            jaxkv cannot move, buffers not laid out as `layout` declares, or buffers whose
            layout is ambiguous (the message says what was seen and how to declare it).
        ValueError: a `block_size` that is not a positive multiple of the page size, a
            `max_pending` that is not a positive int, or a `transfer` the pool's placement
            cannot take.
        TypeError: a `store` that is not a `BlockStore`, a `strict` that is not a bool, or a
            `namespace` or `shard` that is not a str.
        ValueError: a `namespace` or `shard` that UTF-8 cannot encode (a lone surrogate).

    Whatever the store answers, a record is loaded only when it is the record of the key it
    was fetched for (its key, layout, token digest, part names, shapes and dtypes); one that
    is not is a miss, counted in `verification_failures`, and discarded from the store
    (`BlockStore.discard`), so `lookup` stops counting it and the next `store` repairs it. A
    store that raises, or answers with something that is not an answer (a list of the wrong
    length, values of the wrong type), is failing: counted in `io_errors` and logged, a miss
    or a dropped write, unless `strict` (then `OSError`, `StoreReplyError` for a malformed
    answer, is raised).

    After `close()`, `store`, `store_async` and `load` raise `RuntimeError`.
    """

    def __init__(
        self,
        pool: object,
        store: BlockStore,
        *,
        block_size: int | None = None,
        namespace: str = "default",
        shard: str = "full",
        max_pending: int = 8,
        transfer: str | None = None,
        strict: bool = False,
        layout: PoolLayout | None = None,
    ):
        checked_store(store)
        if layout is not None and not isinstance(layout, PoolLayout):
            raise TypeError(f"layout: expected a PoolLayout or None, got {type(layout).__name__}")
        if layout is not None and isinstance(pool, PoolBase):
            raise ValueError(
                f"layout: a jaxkv pool ({type(pool).__name__}) describes its own buffers; "
                "pass layout=None"
            )
        self._declared = layout
        view = view_of(pool, describe(pool, layout))
        page = view.layout.page_size
        if block_size is None:
            block_size = page if page > 1 else 16
        if not is_int(block_size) or block_size <= 0 or block_size % page:
            raise ValueError(
                f"block_size: expected a positive multiple of the page size {page}, "
                f"got {block_size!r}"
            )
        int_arg("max_pending", max_pending)
        strict = bool_arg("strict", strict)
        self.block_size = int(block_size)
        self.namespace = text_arg("namespace", namespace)
        self.layout = dataclasses.replace(view.layout, shard=text_arg("shard", shard))
        # The pool's own layout, what every pool handed to a call must match (its keys'
        # layout, `fingerprint`, covers the shards' layouts of a sharded pool).
        self._pool_fingerprint = self.layout.fingerprint(self.block_size)
        self._shards = _shards.plan(view, self.layout, self.block_size)
        self.fingerprint = keys_fingerprint(self._fingerprints())
        if self._shards is not None:  # every shard is placed alike: the first one decides
            view = _shards.shard_views(self._shards, view)[0][1][0]
        #: The `TransferPath` every store and load of this connector goes through.
        self.transfer_path: TransferPath = choose_path(view, transfer)
        self._chains = _hashing.KeyChains()
        self._writes = BackgroundWrites(int(max_pending))
        self._store = StoreCalls(store, strict, self._writes)

    @property
    def backend(self) -> BlockStore:
        """The store; assigning another `BlockStore` makes the next calls use it."""
        return self._store.backend

    @backend.setter
    def backend(self, store: BlockStore) -> None:
        self._store.backend = checked_store(store)

    @property
    def strict(self) -> bool:
        """Whether the store's failures are raised (see the class); settable to a bool."""
        return self._store.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self._store.strict = bool_arg("strict", value)

    def _check_open(self) -> None:
        self._writes.check_open()

    # ---- transfers ----------------------------------------------------------------------

    def _view(self, pool) -> PoolView:
        view = view_of(pool, describe(pool, self._declared))
        layout = dataclasses.replace(view.layout, shard=self.layout.shard)
        if layout.fingerprint(self.block_size) != self._pool_fingerprint:
            diffs = "; ".join(self.layout.differences(layout)) or "another fingerprint"
            raise ValueError(
                f"pool: expected the layout this connector was made for, got one that differs "
                f"in {diffs}"
            )
        _shards.check_placement(self._shards, view)
        return view

    def _slots(self, slots, n: int, rows: int, arg: str = "slots") -> np.ndarray:
        arr = int_vector(arg, slots, "slots")
        if arr.shape[0] != n:
            raise ValueError(f"{arg}: expected shape ({n},), got {arr.shape}")
        bad = np.flatnonzero((arr < 0) | (arr >= rows))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{arg}[{i}] = {int(arr[i])} is outside the pool's rows [0, {rows})")
        return arr.astype(np.int32)

    def export_blocks(
        self, pool: object, slots: ArrayLike | Sequence[int]
    ) -> dict[str, np.ndarray]:
        """Gathers the blocks at `slots` (a multiple of `block_size` long) on the device into
        block-major staging arrays `(n_blocks, layer_num, block_size, *row)` of raw bits and
        hands them to the host through DLPack (no further copy on CPU).

        Args:
            pool: a pool of this connector's layout.
            slots: the pool rows of whole blocks, 1-D, `len(slots)` a multiple of
                `block_size`.

        Returns:
            Per buffer family (`"k"`, `"v"`, `"kv"`, `"index_k"`), an array `(n_blocks,
            layer_num, block_size, *row_shape)` in the buffers' raw-bit dtype.

        Raises:
            ValueError: `len(slots)` not a multiple of `block_size`, a slot outside the pool's
                rows, or a pool of another layout.
            TypeError: non-integer slots.
            UnsupportedKVCacheError: `pool` has none of the accepted buffer attributes.
        """
        view = self._view(pool)
        if self._shards is not None and not self._shards.fully_addressable:
            raise ValueError(
                "pool: expected buffers this process can address whole for export_blocks (full "
                "rows), got shards held by other processes; store and load move each "
                "process's own shards"
            )
        n = int(np.shape(slots)[0]) if np.ndim(slots) == 1 else -1
        if n < 0 or n % self.block_size:
            raise ValueError(
                f"slots: expected a multiple of block_size={self.block_size} slots, "
                f"got shape {np.shape(slots)}"
            )
        slots = self._slots(slots, n, view.layout.rows)
        return gather_blocks(_shards.GlobalView(view), slots, self.block_size)

    def _snapshot(self, pool, token_ids, slots, salt) -> tuple[list[BlockRecord], list[int], list]:
        """Records of the full blocks not yet stored (nor being written), copied to host; the
        block each record belongs to (a sharded pool has a record per shard of a block); and
        the staging buffers they live in (give those back once the records are written)."""
        view = self._view(pool)
        data = _hashing.token_bytes(token_ids)
        slots = self._slots(slots, len(data) // 4, view.layout.rows)
        if self._shards is None:
            return self._snapshot_view(view, self._pool_fingerprint, data, slots, salt)
        got = [
            self._snapshot_view(replicas[0], group.fingerprint, data, slots, salt)
            for group, replicas in _shards.shard_views(self._shards, view)
            if group.stores
        ]
        return (
            [r for g in got for r in g[0]],
            [b for g in got for b in g[1]],
            [s for g in got for s in g[2]],
        )

    def _snapshot_view(self, view: PoolView, fingerprint: str, data: bytes, slots, salt):
        """`_snapshot` of one pool or shard whose blocks are keyed under `fingerprint`."""
        digests = self._chain(data, salt, fingerprint)
        held = self._store.held([d.hex() for d in digests])
        missing = [i for i, h in enumerate(held) if not h]
        if not missing:
            return [], [], []
        bs = self.block_size
        rows = np.concatenate([slots[i * bs : (i + 1) * bs] for i in missing])
        # A segment (the pinned path) is memory nobody reuses, so a store can keep it; other
        # records are views of memory a store lent for them, or of reused staging, valid
        # until the snapshot is given back.
        snap = self.transfer_path.snapshot(view, rows, bs, self.backend)
        records = [
            BlockRecord(
                key=digests[i].hex(),
                layout=fingerprint,
                tokens=_hashing.block_digest(data[4 * i * bs : 4 * (i + 1) * bs]),
                parts=snap.parts[j],
                source=None if snap.segment is None else (snap.segment, j),
            )
            for j, i in enumerate(missing)
        ]
        return records, missing, [snap]

    def store(
        self,
        pool: object,
        token_ids: ArrayLike | Sequence[int],
        slots: ArrayLike | Sequence[int],
        *,
        salt: str | bytes | None = None,
    ) -> int:
        """Stores the full blocks of `token_ids` not already stored.

        Args:
            pool: a pool of this connector's layout holding the tokens.
            token_ids: 1-D integer token ids; a partial tail block is not stored.
            slots: `slots[t]` is the pool row of token `t`; `len(slots) == len(token_ids)`.
            salt: a tenant's salt (`str` or `bytes`), or `None`.

        Returns:
            The number of blocks newly written (a block the store failed to write is not
            counted; see `strict`). On a sharded pool, a block counts when this process newly
            wrote a record of any of its shards; `stats()["records_stored"]` counts the
            records.

        Raises:
            RuntimeError: the connector is closed.
            ValueError: `slots` not of shape `(len(token_ids),)`, a slot outside the pool's
                rows, a pool of another layout, or bad `token_ids` (as `block_hashes`).
            TypeError: non-integer slots or token ids, or a bad `salt`.
            UnsupportedKVCacheError: `pool` has none of the accepted buffer attributes.
            OSError: the store failed, only when this connector or the store is strict.
        """
        self._check_open()
        records, blocks, staging = self._snapshot(pool, token_ids, slots, salt)
        try:
            return self._store.write(records, blocks)
        finally:
            self._give_back(staging)

    @contextlib.contextmanager
    def snapshot(
        self,
        pool: object,
        token_ids: ArrayLike | Sequence[int],
        slots: ArrayLike | Sequence[int],
        *,
        salt: str | bytes | None = None,
    ) -> Iterator[list[BlockRecord]]:
        """The records `store` would write, copied to host memory, without writing them: one
        per full block of `token_ids` not yet stored (one per shard of a block on a sharded
        pool). Their arrays are valid inside the `with` block, whose end hands the staging
        memory back; copy what must outlive it.

        Args:
            pool, token_ids, slots, salt: as `store`.

        Yields:
            The records (`BlockRecord`s, read-only).

        Raises:
            As `store`.

        Example:
            >>> import numpy as np, jaxkv
            >>> from jaxkv.connector import HostStore, KVConnector
            >>> pool = jaxkv.MHAPool.create(size=64, head_num=1, head_dim=2, layer_num=1)
            >>> conn = KVConnector(pool, HostStore(1 << 20), block_size=4)
            >>> with conn.snapshot(pool, np.arange(10), np.arange(1, 11)) as records:
            ...     [r.parts["k"].shape for r in records]
            [(1, 4, 1, 2), (1, 4, 1, 2)]
        """
        self._check_open()
        records, _, staging = self._snapshot(pool, token_ids, slots, salt)
        try:
            yield records
        finally:
            self._give_back(staging)

    def _give_back(self, snapshots: list[Snapshot]) -> None:
        """Hands the snapshots' staging and store loans back, once their records are written
        (what a store kept of them is its own now)."""
        for snap in snapshots:
            self.transfer_path.give_back(snap)

    def store_async(
        self,
        pool: object,
        token_ids: ArrayLike | Sequence[int],
        slots: ArrayLike | Sequence[int],
        *,
        salt: str | bytes | None = None,
    ) -> Future[int]:
        """Like `store`, but returns as soon as the blocks are copied to host memory.

        The device-to-host snapshot is taken before this returns, so the pool may be donated
        to the next step at once; the writes into the store run on one background worker, at
        most `max_pending` calls deep (a further call waits for room). `load` waits for the
        blocks it needs that are still being written; `lookup` counts them as stored.

        Args:
            pool, token_ids, slots, salt: as `store`.

        Returns:
            A `concurrent.futures.Future` of the number of blocks newly written, or of the
            error the write raised (an `OSError` only when strict: otherwise a failed write
            is a dropped block), which `flush` raises too.

        Raises:
            RuntimeError: the connector is closed (also when it closes while this call waits
                for room).
            ValueError, TypeError, UnsupportedKVCacheError: bad arguments, as `store`, raised
                here rather than on the future.
            OSError: checking which blocks are stored failed, only when strict.
        """
        self._check_open()
        records, blocks, staging = self._snapshot(pool, token_ids, slots, salt)
        if not records:
            done: Future = Future()
            done.set_result(0)
            return done
        keys = [r.key for r in records]

        def write() -> int:
            try:
                return self._store.write(records, blocks)
            except BaseException:
                self._store.count("async_failures")
                raise

        return self._writes.submit(keys, write, lambda: self._give_back(staging))

    def flush(self) -> None:
        """Waits until every `store_async` write has finished, then raises the first write
        error since the last `flush` (each error also stays on its own future).

        Raises:
            Exception: the first error a background write raised since the last `flush`
                (an `OSError` of a strict connector or store, for instance).
        """
        self._writes.flush()

    def close(self) -> None:
        """Waits for pending writes (their errors stay on their futures) and stops the
        background worker; later `store`, `store_async` and `load` calls raise `RuntimeError`
        (`lookup`, `block_hashes`, `stats` and `flush` still answer)."""
        self._writes.close()

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def load(
        self,
        pool: Pool,
        token_ids: ArrayLike | Sequence[int],
        slots: ArrayLike | Sequence[int],
        *,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> tuple[Pool, int]:
        """Copies the longest stored run of `token_ids`' blocks from `start` on into rows
        `slots[:n]`, bit-exact (with `start=0`, the longest stored prefix).

        Every record is checked against its key, this layout and its block's token ids; the
        first block that fails ends the prefix (corrupt data is never loaded). Like eager
        updates, a jaxkv pool passed in is consumed: use the returned one. A pool jaxkv did
        not create is written in place and returned.

        Args:
            pool: a pool of this connector's layout to write into.
            token_ids: 1-D integer token ids, the whole prefix from its first token (block
                keys are chained from it).
            slots: the rows to write, one per token from `start` on (`len(slots) ==
                len(token_ids) - start`); only the first `n_loaded_tokens` are written.
            salt: the salt the blocks were stored under, if any.
            start: the first token to load, a multiple of `block_size`: the tokens before it
                are already in the pool (a prefix cache's device hit), and only the blocks
                after them are read.

        Returns:
            `(new_pool, n_loaded_tokens)`: the tokens loaded from `start` on, a multiple of
            `block_size` (0 when nothing is stored; then `pool` itself is returned).

        Raises:
            RuntimeError: the connector is closed.
            ValueError, TypeError, UnsupportedKVCacheError: bad arguments, as `store` (and a
                `start` as `lookup`); also `TypeError` when a foreign pool's buffers cannot be
                written (checked before any is written).
            OSError: the store failed to read, only when this connector or the store is
                strict (otherwise the prefix ends at the failed block).
        """
        self._check_open()
        view = self._view(pool)
        data = _hashing.token_bytes(token_ids)
        first = self._first_block(start, len(data) // 4)
        slots = self._slots(slots, len(data) // 4 - first * self.block_size, view.layout.rows)
        self._store.count("loads")
        if self._shards is not None:
            return self._load_shards(view, data, slots, salt, first)
        records, n_blocks = self._fetch(self.layout, self._pool_fingerprint, data, salt, first)
        self._store.count("hits", len(records))
        self._store.count("misses", n_blocks - len(records))
        if not records:
            return pool, 0
        bs = self.block_size
        n = len(records) * bs
        pool = self.transfer_path.write(view, records, slots[:n], bs)
        self._store.count("blocks_loaded", len(records))
        self._store.count("records_loaded", len(records))
        self._store.count(
            "bytes_loaded", len(records) * self.layout.block_nbytes(bs)
        )  # all checked
        return pool, n

    def _load_shards(self, view: PoolView, data: bytes, slots, salt, first: int):
        """`load` of a sharded pool (see `_shards.load`)."""
        assert self._shards is not None  # the caller's branch
        return _shards.load(
            self._shards,
            view,
            lambda group: self._fetch(group.layout, group.fingerprint, data, salt, first),
            slots,
            self.block_size,
            self.transfer_path,
            self._store.count,
        )

    def precompile(self, pool: Pool, *, max_blocks: int) -> Pool:
        """Compiles the device transfers `store` and `load` run for up to `max_blocks`
        blocks, so that a serving loop's first store or load of a new size does not compile
        on its critical path. Transfers run at a bucket of blocks (the next power of two),
        so this compiles a gather and a scatter per bucket (each for blocks that are runs of
        slots and for blocks that are not); it stores and loads nothing and changes no entry
        of the pool.

        Args:
            pool: a pool of this connector's layout. Like `load`, a jaxkv pool is consumed:
                use the returned one (a foreign pool's buffers are replaced in place).
            max_blocks: the most blocks one call will move, a positive int.

        Returns:
            The pool.

        Raises:
            RuntimeError: the connector is closed.
            ValueError: a `max_blocks` that is not a positive int, or a pool of another layout.
        """
        self._check_open()
        top = bucket(int_arg("max_blocks", max_blocks))
        bs, path = self.block_size, self.transfer_path
        # Blocks that are runs of slots (windows of rows) and blocks that are not: an
        # allocator hands out either, a busy one mostly the second.
        for n, windows in itertools.product((1 << i for i in range(top.bit_length())), (1, 0)):
            view = self._view(pool)
            if self._shards is None:
                pool = path.precompile(view, n, bs, bool(windows))
                continue
            view.check_replaceable()
            placed = _shards.placements(view)
            written = {}
            for group, replicas in _shards.shard_views(self._shards, view):
                for replica, device in zip(replicas, group.devices):
                    written[device] = path.precompile(replica, n, bs, bool(windows))
            pool = _shards.rebuild(view, placed, written)
        return pool

    def stats(self) -> dict[str, Any]:
        """Counters of this connector, each with one meaning (blocks are full blocks):

        - `lookups`: `lookup` calls; `lookup_hits`, `lookup_misses`: blocks a lookup found
          stored (the prefix it reported), and the blocks after that prefix.
        - `loads`: `load` calls; `hits`, `misses`: blocks a load copied into the pool, and
          the blocks after that prefix (absent, damaged, or failing to read).
        - `blocks_stored`, `bytes_stored`: blocks newly written by `store` and `store_async`
          (bytes of their arrays); `blocks_loaded`, `bytes_loaded`: blocks copied by `load`
          (`blocks_loaded == hits`). `records_stored`, `records_loaded`: the same in records,
          one per shard of a block on a sharded pool (equal to the blocks otherwise).
        - `verification_failures`: records that failed a check, this connector's own (key,
          layout, token ids, part shapes) plus the store's (checksum, torn files);
          `discarded`: records failing this connector's checks that the store then removed
          (the store's `undiscarded` counts those it could not).
        - `io_errors`: failed store operations, the store's count plus the `OSError`s the
          store raised to this connector; each was a miss or a dropped write unless `strict`.
        - `async_failures`: `store_async` writes whose future holds an error.
        - `evictions`: the store's; `pending_blocks`: blocks `store_async` is still writing.

        The store's own counters (see `BlockStore.stats`) are under `"store"`.

        Returns:
            The counters above (ints) and `"store"`, the store's `stats()` dict.
        """
        return self._store.stats()
