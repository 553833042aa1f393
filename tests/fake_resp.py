"""A scriptable RESP2 server on loopback, for testing `RedisStore` against replies no real
server gives.

`FakeRedis` is a small in-memory Redis (the commands `RedisStore` and redis-py's handshake
send: GET, MGET, SET [NX], STRLEN, EXISTS, DEL, TYPE, RPUSH, DBSIZE, INFO, PING, SELECT, CLIENT),
listening on `127.0.0.1:<ephemeral port>`, one thread per connection. A test sets
`server.script`: a function of each command (a list of bytes, the name upper-cased) that
returns `None` to let the server answer as Redis would, or a `Reply` (raw bytes sent as they
are, then optionally a late tail, a hang or a close). The encoders below build every RESP2
type; anything else (truncations, garbage, non-numeric integers) is written as raw bytes.

The server is bounded in time: every socket wait polls a stop flag, `close()` stops it, and
it stops by itself after `lifetime_s` whatever the test does.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable

CRLF = b"\r\n"
NULL_BULK = b"$-1\r\n"
NULL_ARRAY = b"*-1\r\n"
WRONGTYPE = b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
OOM = b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"


def simple(text: str | bytes) -> bytes:
    """A simple string reply (`+...`)."""
    return b"+" + _b(text) + CRLF


def error(text: str | bytes) -> bytes:
    """An error reply (`-...`)."""
    return b"-" + _b(text) + CRLF


def integer(n: int | str | bytes) -> bytes:
    """An integer reply; `n` may be any text, for non-numeric integers (`:abc`)."""
    return b":" + _b(str(n) if isinstance(n, int) else n) + CRLF


def bulk(data: bytes) -> bytes:
    """A bulk string reply of `data`."""
    return b"$" + str(len(data)).encode() + CRLF + data + CRLF


def array(*items: bytes) -> bytes:
    """An array reply of already encoded items (nest `array(...)` for nested arrays)."""
    return b"*" + str(len(items)).encode() + CRLF + b"".join(items)


def _b(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


@dataclasses.dataclass(frozen=True)
class Reply:
    """What the server sends for one command.

    Attributes:
        data: bytes sent at once, as they are (any RESP, or not RESP at all).
        later: bytes sent `delay` seconds after `data` (a tail that arrives late).
        delay: seconds before `later`.
        close: close the connection after sending (a truncation, a server that hung up).
        hang: after sending, answer nothing more on this connection (the client times out).
    """

    data: bytes = b""
    later: bytes = b""
    delay: float = 0.0
    close: bool = False
    hang: bool = False


Script = Callable[[list[bytes]], "Reply | bytes | None"]

_POLL_S = 0.02


class FakeRedis:
    """The server; use it as a context manager (or `start()` / `close()`).

    Attributes:
        data: the keyspace: key -> bytes (a string value) or list of bytes (a list value).
        script: the per-command override, or `None` to behave as Redis.
        oom: answer every SET with an out-of-memory error (a full server under `noeviction`).
        commands: every command received, in order (for assertions on what was sent).
        url: `redis://127.0.0.1:<port>/0`.
    """

    def __init__(self, lifetime_s: float = 300.0):
        self.data: dict[bytes, bytes | list[bytes]] = {}
        self.script: Script | None = None
        self.oom = False
        self.commands: list[list[bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._deadline = time.monotonic() + lifetime_s
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(_POLL_S)
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"

    # ---- life ------------------------------------------------------------------------------

    def start(self) -> FakeRedis:
        self._spawn(self._accept_loop)
        return self

    def close(self) -> None:
        self._stop.set()
        for thread in list(self._threads):
            thread.join(timeout=5)
        self._listener.close()

    def __enter__(self) -> FakeRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _running(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self._deadline

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while self._running():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(_POLL_S)
            # As Redis does: replies go out at once. With Nagle's algorithm the second reply of
            # a pipeline waits for the client's delayed ACK of the first (tens of milliseconds
            # per pipelined call, on loopback too).
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve, conn)

    # ---- one connection --------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while self._running():
                parsed = _parse_command(buf)
                if parsed is None:
                    try:
                        chunk = conn.recv(65536)
                    except TimeoutError:
                        continue
                    if not chunk:
                        return
                    buf += chunk
                    continue
                args, buf = parsed
                args = [args[0].upper(), *args[1:]] if args else args
                with self._lock:
                    self.commands.append(args)
                    script = self.script
                    reply = script(args) if script is not None else None
                    if reply is None:
                        reply = self._answer(args)
                if isinstance(reply, bytes):
                    reply = Reply(reply)
                conn.sendall(reply.data)
                if reply.later:
                    self._sleep(reply.delay)
                    conn.sendall(reply.later)
                if reply.close:
                    return
                if reply.hang:
                    self._drain(conn)
                    return
        except OSError:  # the client hung up first
            return
        finally:
            conn.close()

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self._running() and time.monotonic() < end:
            time.sleep(min(_POLL_S, max(0.0, end - time.monotonic())))

    def _drain(self, conn: socket.socket) -> None:
        """Reads and ignores everything until the client closes or the server stops."""
        while self._running():
            try:
                if not conn.recv(65536):
                    return
            except TimeoutError:
                continue

    # ---- Redis, as far as the store and redis-py's handshake need it -----------------------

    def _answer(self, args: list[bytes]) -> bytes:
        if not args:
            return error("ERR empty command")
        name, rest = args[0], args[1:]
        data = self.data
        if name in (b"GET", b"STRLEN", b"TYPE") and len(rest) == 1:
            value = data.get(rest[0])
            if name == b"TYPE":
                kind = "none" if value is None else "string" if isinstance(value, bytes) else "list"
                return simple(kind)
            if isinstance(value, list):
                return WRONGTYPE
            if name == b"GET":
                return NULL_BULK if value is None else bulk(value)
            return integer(0 if value is None else len(value))
        if name == b"SET" and len(rest) >= 2:
            if self.oom:
                return OOM
            options = {o.upper() for o in rest[2:]}
            if b"NX" in options and rest[0] in data:
                return NULL_BULK
            data[rest[0]] = rest[1]
            return simple("OK")
        if name == b"RPUSH" and len(rest) >= 2:
            value = data.setdefault(rest[0], [])
            if not isinstance(value, list):
                return WRONGTYPE
            value.extend(rest[1:])
            return integer(len(value))
        if name == b"MGET":
            values = [data.get(key) for key in rest]
            return array(*(bulk(v) if isinstance(v, bytes) else NULL_BULK for v in values))
        if name == b"EXISTS":
            return integer(sum(key in data for key in rest))
        if name == b"DEL":
            return integer(sum(data.pop(key, None) is not None for key in rest))
        if name == b"DBSIZE":
            return integer(len(data))
        if name == b"INFO":
            used = sum(len(v) if isinstance(v, bytes) else sum(map(len, v)) for v in data.values())
            return bulk(f"# Memory\r\nused_memory:{1000 + used}\r\nused_memory_peak:0\r\n".encode())
        if name == b"PING":
            return simple("PONG")
        if name in (b"SELECT", b"CLIENT"):
            return simple("OK")
        return error(f"ERR unknown command '{name.decode(errors='replace')}'")


def _parse_command(buf: bytes) -> tuple[list[bytes], bytes] | None:
    """One command (a RESP array of bulk strings) off the front of `buf`, and the rest; `None`
    while it is incomplete. redis-py sends nothing else."""
    if not buf:
        return None
    if buf[:1] != b"*":
        end = buf.find(CRLF)  # an inline command (`PING\r\n`)
        return None if end < 0 else (buf[:end].split(), buf[end + 2 :])
    end = buf.find(CRLF)
    if end < 0:
        return None
    count, pos, args = int(buf[1:end]), end + 2, []
    for _ in range(count):
        end = buf.find(CRLF, pos)
        if end < 0:
            return None
        size = int(buf[pos + 1 : end])
        start = end + 2
        if len(buf) < start + size + 2:
            return None
        args.append(buf[start : start + size])
        pos = start + size + 2
    return args, buf[pos:]
