"""Mooncake's client behind a `MooncakeStore`: set up in the background, each call run on a
worker thread and waited for at most `timeout_s`, behind a circuit breaker.

Mooncake's client does not bound its own waits: with its master gone, each call retries the
connection for about 4 s, and `setup` for about 90 s. A serving loop cannot wait that long, so
every call runs on a worker thread and the store waits for it at most `timeout_s`; past that
the call is a failure (a miss, a dropped write), the breaker opens, and the call finishes in
the background (its memory stays reserved until it does). Setup runs on a thread too: the
store answers misses until it is done, and a failed setup is tried again when the breaker lets
a probe through.

The client's answers are lists of per-key integers: a size or 0 for success, an error code
of Mooncake's (`mooncake-store`'s `ErrorCode`) otherwise. `CODES` names those the store tells
apart.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from jaxkv.connector._mooncake_buffers import Arena, Region
from jaxkv.connector._redis_cluster import server_fault
from jaxkv.connector.remote import Breaker

INSTALL = (
    "MooncakeStore needs Mooncake's client: install the extra with `pip install "
    "'jaxkv[mooncake]'` (mooncake-transfer-engine-non-cuda; on CUDA hosts install "
    "mooncake-transfer-engine instead, the same `mooncake` module)"
)

NO_SEGMENT = -101  # SEGMENT_NOT_FOUND: no segment mounted to put into
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: every segment is full
INVALID_PARAMS = -600  # also a read into a buffer smaller than the object
NOT_READY = -703  # REPLICA_IS_NOT_READY: being written
NOT_FOUND = -704  # OBJECT_NOT_FOUND
TRANSFER_FAIL = -800  # the segment holding it did not answer
RPC_FAIL, RPC_TIMEOUT = -900, -901  # the master did not answer
CODES = {
    -1: "INTERNAL_ERROR",
    NO_SEGMENT: "SEGMENT_NOT_FOUND",
    NO_SPACE: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    INVALID_PARAMS: "INVALID_PARAMS",
    NOT_READY: "REPLICA_IS_NOT_READY",
    NOT_FOUND: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}
_MASTER_GONE = (RPC_FAIL, RPC_TIMEOUT)
# Worker threads: calls run concurrently (a prefetch reads while a write goes out); a call
# that hangs holds one until the client gives up.
_THREADS = 4


class MooncakeError(OSError):
    """A failure Mooncake's client reported: its error code, or its setup failing."""


