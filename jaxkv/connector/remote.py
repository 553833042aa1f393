"""`RedisStore`: blocks in a Redis (or Valkey) server that many serving hosts share.

Each block is one string value: the same self-describing, checksummed record as a disk file
(`_records.encode`), under the key `<key_prefix><block key>`. A block key is the chained hash of
the block's tokens under the connector's namespace, layout fingerprint and salt, so hosts that
serve the same model with the same layout find each other's blocks, and nothing else.

Every call of the connector is one round trip: a pipeline of `STRLEN` for lookups, of `GET` for
loads, of `SET ... NX` for stores. `STRLEN` and `GET` rather than `EXISTS` and `MGET` because
they answer a key holding another type (a list, a hash) with an error in its place, where
`EXISTS` says the key exists and `MGET` says nil: a lookup never promises a value no read can
serve, and such a key is deleted, so the next store repairs it (`SET NX` alone would never
replace it). Every read is verified (`_records.decode`); a record
that fails is a miss and is deleted. A lookup cannot verify a checksum without reading the
whole value: it promises a non-empty string, which the load then verifies. Capacity is the
server's business: give it a `maxmemory` and the `allkeys-lru` policy, and it evicts the least
recently used blocks.

Faults never reach the serving loop. Each socket operation is bounded by `timeout_s`; a call
that fails (server down, slow, restarted) reads as misses and drops its stores, counted in
`stats()`. Every reply is checked against what Redis answers to the command sent: one that is
not (the wrong type, value or count, or bytes the parser cannot read) fails the call as a dead
server does, and its connection is closed, so that no later call reads the rest of a garbled
reply as its own answer. A circuit breaker then answers at once, without the network, for
`retry_after_s` (doubling per further failure, up to `max_retry_after_s`); the first call after
that probes the server and closes the breaker when it answers. An error the server answers to
one command (out of memory, read-only replica) is a failure of that command only.

The client speaks RESP2 unless the URL asks otherwise (`?protocol=3`): every Redis and Valkey
server and every proxy speaks it, where RESP3 needs Redis 6 or later and a `HELLO` command that
proxies may lack.

A Redis Cluster (`redis+cluster://HOST:PORT`) is the same store over several servers: each
call's per-key commands go as one pipeline to each node owning any of the keys' slots, every
node behind a breaker of its own, and a node down, a slot that moved or a failover in progress
is a miss for those keys (`_redis_cluster` routes them).
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence

from jaxkv._checks import bool_arg, text_arg
from jaxkv.connector import _records
from jaxkv.connector._records import BlockRecord
from jaxkv.connector._redis_cluster import (
    CLUSTER_SCHEMES,
    UNANSWERED,
    BadReply,
    Cluster,
    Link,
    Server,
    describe_reply,
    parse_url,
    server_fault,
)
from jaxkv.connector.stores import BatchStore, StoreResult

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


def seconds_arg(name: str, value) -> float:
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


def _count_reply(reply, at_most: int | None = None) -> int:
    """The reply of a command answering a count (`STRLEN`, `DEL`, `DBSIZE`)."""
    if (
        isinstance(reply, int)
        and not isinstance(reply, bool)
        and reply >= 0
        and (at_most is None or reply <= at_most)
    ):
        return reply
    bound = "" if at_most is None else f" and <= {at_most}"
    raise BadReply(f"expected an integer >= 0{bound}, got {describe_reply(reply)}")


def _value_reply(reply) -> bytes | None:
    """The reply of `GET`: the value's bytes, or `None` for an absent key."""
    if reply is None or isinstance(reply, bytes):
        return reply
    raise BadReply(f"GET: expected a bulk string or nil, got {describe_reply(reply)}")


def _set_reply(reply) -> bool:
    """The reply of `SET ... NX`: `True` when it stored the value, `False` when the key was
    held."""
    if reply is None:
        return False
    if reply == b"OK":
        return True
    raise BadReply(f"SET NX: expected OK or nil, got {describe_reply(reply)}")


def _info_reply(reply) -> bytes:
    if isinstance(reply, bytes):
        return reply
    raise BadReply(f"INFO: expected a bulk string, got {describe_reply(reply)}")


def _used_memory(info: bytes) -> int | None:
    """`used_memory` from the text of `INFO memory`, or `None` when it holds no such line."""
    for line in info.splitlines():
        if line.startswith(b"used_memory:"):
            digits = line[len(b"used_memory:") :].strip()
            # Bounded, and ASCII digits only: `int` also takes "1_000", " 12" or 5000 digits.
            if 0 < len(digits) <= 20 and digits.isdigit():
                return int(digits)
            return None
    return None


