"""`store_async`'s background writes: one worker thread, a bounded number of calls in flight,
the keys being written and the errors raised since the last `flush`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

_CLOSED = "KVConnector is closed: make a new one to store or load blocks"


class BackgroundWrites:
    """Writes that run after the call that asked for them returned.

    A write's keys count as pending from `submit` until its future completes; its error (if
    any) is kept for `flush`; what it staged is given back when it ends, whatever the outcome.

    Args:
        max_pending: writes that may be in flight at once; a further `submit` waits for room.
    """

    def __init__(self, max_pending: int):
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {}
        self._errors: list[BaseException] = []
        self._executor: ThreadPoolExecutor | None = None
        self._room = threading.BoundedSemaphore(max_pending)
        self.closed = False

    def check_open(self) -> None:
        """`RuntimeError` once `close` ran."""
        if self.closed:
            raise RuntimeError(_CLOSED)

    def submit(
        self, keys: list[str], write: Callable[[], int], give_back: Callable[[], None]
    ) -> Future[int]:
        """Runs `write()` on the worker once there is room; `give_back()` after it ends.

        Raises:
            RuntimeError: closed, also when it closes while this call waits for room (then
                `give_back` has run).
        """
        self._room.acquire()
        with self._lock:
            if self.closed:  # closed while this call waited for room
                self._room.release()
                give_back()
                raise RuntimeError(_CLOSED)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="jaxkv-store")
            future = self._executor.submit(self._run, keys, write, give_back)
            for key in keys:
                self._pending[key] = future
        return future

    def _run(self, keys: list[str], write: Callable[[], int], give_back: Callable[[], None]):
        # Errors and pending keys are settled here, before the future completes, so `flush`
        # and a load never see a finished write as still pending or miss its error.
        try:
            return write()
        except BaseException as err:
            with self._lock:
                self._errors.append(err)
            raise
        finally:
            with self._lock:
                for key in keys:
                    self._pending.pop(key, None)
            give_back()
            self._room.release()

    def pending(self) -> set[str]:
        """The keys being written now."""
        with self._lock:
            return set(self._pending)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def wait_for(self, keys: Iterable[str]) -> None:
        """Waits for the writes of `keys` still in flight (their outcome is not the caller's:
        a failed write stays on its future and is raised by `flush`)."""
        with self._lock:
            futures = {id(f): f for f in map(self._pending.get, keys) if f is not None}
        wait(list(futures.values()))

    def flush(self) -> None:
        """Waits for every write in flight, then raises the first error since the last
        `flush` (each error also stays on its own future)."""
        with self._lock:
            futures = set(self._pending.values())
        wait(futures)
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Waits for the writes in flight and stops the worker; `submit` raises from then on."""
        with self._lock:
            self.closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
