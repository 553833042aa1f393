"""How a `RedisStore` reaches its servers: a `Link` to each (its connections, its circuit
breaker, one round trip), and a route that sends each key's command over the right link: the
one server (`Server`), or the node of a Redis Cluster that owns the key's slot (`Cluster`).

A route answers per command, in order: the server's reply, an error reply in place (an
instance of redis-py's `ResponseError`: the server is there, the command failed), or
`UNANSWERED` when the command got no answer (its server failed, its breaker was open, or, in
a cluster, its slot had moved). The store reads `UNANSWERED` as a miss or a dropped write.

In a cluster every node has a link, with a breaker of its own: a node down is a miss for the
keys of its slots while the other nodes answer. The slot map comes from `CLUSTER SLOTS`, asked
of the first node that answers (known masters first, then the startup nodes); it is asked
again after a `MOVED` or `ASK` reply, or a call that a node failed (a failover moves its slots
to a replica), at most once per `refresh_s`. A `MOVED` or `ASK` reply is counted in `moved`
and is a miss: the store never follows a redirection within a call, so a slot that is moving
costs misses until the map is refreshed, never a wrong answer.
"""

from __future__ import annotations

import binascii
import contextlib
import functools
import inspect
import math
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxkv.connector.remote import Breaker

# The slots of a Redis Cluster.
SLOTS = 16384
_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
CLUSTER_SCHEMES = tuple(f"{scheme}://" for scheme in _SCHEMES)


class BadReply(Exception):
    """A reply no Redis server gives to the command that was sent."""


class Unanswered:
    """The answer of a command that got none (see the module docstring)."""

    def __repr__(self) -> str:
        return "UNANSWERED"


UNANSWERED = Unanswered()


def describe_reply(reply) -> str:
    """What a reply is, for a log line: its type and size, never its bytes."""
    if isinstance(reply, (bytes, bytearray, str)):
        return f"{type(reply).__name__} of length {len(reply)}"
    if isinstance(reply, (list, tuple, set, dict)):
        return f"{type(reply).__name__} of {len(reply)} items"
    if isinstance(reply, int) and not isinstance(reply, bool) and abs(reply) < 10**12:
        return f"int {reply}"
    return type(reply).__name__


def server_fault(err: BaseException) -> bool:
    """Whether an exception raised while talking to a server is the server's doing (any
    `Exception` of redis-py, its parser or the socket), rather than this process's
    (`KeyboardInterrupt`, `SystemExit`, `MemoryError`), which must propagate."""
    return isinstance(err, Exception) and not isinstance(err, MemoryError)


# ---- one server ----------------------------------------------------------------------------


class Link:
    """One Redis server: its connection pool, its circuit breaker and one round trip.

    Args:
        pool: redis-py's `ConnectionPool` for the server.
        breaker: the server's `remote.Breaker`.
        errors: redis-py's module of exceptions.
        count: `count(name)` adds one to a store counter (`round_trips`, `io_errors`).
        note: `note(kind, err)` logs a failure (the store's `FailureLog.note`).
    """

    def __init__(self, pool, breaker: Breaker, errors, count, note):
        self.pool = pool
        self.breaker = breaker
        self.error_reply = errors.ResponseError
        self._take = _connection_taker(pool)
        self._connection_errors = (errors.ConnectionError, errors.TimeoutError, OSError)
        self._count = count
        self._note = note

    def call(self, commands: Sequence[tuple], parse: Callable[[list], list], *, counted=True):
        """Sends `commands` (argument tuples) in one write on one connection, reads one reply
        per command and returns `parse(replies)`; `None` when the breaker is open or the call
        failed. `counted`: a call for blocks, counted in `round_trips` and `unavailable`
        (asking sizes or slots is not).

        An error the server answers to one command stays in place in `replies`: the stream
        is in step and the server is there, so the caller decides what it means for that key.
        `parse` raises `BadReply` for a reply no Redis server gives to the command.

        Any other failure fails the whole call: counted in `io_errors`, logged per class,
        and it opens the breaker. That covers the connection's failures (refused, reset,
        timed out) and the reply's: bytes redis-py's parser cannot read (its `InvalidResponse`,
        a `ValueError` of a non-numeric integer, a `RecursionError` of absurdly nested
        arrays...) and replies `parse` refuses. A server that answers garbage once is not to be
        trusted with the next call either (a wrong service on the port, a broken proxy): it
        is treated as down, and the probe after the breaker's wait finds out whether it
        recovered. The connection of a failed call is closed before it goes back to the pool:
        the rest of a garbled or cut reply may still arrive on it, and the next call must not
        read it as its own answer.

        Exceptions that are not the server's doing (`KeyboardInterrupt`, `MemoryError`)
        propagate, after the same cleanup.
        """
        if not self.breaker.admit(counted):
            return None
        if counted:
            self._count("round_trips")
        conn, in_step = None, False
        try:
            conn = self._take()
            conn.send_packed_command(conn.pack_commands(commands))
            replies = [self._read(conn) for _ in commands]
            result = parse(replies)
            in_step = True
        except BaseException as err:
            if not server_fault(err):
                self.breaker.abandon()  # not the server's doing: let the next call probe
                raise
            kind = "server call" if isinstance(err, self._connection_errors) else "server reply"
            self._count("io_errors")
            self._note(kind, err)
            self.breaker.settle(False)
            return None
        finally:
            if conn is not None:
                if not in_step:
                    with contextlib.suppress(Exception):
                        conn.disconnect()
                self.pool.release(conn)
        self.breaker.settle(True)
        return result

    def _read(self, conn):
        """One reply; an error reply is returned in place (redis-py raises it once read)."""
        try:
            return conn.read_response()
        except self.error_reply as err:
            return err

    def each(self, check: Callable) -> Callable[[list], list]:
        """A `parse` applying `check` to every reply that is not an error reply."""
        error_reply = self.error_reply
        return lambda replies: [r if isinstance(r, error_reply) else check(r) for r in replies]

    def close(self) -> None:
        self.pool.disconnect()


