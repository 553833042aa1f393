"""A throwaway `redis-server` on a free loopback port, and a Redis Cluster of them, for the
tests (`from redis_server import LocalRedis, LocalRedisCluster, MISSING`, as the tests import
helpers.py's) and the bench.

Nothing is persisted (`--save ''`, `--appendonly no`) and each server lives in a temporary
folder; `stop` kills it, `start` again brings it back on the same port (empty), as a restarted
cache server would come back. A cluster node keeps its `nodes.conf` there, so a restarted node
rejoins its cluster.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

MISSING = "redis-server is not installed (e.g. `apt-get install redis-server`)"
MISSING_CLI = "redis-cli is not installed (it comes with redis-server, in redis-tools)"


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


# Cluster nodes for tests: a node is judged failed after 1 s and its replica takes over however
# stale (validity factor 0); the others serve their slots meanwhile (no full coverage needed);
# replicas sync at once (no diskless delay).
_CLUSTER_NODE = (
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
    "nodes.conf",
    "--cluster-node-timeout",
    "1000",
    "--cluster-require-full-coverage",
    "no",
    "--cluster-replica-validity-factor",
    "0",
    "--repl-diskless-sync-delay",
    "0",
)


class LocalRedisCluster:
    """A Redis Cluster of `masters` masters, each with `replicas` replicas, on loopback.

    Args:
        masters: master nodes (at least 3: `redis-cli --cluster create` wants 3).
        replicas: replicas per master.

    Raises:
        FileNotFoundError: `redis-server` or `redis-cli` is not on the PATH.
    """

    def __init__(self, masters: int = 3, replicas: int = 0):
        if shutil.which("redis-cli") is None:
            raise FileNotFoundError(MISSING_CLI)
        self.replicas = replicas
        # The cluster bus gets a free port of its own (its default, the port + 10000, may be
        # taken or past 65535).
        self.nodes = [
            LocalRedis(*_CLUSTER_NODE, "--cluster-port", str(_free_port()))
            for _ in range(masters * (1 + replicas))
        ]
        self.url = f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @staticmethod
    def available() -> bool:
        """Whether `redis-server` and `redis-cli` are on the PATH."""
        return LocalRedis.available() and shutil.which("redis-cli") is not None

    def start(self, timeout_s: float = 30.0) -> LocalRedisCluster:
        """Starts every node, joins them (`redis-cli --cluster create`) and waits until every
        node sees the whole cluster up and every replica has synced."""
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                ["redis-cli", "--cluster", "create"]
                + [f"127.0.0.1:{n.port}" for n in self.nodes]
                + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=timeout_s,
            )
            self.wait_until_ok(timeout_s)
        except BaseException:
            self.close()  # no node outlives a cluster that did not come up
            raise
        return self

    def client(self, node: LocalRedis):
        import redis

        return redis.Redis(port=node.port, socket_timeout=5.0)

    def wait_until_ok(self, timeout_s: float = 30.0) -> None:
        """Waits until every running node says `cluster_state:ok` and knows a master for
        every slot, and every running replica's link to its master is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(self._ok(n) for n in self.nodes if n.pid is not None):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not come up")
            time.sleep(0.05)

    def _ok(self, node: LocalRedis) -> bool:
        import redis

        client = self.client(node)
        try:
            info = client.execute_command("CLUSTER", "INFO").decode()
            if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                return False
            replication = client.info("replication")
            return replication["role"] == "master" or replication["master_link_status"] == "up"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def owner(self, name: str) -> LocalRedis:
        """The running node that serves the slot of key `name` now (as a running node sees
        the cluster)."""
        import redis

        for node in self.nodes:
            if node.pid is None:
                continue
            client = self.client(node)
            try:
                slot = client.execute_command("CLUSTER", "KEYSLOT", name)
                for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        return next(n for n in self.nodes if n.port == master[1])
            except redis.RedisError:
                continue
            finally:
                client.close()
        raise RuntimeError(f"no running node knows the owner of {name!r}")

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
