"""An L3 tier under sglang-jax's HiCache: its pages kept in a jaxkv store, found again by tokens.

sglang-jax's HiCache keeps KV pages on the device (L1) and in host memory (L2); a page evicted
from both is gone, and so is everything after a restart. `StoreRadixCache`, a subclass of
sglang-jax's `UnifiedRadixCache`, puts a jaxkv `BlockStore` under them (`DiskStore`,
`RedisStore`, `TieredStore`, ...): every prefix HiCache backs up to host memory is also written
to the store, keyed by the chained hashes of its tokens, and a prefix the device and host no
longer hold is loaded back from it, bit-exact, into newly allocated device slots: after a
host eviction, after a process restart, and on another host that shares the Redis server.

Its seams are the tree's own methods (sglang-jax's code is unchanged):

- `write_backup` (HiCache's device-to-host backup of a node): the path from the root to the
  node also goes to `KVConnector.store_async`. Its device-to-host snapshot is taken there,
  beside HiCache's own, and the writes run on the connector's background worker. A host-leaf
  eviction then only drops the host copy: the store has the pages.
- `match_prefix`: when the device and host match ends a block or more before the prompt's
  last whole block, background threads read the next blocks from the store into host memory
  (a prefetch). The match waits while blocks land (until the prefetch ends, the store stalls,
  or the round's `wait_s` is spent), then reports the blocks in host memory as host hits
  (`host_hit_length`), as HiCache reports its own.
- `init_load_back` (the scheduler's call for a host hit): HiCache's host part first, then the
  prefetched blocks are checked, held in host memory and inserted into the tree as device
  nodes in newly allocated slots; both evict unlocked cached prefixes for room, as SGLang's
  HiCache does. The match hands its store hit to `init_load_back` through the match result's
  `last_host_node`, which the scheduler passes back unread: the one channel sglang-jax offers
  from a match to its load.
- `finish_load_back` (the scheduler's call where writing the pool is safe, before the forward
  that reads it: HiCache's own host pages are written there): the held blocks are copied into
  their slots. The store's part of a load rides in sglang-jax's flush plan beside HiCache's.

Writes and reads run in the background; the scheduler's thread copies host memory (the
snapshot, the prefetched blocks) and waits only for a prefetch that makes progress. A failing
or slow store (an error, a timeout, a damaged record) is counted (`StoreTier.stats`, logged at
INFO at most once a minute), its failures logged on the `jaxkv` logger, and its request
recomputed; nothing is raised into the scheduler. A block the store drops (evicts, finds
damaged, discards, or a read finds missing or wrong) is forgotten as stored, so the next
backup writes it again.

The connector describes the pool as it describes any pool sglang-jax builds (one layout, the
connector's, for jaxkv's pools and sglang-jax's), so these blocks are the blocks a
`KVConnector` over the same pool stores and loads.

Turning it on: `python -m jaxkv.integrations.sglang_jax.serve` (the `serve` module) runs
sglang-jax's server with `install()` done in every process it spawns, configured by the
`JAXKV_SGLANG_JAX_*` environment variables (`StoreSettings.from_env`); sglang-jax's own
`--hicache-storage none` turns HiCache on. See docs/sglang_jax.md ("The persistent tier").

sglang-jax is imported only when a tree is built or the hook installed: jaxkv imports without it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from concurrent.futures import Future
from typing import Any

import numpy as np

from jaxkv.connector import BlockStore, KVConnector
from jaxkv.integrations.sglang_jax._store_hook import install, installed, uninstall
from jaxkv.integrations.sglang_jax._store_settings import (
    ENV_HOST_POOL,
    ENV_NAMESPACE,
    ENV_PREFETCH_MB,
    ENV_STORE,
    ENV_WAIT_MS,
    MAX_WAIT_S,
    MEMORY_BYTES,
    PREFETCH_BYTES,
    WAIT_S,
    StoreSettings,
    check_tier_args,
    namespace_of,
    open_store,
)
from jaxkv.integrations.sglang_jax._store_sides import (
    MAX_WRITES,
    KnownKeys,
    ReadAhead,
    TierCounters,
)

__all__ = [
    "ENV_HOST_POOL",
    "ENV_NAMESPACE",
    "ENV_PREFETCH_MB",
    "ENV_STORE",
    "ENV_WAIT_MS",
    "MAX_WAIT_S",
    "MEMORY_BYTES",
    "StoreSettings",
    "StoreTier",
    "install",
    "installed",
    "namespace_of",
    "open_store",
    "radix_cache_class",
    "uninstall",
]


@dataclasses.dataclass(frozen=True)
class _StoreHit:
    """A match extended by store blocks, handed to the scheduler as the match's
    `last_host_node`, which the scheduler hands back to `init_load_back` unread.

    Attributes:
        anchor: sglang-jax's own `last_host_node` of the match.
        key: the match's `RadixKey`, cut to the end of the blocks found in the store.
        ids: its token ids.
        salt: the key's `extra_key` (the connector's salt).
        start: the first token of the blocks to load (a multiple of the block size, at or
            before the end of the device and host match).
        device_indices: the match's device slots.
        host_tokens: the match's own host hit.
    """

    anchor: Any
    key: Any
    ids: np.ndarray
    salt: str | None
    start: int
    device_indices: np.ndarray
    host_tokens: int


@dataclasses.dataclass(frozen=True)
class _StoreLoad:
    """Store blocks `load_back` inserted into the tree, to be written into their device slots
    by `finish_load_back`; it rides in sglang-jax's flush plan beside HiCache's own entries.

    Attributes:
        ids: the prompt's token ids to the end of the blocks.
        slots: the device slots of the tokens from `start` on.
        salt: the connector's salt.
        start: the first token of the blocks.
        keys: the blocks' keys, held in host memory (pinned) until written.
        duplicate: the leading slots the tree did not take (another request inserted those
            tokens first), freed once written.
        dp_rank: the data rank of the slots.
    """

    ids: np.ndarray
    slots: np.ndarray
    salt: str | None
    start: int
    keys: list[str]
    duplicate: int
    dp_rank: int


def _salt(extra_key: object) -> str | None:
    # Prefixes of different `extra_key`s (LoRA adapters, cache salts) stay apart: salted.
    return None if extra_key is None else str(extra_key)


# ---- the tier -----------------------------------------------------------------------------


class StoreTier:
    """A store under one sglang-jax tree: HiCache's backups written to it, prefixes read back.

    `StoreRadixCache` makes one (its `jaxkv` attribute) and calls it from its seams.

    Args:
        tree: the tree (a `StoreRadixCache`): sglang-jax's `UnifiedRadixCache` with the FULL
            component alone, over a pool `KVConnector` reads (dp_size 1).
        store: where blocks go.
        namespace: the connector's namespace: it must name the weights (see `namespace_of`).
        wait_s: the most one scheduling round waits for prefetches, a hard bound (the rest of
            a prefix whose blocks have not arrived by then is recomputed).
        prefetch_bytes: host memory for blocks read ahead from the store; one prefetch takes
            at most half of it.

    Raises:
        ValueError: a tree with other components (recurrent state) or EAGLE's bigram keys, or
            bad `wait_s`, `prefetch_bytes`.
        TypeError: a `store` that is not a `BlockStore`.
        UnsupportedKVCacheError: a pool the connector cannot read.
    """

    def __init__(
        self,
        tree: Any,
        store: BlockStore,
        *,
        namespace: str = "default",
        wait_s: float = WAIT_S,
        prefetch_bytes: int = PREFETCH_BYTES,
    ):
        from sgl_jax.srt.mem_cache.unified_cache_components import BASE_COMPONENT_TYPE

        check_tier_args(wait_s, prefetch_bytes, tree=tree, store=store)
        pool = tree.token_to_kv_pool_allocator.get_kvcache()
        self.tree = tree
        self.store = store
        self.wait_s = float(wait_s)
        self._full = BASE_COMPONENT_TYPE
        #: The counters (`stats`), also logged at INFO on the `jaxkv` logger when they changed,
        #: at most every `counters.every_s` seconds (checked as each scheduling round starts).
        self.counters = TierCounters("StoreRadixCache")
        self._count, self._failed = self.counters.count, self.counters.failed
        self._known = KnownKeys(store)
        #: Writes HiCache's backups to the store (through `KnownKeys`).
        self.writer = KVConnector(pool, self._known, namespace=namespace, max_pending=MAX_WRITES)
        self.block_size = self.writer.block_size
        block_bytes = self.writer.layout.block_nbytes(self.block_size)
        max_blocks = max(1, prefetch_bytes // (2 * block_bytes))
        self._ahead = ReadAhead(
            store, prefetch_bytes, max_blocks, self.counters, missing=self._known.forget
        )
        #: Looks prefixes up in, and loads them from, the blocks read ahead.
        self.reader = KVConnector(
            pool, self._ahead, namespace=namespace, block_size=self.block_size
        )
        # Loads and backups of every size compiled before serving (a compile on a first store
        # hit costs more than the load); if it fails, each compiles when first used.
        most = min(max_blocks, tree.token_to_kv_pool_allocator.size // self.block_size)
        try:
            self.reader.precompile(pool, max_blocks=max(1, most))
        except Exception as err:
            self._failed("precompile", err)
        self._budget = self.wait_s

    def new_round(self) -> None:
        """A round starts: its matches may wait `wait_s` again; counters logged when due."""
        self._budget = self.wait_s
        self.counters.log_changes()

    # ---- match ----------------------------------------------------------------------------

    def match(self, params: Any, result: Any) -> Any:
        """sglang-jax's match `result` for `params`, its host hit extended by the blocks after
        it that are in host memory once the prefetch had its time (see the module)."""
        tree = self.tree
        if params.full_only or tree.disable or not tree.hicache_enabled:
            return result  # a request's re-match of its own prefix, or no host tier to load
        try:
            return self._match(params.key, result)
        except Exception as err:  # a failing store: the request is recomputed
            self._failed("match", err)
            return result

    def _match(self, key: Any, result: Any) -> Any:
        bs = self.block_size
        held = len(result.device_indices) + result.host_hit_length
        want = len(key) // bs * bs
        start = held // bs * bs
        if want - start < bs:
            return result  # no whole block after the device and host hit
        ids = np.asarray(key.token_ids[:want], dtype=np.int64)
        salt = _salt(key.extra_key)
        self._count("lookups")
        found = self.reader.lookup(ids, salt=salt, start=start)
        if start + found < want:
            # Per shard, its keys from the first one not in host memory on. One prefetch per
            # prompt and first block: the last key names the tokens (and salt) before it.
            keys = self.reader.block_keys(ids, salt=salt)
            missing = self._ahead.missing(keys[(start + found) // bs :])
            job = self._ahead.fetch(missing, f"{keys[-1][0]}@{start}") if missing else None
            if job is not None and self._budget > 0:
                waited = self._ahead.wait(job, self._budget)
                self._budget -= waited
                self._count("waited_s", waited)
                found = self.reader.lookup(ids, salt=salt, start=start)
        end = start + found
        if end <= held:
            return result
        self._count("hits")
        self._count("hit_tokens", end - held)
        hit = _StoreHit(
            anchor=result.last_host_node,
            key=key[:end],
            ids=ids[:end],
            salt=salt,
            start=start,
            device_indices=np.asarray(result.device_indices),
            host_tokens=result.host_hit_length,
        )
        return result._replace(last_host_node=hit, host_hit_length=end - len(result.device_indices))

    # ---- load -----------------------------------------------------------------------------

    def load_back(
        self, hit: _StoreHit, host: tuple[np.ndarray, Any, list], mem_quota: int | None
    ) -> tuple[np.ndarray, Any, list]:
        """`init_load_back` for `hit` once HiCache loaded its host part (`host`, sglang-jax's
        `(device_indices, last_node, flush_plan)`): the store's blocks copied into new device
        slots and inserted as device nodes. Returns the same triple, extended; `host` itself
        when no store block could be loaded (allocation or the store failed)."""
        from sgl_jax.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )

        host_indices, node, plan = host
        tree, bs = self.tree, self.block_size
        held = len(hit.device_indices) + hit.host_tokens
        n = len(hit.ids) - hit.start
        dp_rank = hit.key.dp_rank or 0
        allocator = tree.token_to_kv_pool_allocator
        # `node` ends the device prefix now; locked, eviction cannot take it (nor the host
        # part just reloaded under it) for the room the store's blocks need.
        lock = tree.inc_lock_ref(node)
        try:
            available = allocator.available_size(dp_rank)
            if mem_quota is not None:  # free slots, and what is evictable (see init_load_back)
                n = min(n, (available + tree.evictable_size(dp_rank)) // bs * bs)
            slots = None
            if hit.start + n > held:
                if available < n:
                    tree.evict(EvictParams(num_tokens=n - available, dp_rank=dp_rank))
                slots = allocator.alloc(n, dp_rank=dp_rank)
        finally:
            tree.dec_lock_ref(node, lock.to_dec_params())
        if slots is None:
            return host
        slots = np.asarray(slots, dtype=np.int32)
        blocks: list = []
        try:
            ids = hit.ids[: hit.start + len(slots)]
            blocks = self.reader.fetch(ids, salt=hit.salt, start=hit.start)
            # Checked now and held in host memory until `finish_load_back` writes them.
            keys = self._ahead.pin([r for block in blocks for r in block])
        except Exception as err:  # damaged records, or a failing read: recomputed
            self._failed("load", err)
            blocks, keys = [], []
        got = len(blocks) * bs
        end = hit.start + got
        if end <= held:
            self._ahead.unpin(keys)
            allocator.free(slots, dp_rank=dp_rank)
            return host
        prefix = np.concatenate([hit.device_indices, host_indices]).astype(np.int32)
        value = np.concatenate([prefix[: hit.start], slots[:got]])
        inserted = tree.insert(InsertParams(key=hit.key[:end], value=value))
        # The tree holds tokens [0, prefix_len) already (from `held` on, none unless another
        # request inserted them since the match) and took the slots of [prefix_len, end). The
        # slots of blocks it did not take are written all the same (a block loads whole) and
        # freed once written; those past the load are freed now.
        duplicate = max(inserted.prefix_len - hit.start, 0)
        if len(slots) > got:
            allocator.free(slots[got:], dp_rank=dp_rank)
        # Blocks read from the store are held there: the write side need not ask again.
        self._known.remember(keys)
        self._count("loads")
        self._count("loaded_tokens", end - held)
        load = _StoreLoad(hit.ids[:end], slots[:got], hit.salt, hit.start, keys, duplicate, dp_rank)
        matched = tree.match_prefix(MatchPrefixParams(key=hit.key[:end], full_only=True))
        return (
            matched.device_indices[len(hit.device_indices) :],
            matched.last_device_node,
            [
                *plan,
                load,
            ],
        )

    def finish_load_back(self, loads: list[_StoreLoad]) -> None:
        """Writes the blocks `load_back` promised into their device slots: sglang-jax calls
        its `finish_load_back` where writing the pool is safe (no forward holds its donated
        buffers), before the forward that reads them."""
        allocator = self.tree.token_to_kv_pool_allocator
        for load in loads:
            try:
                pool = allocator.get_kvcache()
                _, got = self.reader.load(
                    pool, load.ids, load.slots, salt=load.salt, start=load.start
                )
                if got < len(load.slots):  # the pinned records are held: a failed transfer
                    raise RuntimeError(f"loaded {got} of {len(load.slots)} tokens")
            except Exception as err:
                self._failed("load", err)
            finally:
                self._ahead.unpin(load.keys)
                if load.duplicate:
                    allocator.free(load.slots[: load.duplicate], dp_rank=load.dp_rank)

    # ---- write ----------------------------------------------------------------------------

    def write_through(self, node: Any) -> None:
        """Hands the path from the root to `node` to the store (the blocks it does not hold
        yet): the snapshot now, the writes in the background. Called where HiCache backs the
        node up, so the store gets what host memory gets."""
        try:
            path = self._path(node)
            if path is None or len(path[0]) < self.block_size:
                return
            if not self.counters.start_write():
                return
            try:
                pool = self.tree.token_to_kv_pool_allocator.get_kvcache()
                future = self.writer.store_async(pool, path[0], path[1], salt=path[2])
            except BaseException:
                self.counters.end_write()
                raise
            self._count("writes")
            future.add_done_callback(self._written)
        except Exception as err:  # a failing store: the blocks are not kept
            self._failed("write", err)

    def _written(self, future: Future) -> None:
        self.counters.end_write()
        err = future.exception()
        if err is not None:
            self._failed("write", err)

    def _path(self, node: Any) -> tuple[np.ndarray, np.ndarray, str | None] | None:
        """Token ids, device slots and salt of the path from the root to `node`; None for the
        root or a path through a node with no device copy."""
        root = self.tree.root_node
        if node is root:
            return None
        salt = _salt(node.key.extra_key)
        tokens, slots = [], []
        while node is not root:
            value = node.component_data[self._full].value
            if value is None:
                return None
            tokens.append(np.asarray(node.key.token_ids, dtype=np.int64))
            slots.append(np.asarray(value))
            node = node.parent
        return np.concatenate(tokens[::-1]), np.concatenate(slots[::-1]), salt

    # ---- upkeep ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters of the tier, each with one meaning:

        - `lookups`: matches that asked the store (the device and host match ended a block or
          more before the prompt's last whole block); `hits`, `hit_tokens`: those that
          reported store blocks, and the tokens reported beyond the device and host match.
        - `loads`, `loaded_tokens`: load-backs that copied store blocks into the device pool,
          and the tokens they added to the tree.
        - `prefetches`: reads of the store started; `prefetches_refused`: not started, because
          `_MAX_PREFETCHES` were in flight. `waited_s`: the time matches waited for them.
        - `writes`: `store_async` calls for HiCache's backups; `writes_refused`: backups not
          written, because `MAX_WRITES` calls were in flight; `writes_in_flight`: now.
        - `errors`: failures of the store or the tier (each a request recomputed, or blocks
          not written), also logged on the `jaxkv` logger.
        - `writer`, `reader`: the two connectors' `stats()` (the writer's `"store"` is the
          store's; the reader's is the host memory of the blocks read ahead).
        """
        counters: dict[str, Any] = self.counters.snapshot()
        return {**counters, "writer": self.writer.stats(), "reader": self.reader.stats()}

    def flush(self) -> None:
        """Waits until every write handed to the store so far has finished."""
        self.writer.flush()

    def close(self) -> None:
        """Finishes the writes in flight, stops the background threads and stops listening
        to the store's drops."""
        self._ahead.close()
        self.writer.close()
        self.reader.close()
        self._known.close()


