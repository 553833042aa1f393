"""`RedisStore`: blocks in a Redis (or Valkey) server that many serving hosts share.

Each block is one string value: the same self-describing, checksummed record as a disk file
(`_records.encode`), under the key `<key_prefix><block key>`. A block key is the chained hash of
the block's tokens under the connector's namespace, layout fingerprint and salt, so hosts that
serve the same model with the same layout find each other's blocks, and nothing else.

Every call of the connector is one round trip: a pipeline of `EXISTS` for lookups, one `MGET`
for loads, a pipeline of `SET ... NX` for stores. Every read is verified (`_records.decode`);
a record that fails is a miss and is deleted. Capacity is the server's business: give it a
`maxmemory` and the `allkeys-lru` policy, and it evicts the least recently used blocks.

Faults never reach the serving loop. Each socket operation is bounded by `timeout_s`; a call
that fails (server down, slow, restarted) reads as misses and drops its stores, counted in
`stats()`. A circuit breaker then answers at once, without the network, for `retry_after_s`
(doubling per further failure, up to `max_retry_after_s`); the first call after that probes
the server and closes the breaker when it answers.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Sequence

from jaxkv._checks import text_arg
from jaxkv.connector import _records
from jaxkv.connector._records import BlockRecord
from jaxkv.connector.stores import BlockStore

_INSTALL = (
    "RedisStore needs redis-py: install the extra with `pip install 'jaxkv[redis]'` "
    "(or `pip install redis`)"
)

# Counters this store adds to `BlockStore`'s.
_REMOTE_COUNTERS = ("round_trips", "dropped", "unavailable", "breaker_trips")


#: The longest time a `RedisStore` argument may name, in seconds (one day). Sockets refuse
#: infinite or enormous timeouts (`OverflowError` past the platform's `time_t`, `ValueError`
#: for NaN) only when first used, inside every call; a bound checked at construction names the
#: argument instead, and no sane timeout or back-off is longer.
MAX_SECONDS = 86400.0


def _seconds(name: str, value) -> float:
    """`value` as float seconds when it is a real number in `(0, MAX_SECONDS]` (NaN, infinities
    and bools refused); else `ValueError` naming `name`."""
    try:
        seconds = float(value) if isinstance(value, numbers.Real) else math.nan
    except OverflowError:  # an int past the floats
        seconds = math.inf
    if isinstance(value, bool) or not 0 < seconds <= MAX_SECONDS:  # False for NaN too
        raise ValueError(
            f"{name}: expected a finite number of seconds in (0, {MAX_SECONDS:g}], got {value!r}"
        )
    return seconds


class RedisStore(BlockStore):
    """Blocks in a Redis or Valkey server at `url`, shared by every host pointed at it.

    Args:
        url: a redis-py URL, e.g. `redis://cache-host:6379/0` (`rediss://` for TLS,
            `unix:///path/redis.sock` for a local socket).
        timeout_s: the longest one connect, send or receive may wait; a call that hits it is
            a miss (reads) or a dropped store (writes).
        key_prefix: put before every block key on the server; separates caches that share
            one database.
        retry_after_s: how long the circuit breaker stays open after the first failure.
        max_retry_after_s: the longest it stays open after repeated failures; at least
            `retry_after_s`. Default: 30 s, or `retry_after_s` when that is longer.

    Every time is a number of seconds in `(0, MAX_SECONDS]` (one day).

    Raises:
        ImportError: redis-py is not installed (extra `redis`).
        TypeError: a `url` or `key_prefix` that is not a string.
        ValueError: a malformed `url` (or one asking for decoded replies), a `url` or
            `key_prefix` UTF-8 cannot encode, a time that is not a finite number of seconds in
            `(0, MAX_SECONDS]`, or a `max_retry_after_s` below `retry_after_s`.

    `stats()` adds to the common counters: `round_trips` (to the server, for blocks),
    `dropped` (blocks not stored because the server failed or the breaker was open),
    `unavailable` (calls answered without the network while the breaker was open) and
    `breaker_trips`; `blocks` and `bytes` are the server's key count and memory in use (0
    while it is unreachable).

    Its methods never raise the server's failures, even under a strict `KVConnector`: a
    failed call is counted (`io_errors`) and answered as misses or dropped stores.

    Example:
        >>> store = RedisStore("redis://cache-host:6379/0", timeout_s=0.5)  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 1.0,
        key_prefix: str = "jaxkv:",
        retry_after_s: float = 1.0,
        max_retry_after_s: float | None = None,
    ):
        super().__init__()
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as err:
            raise ImportError(_INSTALL) from err
        self.url = text_arg("url", url)
        self.key_prefix = text_arg("key_prefix", key_prefix)
        self.timeout_s = _seconds("timeout_s", timeout_s)
        self.retry_after_s = _seconds("retry_after_s", retry_after_s)
        if max_retry_after_s is None:
            max_retry_after_s = max(30.0, self.retry_after_s)
        self.max_retry_after_s = _seconds("max_retry_after_s", max_retry_after_s)
        if self.max_retry_after_s < self.retry_after_s:
            # The breaker's wait only grows from `retry_after_s`: a smaller maximum is a typo.
            raise ValueError(
                f"max_retry_after_s: expected at least retry_after_s ({self.retry_after_s:g} "
                f"s), got {max_retry_after_s!r}"
            )
        self._counters.update(dict.fromkeys(_REMOTE_COUNTERS, 0))
        # No retries inside redis-py: a retry would double the time a dead server costs the
        # caller; the breaker decides when to try again.
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        except ValueError as err:  # redis-py's message does not say which argument
            raise ValueError(
                f"url: expected a redis://, rediss:// or unix:// URL, got {url!r} ({err})"
            ) from err
        if self._client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError(
                f"url: expected a URL without decode_responses (records are bytes), got {url!r}"
            )
        self._errors = (redis.RedisError, OSError)
        self._connection_errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        # Circuit breaker: closed while `_open_until` is 0; open (every call answered locally)
        # until then; the first call past it probes while the others still answer locally.
        self._breaker = threading.Lock()
        self._open_until = 0.0
        self._backoff = self.retry_after_s
        self._probing = False

    # ---- circuit breaker -------------------------------------------------------------------

    def _admit(self, counted: bool) -> bool:
        """Whether a call may use the network now (closed, or the one probe once open)."""
        with self._breaker:
            if not self._open_until:
                return True
            if self._probing or time.monotonic() < self._open_until:
                if counted:
                    self._count("unavailable")
                return False
            self._probing = True
            return True

    def _settle(self, ok: bool) -> None:
        with self._breaker:
            was_open, self._probing = bool(self._open_until), False
            if ok:
                self._open_until, self._backoff = 0.0, self.retry_after_s
                return
            if was_open:  # a failed probe: wait longer before the next one
                self._backoff = min(2 * self._backoff, self.max_retry_after_s)
            self._open_until = time.monotonic() + self._backoff
            self._count("breaker_trips")

    def _call(self, send, *, counted: bool = True):
        """`send(client)` once, one round trip; `None` when the breaker is open or the server
        failed (which opens the breaker). Server replies that are errors of one command (e.g.
        out of memory) are returned in place by pipelines, not raised. `counted`: a call for
        blocks, counted in `round_trips` and `unavailable` (`stats` asking sizes is not)."""
        if not self._admit(counted):
            return None
        if counted:
            self._count("round_trips")
        try:
            result = send(self._client)
        except self._errors as err:
            self._count("io_errors")
            self._failures.note("server call", err)  # logged as the other stores' failures
            # A command error (not the connection's) means the server is there: no trip.
            self._settle(not isinstance(err, self._connection_errors))
            return None
        except BaseException:
            with self._breaker:  # not the server's doing: let the next call probe
                self._probing = False
            raise
        self._settle(True)
        return result

    # ---- BlockStore ------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self.key_prefix + key

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def get(self, key: str) -> BlockRecord | None:
        return self.get_many([key])[0]

    def put(self, record: BlockRecord) -> bool:
        return self.put_many([record])[0]

    def contains_many(self, keys: Sequence[str], *, stop_at_miss: bool = False) -> list[bool]:
        if not keys:
            return []

        def send(client):
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return pipe.execute(raise_on_error=False)

        replies = self._call(send)
        if replies is None:
            return [False] * len(keys)
        held = [reply == 1 for reply in replies]
        if stop_at_miss and False in held:
            first = held.index(False)
            held[first:] = [False] * (len(held) - first)
        return held

    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False
    ) -> list[BlockRecord | None]:
        if not keys:
            return []
        values = self._call(lambda client: client.mget([self._name(k) for k in keys]))
        if values is None:
            self._count("misses", 1 if stop_at_miss else len(keys))
            return [None] * len(keys)
        records: list[BlockRecord | None] = [None] * len(keys)
        corrupt = []
        for i, (key, value) in enumerate(zip(keys, values)):
            if value is not None:
                try:
                    records[i] = _records.decode(value, key)
                except _records.CorruptRecordError:
                    corrupt.append(self._name(key))
                    self._count("verification_failures")
            if records[i] is None:
                self._count("misses")
                if stop_at_miss:
                    break
            else:
                self._count("hits")
                self._count("blocks_loaded")
                self._count("bytes_loaded", records[i].nbytes)
        if corrupt:
            # Whoever stores the block next writes a good record; `SET NX` would keep the
            # bad one forever.
            self._call(lambda client: client.delete(*corrupt))
        return records

    def put_many(self, records: Sequence[BlockRecord]) -> list[bool]:
        if not records:
            return []
        values = [_records.encode(r) for r in records]

        def send(client):
            pipe = client.pipeline(transaction=False)
            for record, value in zip(records, values):
                pipe.set(self._name(record.key), value, nx=True)
            return pipe.execute(raise_on_error=False)

        replies = self._call(send)
        if replies is None:
            self._count("dropped", len(records))
            return [False] * len(records)
        stored = []
        for record, reply in zip(records, replies):
            if isinstance(reply, Exception):  # e.g. OOM under `maxmemory` with noeviction
                self._count("rejected")
                self._count("dropped")
            elif reply:
                self._count("blocks_stored")
                self._count("bytes_stored", record.nbytes)
            stored.append(bool(reply) and not isinstance(reply, Exception))
        return stored

    # ---- size ------------------------------------------------------------------------------

    def _server_size(self) -> tuple[int, int]:
        def send(client):
            pipe = client.pipeline(transaction=False)
            pipe.dbsize()
            pipe.info("memory")
            return pipe.execute()

        replies = self._call(send, counted=False)
        if replies is None:
            return 0, 0
        return int(replies[0]), int(replies[1].get("used_memory", 0))

    def __len__(self) -> int:
        """Keys in the server's database (all of them: give the cache a database of its own),
        0 while it is unreachable."""
        return self._server_size()[0]

    @property
    def nbytes(self) -> int:
        """Memory the server uses now (`used_memory`), 0 while it is unreachable."""
        return self._server_size()[1]

    def stats(self) -> dict[str, int]:
        blocks, nbytes = self._server_size()
        with self._lock:
            return {**self._counters, "blocks": blocks, "bytes": nbytes}

    def close(self) -> None:
        """Closes the connections to the server."""
        self._client.close()