def check_reachable(what: str, address: str, timeout_s: float) -> None:
    """Raises `MooncakeError` unless a TCP connection to `address` (`HOST:PORT`) opens within
    `timeout_s`.

    The client's `setup` holds Python's lock while it retries an absent master (about 90 s):
    every thread of the process stops meanwhile. Setup is only tried once the master and the
    metadata server accept connections (a master that dies in between still costs that)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as err:
        raise MooncakeError(f"{what} {address} is not reachable ({err})") from err


def metadata_address(metadata: str) -> str | None:
    """`HOST:PORT` of an `http://` or `https://` metadata server, else None (etcd and others
    are left to the client)."""
    parts = urllib.parse.urlsplit(metadata)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def code_name(code: int) -> str:
    return f"{CODES.get(code, 'error')} ({code})"


class Connection:
    """The client, its worker threads and its breaker.

    Args:
        connect: `connect()` makes a set-up client (raising `MooncakeError` when it cannot);
            run on a thread of its own.
        arena: the registered memory; `connect` registers it.
        timeout_s: the longest the store waits for one call (or for setup, at first).
        breaker: the store's `remote.Breaker`.
        count: `count(name)` adds one to a store counter.
        note: `note(kind, err)` logs a failure.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        arena: Arena,
        timeout_s: float,
        breaker: Breaker,
        count: Callable[[str], None],
        note: Callable[[str, BaseException], None],
    ):
        self.arena = arena
        self.timeout_s = timeout_s
        self.breaker = breaker
        self._connect_fn = connect
        self._count = count
        self._note = note
        self._lock = threading.Lock()
        self._client: Any = None
        self._connecting: threading.Thread | None = None
        self._closed = False
        self._workers = concurrent.futures.ThreadPoolExecutor(
            _THREADS, thread_name_prefix="jaxkv-mooncake"
        )
        self._connect_thread().join(timeout_s)  # a store on a live cluster is ready at once

    # ---- setup -----------------------------------------------------------------------------

    def _connect_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._connect, name="jaxkv-mooncake-setup", daemon=True)
        self._connecting = thread
        thread.start()
        return thread

    def _connect(self) -> None:
        try:
            client = self._connect_fn()
        except BaseException as err:
            with self._lock:
                self._connecting = None
            if not server_fault(err):
                self.breaker.abandon()
                raise
            self._count("io_errors")
            self._note("setup", err)
            self.breaker.settle(False)
            return
        with self._lock:
            self._connecting = None
            if not self._closed:
                self._client = client
                client = None
        if client is not None:  # closed meanwhile
            _close_quietly(client)
        self.breaker.settle(True)

    @property
    def ready(self) -> bool:
        return self._client is not None

    # ---- calls -----------------------------------------------------------------------------

    def call(
        self,
        what: str,
        job: Callable[[Any], list[int]],
        regions: Sequence[Region] = (),
        *,
        counted: bool = True,
    ) -> list[int] | None:
        """`job(client)`'s answer (one int per key), or `None` when the call could not be made
        (not set up, breaker open, closed) or failed (timed out, raised, or every key's answer
        says the master is gone): counted, logged, and the breaker opens.

        `regions` are the memory `job` reads or writes: scratch regions are registered for
        the call alone, and every region stays busy until the call ends, even after it timed
        out."""
        admitted = False
        with self._lock:
            client = self._client
            if not self._closed:
                admitted = self.breaker.admit(counted)
                if admitted and client is None and self._connecting is None:
                    self._connect_thread()  # the probe is a new setup
                    admitted = False
        if not admitted or client is None:
            if admitted:
                self.breaker.abandon()
            if client is None and counted:
                self._count("unavailable")
            _release(regions)
            return None
        if counted:
            self._count("round_trips")
        try:
            future = self._workers.submit(_run, client, job, regions)
        except RuntimeError:  # closed meanwhile
            self.breaker.abandon()
            _release(regions)
            return None
        try:
            answer = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._failed(what, MooncakeError(f"no answer within {self.timeout_s:g} s"))
            return None
        except BaseException as err:
            if not server_fault(err):
                self.breaker.abandon()
                raise
            self._failed(what, err)
            return None
        if not isinstance(answer, list) or not all(isinstance(c, int) for c in answer):
            got = type(answer).__name__
            self._failed(what, MooncakeError(f"expected a list of ints, got {got}"))
            return None
        if answer and all(code in _MASTER_GONE for code in answer):
            self._failed(what, MooncakeError(f"the master did not answer: {code_name(answer[0])}"))
            return None
        self.breaker.settle(True)
        return answer

    def _failed(self, what: str, err: BaseException) -> None:
        self._count("io_errors")
        self._note(what, err)
        self.breaker.settle(False)

    def close(self) -> None:
        """Stops the calls (those running finish in the background, at most `timeout_s` is
        waited for) and closes the client: its segment, if any, is unmounted."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        self._workers.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            closer = threading.Thread(target=_close_quietly, args=(client,), daemon=True)
            closer.start()
            closer.join(max(self.timeout_s, 5.0))


def _run(client, job: Callable[[Any], list[int]], regions: Sequence[Region]) -> list[int]:
    """Runs `job` on a worker thread, with scratch regions registered around it."""
    scratch = [r for r in regions if not r.registered]
    try:
        for region in scratch:
            code = client.register_buffer(region.address, region.size)
            if code != 0:
                raise MooncakeError(f"register_buffer: {code_name(code)}")
        return job(client)
    finally:
        for region in scratch:
            client.unregister_buffer(region.address)
        _release(regions)


def _release(regions: Sequence[Region]) -> None:
    for region in regions:
        region.busy = False


def _close_quietly(client) -> None:
    try:
        client.close()
    except Exception:  # a client that cannot close cleanly is gone either way
        pass