class Breaker:
    """A circuit breaker: closed until a call fails, then open (every call answered at once,
    without the network) for `retry_after_s`, doubling per failed probe up to
    `max_retry_after_s`; once the wait ends, the first call probes while the others still
    answer locally, and the probe's outcome closes or reopens it.

    Args:
        retry_after_s: the first wait, in seconds.
        max_retry_after_s: the longest wait.
        count: `count(name)` adds one to a store counter: `unavailable` (a call refused while
            open, when counted) and `breaker_trips` (each time it opens).
    """

    def __init__(
        self, retry_after_s: float, max_retry_after_s: float, count: Callable[[str], None]
    ):
        self.retry_after_s = retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self._count = count
        self._lock = threading.Lock()
        self._open_until = 0.0  # 0 while closed
        self._backoff = retry_after_s
        self._probing = False

    def admit(self, counted: bool = True) -> bool:
        """Whether a call may use the network now (closed, or the one probe once open)."""
        with self._lock:
            if not self._open_until:
                return True
            if self._probing or time.monotonic() < self._open_until:
                if counted:
                    self._count("unavailable")
                return False
            self._probing = True
            return True

    def settle(self, ok: bool) -> None:
        """The outcome of an admitted call: closes the breaker, or (re)opens it."""
        with self._lock:
            was_open, self._probing = bool(self._open_until), False
            if ok:
                self._open_until, self._backoff = 0.0, self.retry_after_s
                return
            if was_open:  # a failed probe: wait longer before the next one
                self._backoff = min(2 * self._backoff, self.max_retry_after_s)
            self._open_until = time.monotonic() + self._backoff
            self._count("breaker_trips")

    def abandon(self) -> None:
        """An admitted call ended by something not the server's doing: no outcome, and the
        next call may probe."""
        with self._lock:
            self._probing = False

    @property
    def closed(self) -> bool:
        return not self._open_until


def breaker_times(retry_after_s, max_retry_after_s) -> tuple[float, float]:
    """The breaker's waits, checked (see `RedisStore`): a maximum of 30 s, or `retry_after_s`
    when that is longer, unless given."""
    first = seconds_arg("retry_after_s", retry_after_s)
    if max_retry_after_s is None:
        max_retry_after_s = max(30.0, first)
    longest = seconds_arg("max_retry_after_s", max_retry_after_s)
    if longest < first:
        # The breaker's wait only grows from `retry_after_s`: a smaller maximum is a typo.
        raise ValueError(
            f"max_retry_after_s: expected at least retry_after_s ({first:g} s), got "
            f"{max_retry_after_s!r}"
        )
    return first, longest