# ---- the tree -----------------------------------------------------------------------------


@functools.cache
def radix_cache_class() -> Any:
    """`StoreRadixCache`, made on the first call: it subclasses sglang-jax's
    `UnifiedRadixCache`, imported then (`from ... import StoreRadixCache` calls this too).

    Raises:
        ImportError: sglang-jax cannot be imported.
    """
    from sgl_jax.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    class StoreRadixCache(UnifiedRadixCache):
        """sglang-jax's `UnifiedRadixCache` over a jaxkv store (see the module's docstring).

        Args:
            *args, **kwargs: `UnifiedRadixCache`'s.
            store, namespace, wait_s, prefetch_bytes: the tier's (`StoreTier`).

        Attributes:
            jaxkv: the `StoreTier` (its `stats`, `flush` and `close`).
        """

        def __init__(
            self,
            *args: Any,
            store: BlockStore,
            namespace: str = "default",
            wait_s: float = WAIT_S,
            prefetch_bytes: int = PREFETCH_BYTES,
            **kwargs: Any,
        ):
            super().__init__(*args, **kwargs)
            self.jaxkv = StoreTier(
                self, store, namespace=namespace, wait_s=wait_s, prefetch_bytes=prefetch_bytes
            )

        @classmethod
        def from_tree(cls, tree: UnifiedRadixCache, **tier: Any) -> StoreRadixCache:
            """A new, empty tree with `tree`'s constructor arguments (read back from its
            attributes of the same names) and the tier's (`store=`, ...)."""
            names = [n for n in inspect.signature(UnifiedRadixCache.__init__).parameters][1:]
            missing = [n for n in names if not hasattr(tree, n)]
            if missing:
                raise TypeError(
                    f"tree: expected a UnifiedRadixCache keeping its arguments {names} as "
                    f"attributes, got a {type(tree).__name__} without {missing}"
                )
            return cls(**{n: getattr(tree, n) for n in names}, **tier)

        def match_prefix(self, params):
            return self.jaxkv.match(params, super().match_prefix(params))

        def init_load_back(self, last_host_node, host_hit_length, mem_quota=None):
            # The scheduler's quota is the free slots; a load back evicts unlocked cached
            # prefixes for room too, as SGLang's HiCache does (the scheduler's budget counts
            # them): a busy server's device is full of cached prefixes.
            hit = last_host_node if isinstance(last_host_node, _StoreHit) else None
            if mem_quota is not None:
                key = last_host_node.key if hit is None else hit.key
                dp_rank = getattr(key, "dp_rank", None) or 0
                mem_quota += self.evictable_size(dp_rank)
            if hit is None:
                return super().init_load_back(last_host_node, host_hit_length, mem_quota)
            host = (np.empty((0,), dtype=np.int32), hit.anchor, [])
            if hit.host_tokens:
                host = super().init_load_back(hit.anchor, hit.host_tokens, mem_quota)
                if len(host[0]) < hit.host_tokens:
                    # HiCache's load-back is all or nothing; without it the store's blocks
                    # would hang below a host tombstone.
                    return host
            return self.jaxkv.load_back(hit, host, mem_quota)

        def finish_load_back(self, flush_plan):
            # The scheduler's donation-safe window: HiCache's host pages, then the store's.
            ours = [p for p in flush_plan if isinstance(p, _StoreLoad)]
            super().finish_load_back([p for p in flush_plan if not isinstance(p, _StoreLoad)])
            if ours:
                self.jaxkv.finish_load_back(ours)

        def write_backup(self, node, write_back=False):
            pages = super().write_backup(node, write_back)
            self.jaxkv.write_through(node)
            return pages

        def check_hicache_events(self):
            # The scheduler's call at the start of each prefill round.
            super().check_hicache_events()
            self.jaxkv.new_round()

    return StoreRadixCache


def __getattr__(name: str) -> Any:
    if name == "StoreRadixCache":
        return radix_cache_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