def _connection_taker(pool) -> Callable:
    """`pool.get_connection` as a function of no arguments: redis-py before 5.3 requires a
    command name (any one), later versions deprecate passing it."""
    try:
        param = inspect.signature(pool.get_connection).parameters.get("command_name")
    except (TypeError, ValueError):
        param = None
    if param is not None and param.default is inspect.Parameter.empty:
        return lambda: pool.get_connection("GET")
    return pool.get_connection


class Server:
    """The route to a single server: every command goes over its one link."""

    def __init__(self, link: Link):
        self.link = link

    def each(self, commands: Sequence[tuple], check: Callable, *, counted=True) -> list:
        """Per command, its checked reply, an error reply, or `UNANSWERED` (one round trip)."""
        if not commands:
            return []
        replies = self.link.call(commands, self.link.each(check), counted=counted)
        return [UNANSWERED] * len(commands) if replies is None else replies

    def masters(self) -> list[Link]:
        """The links whose servers hold the store's keys."""
        return [self.link]

    def close(self) -> None:
        self.link.close()


# ---- a cluster -----------------------------------------------------------------------------

Address = tuple[str, int]


def parse_url(url: str) -> tuple[list[Address], Callable[[Address], str]]:
    """The startup nodes of a `redis+cluster://` (or `rediss+cluster://`) URL, and the redis-py
    URL of any node: the same scheme without `+cluster`, credentials and options, database 0.

    `redis+cluster://[USER:PASSWORD@]HOST:PORT[/0][?nodes=HOST:PORT;HOST:PORT&OPTION=...]`:
    the host names one startup node; `nodes` adds more (semicolons: commas separate tiers in
    store specs); other options are redis-py's, as for one server.

    Raises:
        ValueError: naming `url`, for a URL of another form.
    """
    parts = urllib.parse.urlsplit(url)
    scheme = _SCHEMES.get(parts.scheme)
    if scheme is None:
        raise ValueError(f"url: expected a redis+cluster:// or rediss+cluster:// URL, got {url!r}")
    if parts.path not in ("", "/", "/0") or parts.fragment:
        raise ValueError(
            f"url: expected a cluster URL with no database but 0 (a cluster has one), got {url!r}"
        )
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    extra = [value for name, value in query if name == "nodes"]
    options = urllib.parse.urlencode([(n, v) for n, v in query if n != "nodes"])
    startup = [_address(parts.netloc.rpartition("@")[2], url)]
    for listed in extra:
        startup += [_address(node.strip(), url) for node in listed.split(";") if node.strip()]
    credentials = parts.netloc.rpartition("@")[0]
    userinfo = credentials + "@" if credentials else ""

    def node_url(address: Address) -> str:
        host, port = address
        host = f"[{host}]" if ":" in host else host
        return f"{scheme}://{userinfo}{host}:{port}/0" + (f"?{options}" if options else "")

    return list(dict.fromkeys(startup)), node_url


def _address(text: str, url: str) -> Address:
    """`HOST:PORT` (`[V6]:PORT`) as a pair; else `ValueError` naming `url`."""
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"url: expected nodes as HOST:PORT, got {text!r} in {url!r}")
    return host, int(port)


