"""How a connector names a prompt's blocks and finds them in its store: chained block keys
(`block_hashes`, `block_keys`) and `lookup`, the part of `KVConnector` that reads keys only
and never moves KV."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from jax.typing import ArrayLike

from jaxkv._checks import is_int
from jaxkv.connector import _hashing
from jaxkv.connector._records import BlockRecord
from jaxkv.connector._shards import ShardPlan
from jaxkv.connector._store_calls import StoreCalls
from jaxkv.connector.layout import Layout


def keys_fingerprint(fingerprints: list[str]) -> str:
    """The layout of the keys a connector stores under: its pool's (whole rows, on one device
    or several), or a digest over its shard groups' when there are several."""
    if len(fingerprints) == 1:
        return fingerprints[0]
    return hashlib.sha256(json.dumps(fingerprints).encode()).hexdigest()


class BlockKeys:
    """`KVConnector`'s keys. The connector sets the attributes below."""

    namespace: str
    layout: Layout
    fingerprint: str
    block_size: int
    _pool_fingerprint: str
    _shards: ShardPlan | None
    _chains: _hashing.KeyChains
    _store: StoreCalls

    def _chain(self, data: bytes, salt, fingerprint=None) -> list[bytes]:
        """Block digests of token bytes `data` under `fingerprint` (default: the pool's)."""
        return self._chains.digests(
            self.namespace, fingerprint or self.fingerprint, salt, data, self.block_size
        )

    def block_hashes(
        self, token_ids: ArrayLike | Sequence[int], *, salt: str | bytes | None = None
    ) -> list[str]:
        """Hex keys of every full block of `token_ids`, chained: block i's key covers all
        tokens up to its end, under this connector's namespace, `fingerprint` and `salt`.
        For a pool on one device these are the keys its blocks are stored under; a sharded
        pool stores each block under one key per shard (`block_keys`).

        Args:
            token_ids: 1-D integer token ids in `[0, 2**32)`.
            salt: a tenant's salt (`str` or `bytes`); blocks stored under one salt are
                invisible under another.

        Returns:
            One key (64 hex digits) per full block; a partial tail block has none.

        Raises:
            TypeError: `token_ids` that are not integers, or a `salt` that is neither `str`,
                `bytes` nor `None`.
            ValueError: `token_ids` that are not 1-D, or an id outside `[0, 2**32)`.
        """
        return [d.hex() for d in self._chain(_hashing.token_bytes(token_ids), salt)]

    def block_keys(
        self, token_ids: ArrayLike | Sequence[int], *, salt: str | bytes | None = None
    ) -> list[list[str]]:
        """The keys each full block of `token_ids` is stored under: one key per block for a
        pool on one device (its `block_hashes` entry), one per shard for a pool spread over
        devices (the shards this process moves, in a fixed order), each a record of its own
        in the store.

        Args:
            token_ids, salt: as `block_hashes`.

        Returns:
            Per full block, the list of its keys (64 hex digits each).

        Raises:
            TypeError, ValueError: as `block_hashes`.

        Example:
            >>> import numpy as np, jaxkv
            >>> from jaxkv.connector import HostStore, KVConnector
            >>> pool = jaxkv.MHAPool.create(size=64, head_num=1, head_dim=2, layer_num=1)
            >>> conn = KVConnector(pool, HostStore(1 << 20), block_size=4)
            >>> keys = conn.block_keys(np.arange(10))
            >>> len(keys), [len(k) for k in keys], keys[0][0] == conn.block_hashes(np.arange(10))[0]
            (2, [1, 1], True)
        """
        data = _hashing.token_bytes(token_ids)
        per_layout = [self._chain(data, salt, f) for f in self._fingerprints()]
        return [[d.hex() for d in block] for block in zip(*per_layout)]

    def lookup(
        self,
        token_ids: ArrayLike | Sequence[int],
        *,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> int:
        """Tokens (a multiple of `block_size`) from `start` on whose blocks are all stored, or
        being written by `store_async` (on a sharded pool: by every shard this process holds).
        Changes no data (a store may refresh recency).

        Args:
            token_ids: 1-D integer token ids, the whole prefix from its first token (block
                keys are chained from it).
            salt: the salt the blocks were stored under, if any.
            start: the first token to look for, a multiple of `block_size` (the tokens before
                it are held elsewhere, say on the device); 0 asks for the whole prefix.

        Returns:
            The number of tokens found from `start` on, a multiple of `block_size`.

        Raises:
            TypeError, ValueError: bad `token_ids` or `salt`, as `block_hashes`; a `start`
                that is not a multiple of `block_size` in `[0, len(token_ids)]`.
            OSError: the store failed to answer, only when this connector or the store is
                strict (otherwise the blocks it could not check count as missing).
        """
        data = _hashing.token_bytes(token_ids)
        first = self._first_block(start, len(data) // 4)
        found = []  # per layout (one, or one per shard group): the run of blocks held
        for fingerprint in self._fingerprints():
            digests = self._chain(data, salt, fingerprint)[first:]
            held = self._store.held([d.hex() for d in digests], stop_at_miss=True)
            found.append(held.index(False) if False in held else len(held))
        n = min(found)
        self._store.count("lookups")
        self._store.count("lookup_hits", n)
        self._store.count("lookup_misses", len(digests) - n)
        return n * self.block_size

    def fetch(
        self,
        token_ids: ArrayLike | Sequence[int],
        *,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> list[list[BlockRecord]]:
        """The stored records of the longest run of `token_ids`' blocks from `start` on, each
        checked as `load` checks it (a record that fails ends the run and is discarded), read
        without writing any pool: what `load` would copy.

        Args:
            token_ids, salt, start: as `lookup`.

        Returns:
            Per block of the run, its records: one, or one per shard this process moves (in
            `block_keys` order). They are the store's, read-only: a store may reuse their
            memory once it drops them, so copy what must outlive the next store call.

        Raises:
            TypeError, ValueError: as `lookup`.
            OSError: the store failed to read, only when strict.
        """
        data = _hashing.token_bytes(token_ids)
        first = self._first_block(start, len(data) // 4)
        if self._shards is None:
            groups = [(self.layout, self._pool_fingerprint)]
        else:
            groups = [(g.layout, g.fingerprint) for g in self._shards.groups]
        runs = [self._fetch(layout, fp, data, salt, first)[0] for layout, fp in groups]
        return [list(block) for block in zip(*runs)]

    def _fetch(
        self, layout, fingerprint: str, data: bytes, salt, first: int
    ) -> tuple[list[BlockRecord], int]:
        """The verified records of the longest stored run of blocks from block `first` on
        under `fingerprint`, and the number of full blocks asked for."""
        keys = [d.hex() for d in self._chain(data, salt, fingerprint)[first:]]
        return self._store.fetch(layout, fingerprint, keys, data, first, self.block_size), len(keys)

    def _first_block(self, start, n_tokens: int) -> int:
        """The block `start` (a token index) begins, checked: a multiple of `block_size`."""
        bs = self.block_size
        if not is_int(start) or not 0 <= start <= n_tokens or start % bs:
            raise ValueError(
                f"start: expected a multiple of block_size={bs} in [0, {n_tokens}] (the "
                f"number of token ids), got {start!r}"
            )
        return int(start) // bs

    def _fingerprints(self) -> list[str]:
        """The layouts this process's blocks are keyed under: the pool's, or one per shard."""
        if self._shards is None:
            return [self._pool_fingerprint]
        return [g.fingerprint for g in self._shards.groups]
