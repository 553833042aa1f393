"""A throwaway Mooncake cluster on loopback ports, for the tests (`from mooncake_server import
LocalMooncake, MISSING`, as the tests import helpers.py's) and the bench.

`mooncake_master` runs with its embedded HTTP metadata server; `holder(...)` adds a standalone
`mooncake_client` that mounts a segment of host memory and holds it (what outlives a serving
process). Nothing is persisted: `stop` kills the master (SIGKILL, as a crash), `start` again
brings it back on the same ports, empty; holders mount their segments again by themselves.
A client whose heartbeats stop is dropped after `client_ttl_s` (the master's default is 10 s).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

MISSING = (
    "Mooncake is not installed (`pip install 'jaxkv[mooncake]'`; its binaries need the RDMA "
    "user libraries: `apt-get install libibverbs1 librdmacm1`)"
)


def binary(name: str) -> str | None:
    """Where Mooncake's program `name` is: in its Python package (the wheel ships its
    binaries there), else on the PATH."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as answer:
            return answer.read().decode()
    except OSError:
        return None


class Holder:
    """A `mooncake_client` process mounting `segment_bytes` of host memory."""

    def __init__(self, cluster: LocalMooncake, segment_bytes: int):
        self.cluster, self.segment_bytes = cluster, segment_bytes
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> Holder:
        before = self.cluster.segments()
        self._proc = subprocess.Popen(
            [
                self.cluster.client_binary,
                f"--global_segment_size={self.segment_bytes}",
                f"--master_server_address={self.cluster.master}",
                f"--metadata_server={self.cluster.metadata}",
                "--host=127.0.0.1",
                f"--port={_free_port()}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while len(self.cluster.segments()) <= len(before):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("mooncake_client did not mount its segment")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Kills the holder (SIGKILL): its segment's objects cannot be read from then on."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


class LocalMooncake:
    """`mooncake_master` on free loopback ports, its HTTP metadata server included.

    Args:
        *args: further master options, e.g. `"--default_kv_lease_ttl=100"`.
        client_ttl_s: seconds after a client's last heartbeat before its segment is dropped.

    Attributes:
        master: `127.0.0.1:PORT` of the master (`MooncakeStore`'s first argument).
        metadata: the metadata server's URL (its `metadata`).
        spec: the cluster as a store spec (`mooncake://...`, sglang-jax's tier).

    Raises:
        FileNotFoundError: Mooncake's binaries are not installed.
    """

    def __init__(self, *args: str, client_ttl_s: int = 2):
        master, client = binary("mooncake_master"), binary("mooncake_client")
        if master is None or client is None:
            raise FileNotFoundError(MISSING)
        self.master_binary, self.client_binary = master, client
        self.args = args
        self.client_ttl_s = client_ttl_s
        self.rpc_port, self.http_port, self.metrics_port = (_free_port() for _ in range(3))
        self.master = f"127.0.0.1:{self.rpc_port}"
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        self.spec = f"mooncake://{self.master}?metadata={self.metadata}"
        self._proc: subprocess.Popen | None = None
        self.holders: list[Holder] = []

    @staticmethod
    def available() -> bool:
        """Whether Mooncake's binaries are installed (and its client importable)."""
        found = binary("mooncake_master") and binary("mooncake_client")
        return bool(found) and importlib.util.find_spec("mooncake") is not None

    def start(self, timeout_s: float = 20.0) -> LocalMooncake:
        """Starts the master and waits until it serves."""
        self._proc = subprocess.Popen(
            [
                self.master_binary,
                f"--rpc_port={self.rpc_port}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
                f"--metrics_port={self.metrics_port}",
                "--metrics_host=127.0.0.1",
                f"--client_ttl={self.client_ttl_s}",
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while '"service_ready":true' not in (self._admin("health") or ""):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start on port {self.rpc_port}")
            time.sleep(0.05)
        return self

    def _admin(self, path: str) -> str | None:
        return _get(f"http://127.0.0.1:{self.metrics_port}/{path}")

    def segments(self) -> list[str]:
        """The names of the segments mounted now (as the master's admin server lists them)."""
        return (self._admin("get_all_segments") or "").split()

    def keys(self) -> list[str]:
        """Every object key the master knows."""
        return (self._admin("get_all_keys") or "").split()

    def holder(self, segment_bytes: int = 256 << 20) -> Holder:
        """Starts a standalone holder of a segment of `segment_bytes` (at least 16 MiB)."""
        holder = Holder(self, segment_bytes)
        self.holders.append(holder)  # stopped with the cluster, even if it fails to start
        return holder.start()

    def stop(self) -> None:
        """Kills the master (SIGKILL, as a crash) and waits for it."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def client(self, buffer_bytes: int = 16 << 20):
        """Mooncake's own client on this master, set up (no segment of its own; a buffer of
        `buffer_bytes` for its `put` and `get` of bytes)."""
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        code = client.setup("127.0.0.1", self.metadata, 0, buffer_bytes, "tcp", "", self.master)
        if code != 0:
            raise RuntimeError(f"Mooncake's client setup failed ({code})")
        return client

    def store(self, **kwargs):
        """A `MooncakeStore` on this master."""
        from jaxkv.connector import MooncakeStore

        return MooncakeStore(self.master, metadata=self.metadata, **kwargs)

    def close(self) -> None:
        for holder in self.holders:
            holder.stop()
        self.stop()

    def __enter__(self) -> LocalMooncake:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