class RedisStore(BatchStore):
    """Blocks in a Redis or Valkey server at `url`, or in a Redis Cluster, shared by every
    host pointed at it.

    Args:
        url: a redis-py URL, e.g. `redis://cache-host:6379/0` (`rediss://` for TLS,
            `unix:///path/redis.sock` for a local socket), or a Redis Cluster's:
            `redis+cluster://HOST:PORT` naming one node (the others are discovered; more
            startup nodes with `?nodes=HOST:PORT;HOST:PORT`; `rediss+cluster://` for TLS).
        timeout_s: the longest one connect, send or receive may wait; a call that hits it is
            a miss (reads) or a dropped store (writes).
        key_prefix: put before every block key on the server; separates caches that share
            one database. In a cluster, a hash tag in it (`{...}`) puts every block in one
            slot, on one node.
        retry_after_s: how long the circuit breaker stays open after the first failure (in a
            cluster, each node's; also the shortest time between two reads of its slot map).
        max_retry_after_s: the longest it stays open after repeated failures; at least
            `retry_after_s`. Default: 30 s, or `retry_after_s` when that is longer.

    Every time is a number of seconds in `(0, MAX_SECONDS]` (one day).

    Raises:
        ImportError: redis-py is not installed (extra `redis`).
        TypeError: a `url` or `key_prefix` that is not a string.
        ValueError: a malformed `url` (or one asking for decoded replies), a `url` or
            `key_prefix` UTF-8 cannot encode, a time that is not a finite number of seconds in
            `(0, MAX_SECONDS]`, or a `max_retry_after_s` below `retry_after_s`.

    `stats()` adds to the common counters: `round_trips` (to a server, for blocks: one per
    node in a cluster), `dropped` (blocks not stored because the server failed or the
    breaker was open), `unavailable` (calls answered without the network while the breaker
    was open), `breaker_trips`, and for a cluster `moved` (keys answered `MOVED` or `ASK`:
    misses); `blocks` and `bytes` are the server's key count and memory in use (summed over
    the masters that answer; 0 while none does). `verification_failures` counts the records
    found damaged and the keys found holding another type than a string; each is deleted from
    the server.

    Its methods never raise the server's failures, even under a strict `KVConnector`: a
    failed call (the server down, slow, or answering what Redis never answers) is counted
    (`io_errors`), logged, and answered as misses or dropped stores.

    Example:
        >>> store = RedisStore("redis://cache-host:6379/0", timeout_s=0.5)  # doctest: +SKIP
        >>> shared = RedisStore("redis+cluster://cache-1:7000")  # doctest: +SKIP
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
        self.timeout_s = seconds_arg("timeout_s", timeout_s)
        self.retry_after_s, self.max_retry_after_s = breaker_times(retry_after_s, max_retry_after_s)
        self._counters.update(dict.fromkeys(_REMOTE_COUNTERS, 0))
        self._error_reply = redis.ResponseError
        self._oom = getattr(redis.exceptions, "OutOfMemoryError", ())

        def link_to(node_url: str) -> Link:
            # No retries inside redis-py: a retry would double the time a dead server costs
            # the caller; the breaker decides when to try again. RESP2 unless the URL says
            # otherwise (see the module docstring).
            try:
                pool = redis.ConnectionPool.from_url(
                    node_url,
                    socket_timeout=self.timeout_s,
                    socket_connect_timeout=self.timeout_s,
                    retry=Retry(NoBackoff(), 0),
                    protocol=2,
                )
            except ValueError as err:  # redis-py's message does not say which argument
                raise ValueError(
                    f"url: expected a redis://, rediss://, unix:// or redis+cluster:// URL, "
                    f"got {url!r} ({err})"
                ) from err
            if pool.connection_kwargs.get("decode_responses"):
                raise ValueError(
                    f"url: expected a URL without decode_responses (records are bytes), got {url!r}"
                )
            breaker = Breaker(self.retry_after_s, self.max_retry_after_s, self._count)
            return Link(pool, breaker, redis.exceptions, self._count, self._failures.note)

        self._route: Server | Cluster
        if self.url.startswith(CLUSTER_SCHEMES):
            self._counters["moved"] = 0
            startup, node_url = parse_url(self.url)
            self._route = Cluster(
                startup,
                lambda address: link_to(node_url(address)),
                redis.exceptions,
                self._count,
                self._failures.note,
                self.retry_after_s,
            )
        else:
            self._route = Server(link_to(self.url))

    # ---- round trips -----------------------------------------------------------------------

    def _send(self, commands: list[tuple], check: Callable) -> list:
        """Per command, its reply passed through `check`, an error reply in place, or
        `UNANSWERED` (see `_redis_cluster`): one round trip per server."""
        return self._route.each(commands, check)

    def _failed_command(self, err: Exception) -> None:
        """An error the server answered to a command: the command failed, the server is up."""
        self._count("io_errors")
        self._failures.note("server command", err)

    def _is_wrong_type(self, reply) -> bool:
        return isinstance(reply, self._error_reply) and str(reply).startswith("WRONGTYPE")

    def _remove_damaged(self, damaged: list[tuple[str, str]]) -> None:
        """Deletes values found damaged or of another type, counted in
        `verification_failures`: whoever stores the block next writes a good record, which
        `SET NX` would never do over them. One more round trip, only when any was found."""
        if not damaged:
            return
        names = [name for name, _ in damaged]
        self._count("verification_failures", len(names))
        replies = self._send([("DEL", n) for n in names], lambda r: _count_reply(r, at_most=1))
        failure = next((r for r in replies if isinstance(r, self._error_reply)), None)
        if failure is not None:
            self._failed_command(failure)
        for name, why in damaged:
            self._dropped([name[len(self.key_prefix) :]], "damaged", why)

    # ---- BlockStore ------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self.key_prefix + key

    # Each batch is one round trip per server. `strict` is checked and otherwise unused: the
    # servers' failures are answered as misses and dropped writes (see the class), never listed.

    def contains_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """Per key, whether the server holds a non-empty string under it (see `BlockStore`).

        A key holding another type is not held, and is deleted; the checksum of a held value
        is verified only when it is read."""
        self._strictness(strict)
        return StoreResult(self._contains(keys, bool_arg("stop_at_miss", stop_at_miss)))

    def _contains(self, keys: Sequence[str], stop_at_miss: bool) -> list[bool]:
        names = [self._name(k) for k in keys]
        lengths = self._send([("STRLEN", n) for n in names], _count_reply)
        held = [False] * len(keys)
        damaged, failure = [], None
        for i, (name, length) in enumerate(zip(names, lengths)):
            if self._is_wrong_type(length):
                damaged.append((name, "holds another type than a string"))
            elif isinstance(length, self._error_reply):
                failure = failure or length
            elif length is not UNANSWERED:
                held[i] = length > 0
            if stop_at_miss and not held[i]:
                break  # the rest was not asked for
        if failure is not None:
            self._failed_command(failure)
        self._remove_damaged(damaged)
        return held

    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[BlockRecord | None]]:
        self._strictness(strict)
        return StoreResult(self._get(keys, bool_arg("stop_at_miss", stop_at_miss)))

    def _get(self, keys: Sequence[str], stop_at_miss: bool) -> list[BlockRecord | None]:
        names = [self._name(k) for k in keys]
        # Per-key GETs, not one MGET: MGET answers nil for a key of another type, which would
        # read as absent while STRLEN, SET NX and the server's memory say otherwise.
        values = self._send([("GET", n) for n in names], _value_reply)
        records: list[BlockRecord | None] = [None] * len(keys)
        damaged, failure = [], None
        for i, (key, name, value) in enumerate(zip(keys, names, values)):
            if self._is_wrong_type(value):
                damaged.append((name, "holds another type than a string"))
            elif isinstance(value, self._error_reply):
                failure = failure or value
            elif value is not None and value is not UNANSWERED:
                try:
                    records[i] = _records.decode(value, key)
                except Exception as err:  # any bytes may come: none that fail are served
                    if not server_fault(err):
                        raise
                    damaged.append((name, f"failed verification ({err})"))
            record = records[i]
            if record is None:
                self._count("misses")
                if stop_at_miss:
                    break
            else:
                self._count("hits")
                self._count("blocks_loaded")
                self._count("bytes_loaded", record.nbytes)
        if failure is not None:
            self._failed_command(failure)
        self._remove_damaged(damaged)
        return records

    def put_many(
        self, records: Sequence[BlockRecord], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        self._strictness(strict)
        return StoreResult(self._put(records))

    def _put(self, records: Sequence[BlockRecord]) -> list[bool]:
        commands = [("SET", self._name(r.key), _records.encode(r), "NX") for r in records]
        replies = self._send(commands, _set_reply)
        stored, failure = [], None
        for record, reply in zip(records, replies):
            if isinstance(reply, bool):
                if reply:
                    self._count("blocks_stored")
                    self._count("bytes_stored", record.nbytes)
                stored.append(reply)
                continue
            if isinstance(reply, self._oom) or str(reply).startswith("OOM"):
                self._count("rejected")  # full under `maxmemory` with noeviction
            elif reply is not UNANSWERED:
                failure = failure or reply  # an error reply, e.g. of a read-only replica
            self._count("dropped")
            stored.append(False)
        if failure is not None:
            self._failed_command(failure)
        return stored

    def discard_many(
        self, keys: Sequence[str], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """Deletes the value under each key (see `BlockStore.discard`); `False` where there
        was none or the server failed (counted in `io_errors`, never raised)."""
        self._strictness(strict)
        replies = self._send(
            [("DEL", self._name(k)) for k in keys], lambda r: _count_reply(r, at_most=1)
        )
        removed = [False] * len(keys)
        failure = None
        for i, reply in enumerate(replies):
            if isinstance(reply, self._error_reply):
                failure = failure or reply
            elif reply is not UNANSWERED and reply:
                removed[i] = True
        if failure is not None:
            self._failed_command(failure)
        gone = [k for k, r in zip(keys, removed) if r]
        self._count("discarded", len(gone))
        self._dropped(gone, "discarded")
        return StoreResult(removed)

    # ---- size ------------------------------------------------------------------------------

    def _server_size(self) -> tuple[int, int]:
        """Keys and `used_memory`, summed over the servers that answer."""
        error_reply = self._error_reply

        def parse(replies):
            keys, info = replies
            return [
                keys if isinstance(keys, error_reply) else _count_reply(keys),
                info if isinstance(info, error_reply) else _info_reply(info),
            ]

        total_keys = total_used = 0
        for link in self._route.masters():
            replies = link.call([("DBSIZE",), ("INFO", "memory")], parse, counted=False)
            if replies is None:
                continue
            failure = next((r for r in replies if isinstance(r, error_reply)), None)
            if failure is not None:
                self._failed_command(failure)
                continue
            keys, info = replies
            used = _used_memory(info)
            if used is None:  # a server (or proxy) that does not report it: a failed command
                self._failed_command(BadReply("INFO memory: expected a used_memory line"))
                continue
            total_keys, total_used = total_keys + keys, total_used + used
        return total_keys, total_used

    def __len__(self) -> int:
        """Keys in the server's database (all of them: give the cache a database of its own;
        in a cluster, the masters' keys), 0 while it is unreachable."""
        return self._server_size()[0]

    @property
    def nbytes(self) -> int:
        """Memory the server uses now (`used_memory`; in a cluster, the masters' sum), 0 while
        it is unreachable."""
        return self._server_size()[1]

    def stats(self) -> dict[str, int]:
        blocks, nbytes = self._server_size()
        with self._lock:
            return {**self._counters, "blocks": blocks, "bytes": nbytes}

    def close(self) -> None:
        """Closes the connections to the servers."""
        self._route.close()