def slot_map(reply, asked: Address) -> list[Address | None]:
    """The owner of every slot from a `CLUSTER SLOTS` reply (`None` where no master is
    named); `asked` stands for a master named by an empty host (the node asked). Raises
    `BadReply` for a reply of another shape."""
    if not isinstance(reply, list):
        raise BadReply(f"CLUSTER SLOTS: expected an array, got {describe_reply(reply)}")
    owners: list[Address | None] = [None] * SLOTS
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3:
            raise BadReply(
                f"CLUSTER SLOTS: expected [start, end, master...], got {describe_reply(entry)}"
            )
        start, end, master = entry[:3]
        if not (_is_int(start) and _is_int(end) and 0 <= start <= end < SLOTS):
            raise BadReply(f"CLUSTER SLOTS: expected a slot range, got {start!r:.40}..{end!r:.40}")
        if not isinstance(master, list) or len(master) < 2:
            raise BadReply(
                f"CLUSTER SLOTS: expected [host, port, ...], got {describe_reply(master)}"
            )
        host, port = master[:2]
        if not isinstance(host, bytes) or not _is_int(port) or not 0 < port < 65536:
            raise BadReply(
                f"CLUSTER SLOTS: expected a host and a port, got {describe_reply(master)}"
            )
        if host == b"?":  # Redis knows no endpoint for it: its slots stay unanswered
            continue
        owner = (host.decode("utf-8", "replace") or asked[0], port) if host else asked
        owners[start : end + 1] = [owner] * (end - start + 1)
    return owners


def key_slot(name: str) -> int:
    """The slot of a key: CRC16 (XMODEM) of its UTF-8 bytes, or of its hash tag (the text
    between the first `{` and the next `}`, when not empty), modulo the slots."""
    key = name.encode()
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % SLOTS


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Cluster:
    """The route to a Redis Cluster: per node, a pipeline of the commands of the keys whose
    slots it owns (see the module docstring).

    Args:
        startup: the nodes first asked for the slot map.
        link_to: `link_to(address)` makes the link of a node (its own pool and breaker).
        errors: redis-py's module of exceptions.
        count: `count(name)` adds one to a store counter (`moved`, `io_errors`,
            `unavailable`).
        note: `note(kind, err)` logs a failure (a node answering an error to `CLUSTER SLOTS`).
        refresh_s: the shortest time between two refreshes of the slot map.
    """

    def __init__(
        self,
        startup: Sequence[Address],
        link_to: Callable[[Address], Link],
        errors,
        count: Callable[[str], None],
        note: Callable[[str, BaseException], None],
        refresh_s: float,
    ):
        self._startup = list(startup)
        self._link_to = link_to
        self._links: dict[Address, Link] = {address: link_to(address) for address in startup}
        self._redirect = errors.AskError  # MOVED's class is a subclass
        self._count = count
        self._note = note
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._owners: list[Address | None] = [None] * SLOTS
        self._stale = True
        self._refreshed_at = -math.inf

    def _link(self, address: Address) -> Link:
        with self._lock:
            link = self._links.get(address)
            if link is None:
                link = self._links[address] = self._link_to(address)
            return link

    def _refresh(self) -> None:
        """Asks for the slot map when it is stale and `refresh_s` has passed since the last
        time it was asked for."""
        with self._lock:
            now = time.monotonic()
            if not self._stale or now - self._refreshed_at < self._refresh_s:
                return
            self._refreshed_at = now
            known = [a for a in dict.fromkeys(self._owners) if a is not None]
        for address in dict.fromkeys(known + self._startup):
            link = self._link(address)
            check = functools.partial(slot_map, asked=address)
            replies = link.call([("CLUSTER", "SLOTS")], link.each(check), counted=False)
            if replies is None:
                continue
            if isinstance(replies[0], link.error_reply):  # e.g. a server not in cluster mode
                self._count("io_errors")
                self._note("slot map", replies[0])
                continue
            with self._lock:
                self._owners, self._stale = replies[0], False
            return

    def each(self, commands: Sequence[tuple], check: Callable, *, counted=True) -> list:
        """Per command (whose second argument is its key), its checked reply, an error reply,
        or `UNANSWERED`: one pipeline per node owning any of the keys."""
        if not commands:
            return []
        self._refresh()
        with self._lock:
            owners = self._owners
        by_node: dict[Address | None, list[int]] = {}
        for i, command in enumerate(commands):
            by_node.setdefault(owners[key_slot(command[1])], []).append(i)
        answers: list[Any] = [UNANSWERED] * len(commands)
        failed = None in by_node  # slots no known master owns: answered without the network
        if failed and counted:
            self._count("unavailable")
        for address, indices in by_node.items():
            if address is None:
                continue
            link = self._link(address)
            replies = link.call([commands[i] for i in indices], link.each(check), counted=counted)
            if replies is None:
                failed = True
                continue
            for i, reply in zip(indices, replies):
                if isinstance(reply, self._redirect):
                    self._count("moved")
                    failed = True
                else:
                    answers[i] = reply
        if failed:
            with self._lock:
                self._stale = True
        return answers

    def masters(self) -> list[Link]:
        """The links of the nodes that own slots (after a refresh when the map is stale)."""
        self._refresh()
        with self._lock:
            owners = [a for a in dict.fromkeys(self._owners) if a is not None]
        return [self._link(a) for a in owners]

    def close(self) -> None:
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.close()
