"""A throwaway `redis-server` on a free loopback port, for the tests (`from redis_server import
LocalRedis, MISSING`, as the tests import helpers.py's); the bench takes a server's URL.

Nothing is persisted (`--save ''`, `--appendonly no`) and the server lives in a temporary
folder; `stop` kills it, `start` again brings it back on the same port (empty), as a restarted
cache server would come back.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

MISSING = "redis-server is not installed (e.g. `apt-get install redis-server`)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedis:
    """A `redis-server` child process on `127.0.0.1:<free port>`.

    Args:
        *args: further server options, e.g. `"--maxmemory", "64mb"`.

    Raises:
        FileNotFoundError: `redis-server` is not on the PATH.
    """

    def __init__(self, *args: str):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError(MISSING)
        self.args = args
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="jaxkv-redis-")
        self._proc: subprocess.Popen | None = None

    @staticmethod
    def available() -> bool:
        """Whether `redis-server` is on the PATH."""
        return shutil.which("redis-server") is not None

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        """Starts the server and waits until it answers `PING`."""
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not _pong(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Kills the server (SIGKILL: no clean shutdown, as a crash) and waits for it."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
