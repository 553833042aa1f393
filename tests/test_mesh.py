"""Pools over 8 devices and two processes (tests/mesh_checks.py does the work in fresh
interpreters: the device count is fixed when jax starts)."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from mesh_checks import pool_sized_collectives  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(Path(__file__).parent / "mesh_checks.py")


def _env() -> dict:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, SCRIPT, *args],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Waits for every process; on a timeout or a failure kills the rest and fails the test
    with each one's exit status and output tail. Returns their stdouts."""
    outs, failed = [], False
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, err = proc.communicate()
            err += f"\n(killed after {timeout} s)"
        outs.append((proc.returncode, out, err))
        failed = failed or proc.returncode != 0
        if failed:  # a peer waiting on a dead process would only time out
            for other in procs:
                if other.poll() is None:
                    other.kill()
    if failed:
        report = "\n".join(
            f"process {i}: exit {rc}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}"
            for i, (rc, out, err) in enumerate(outs)
        )
        pytest.fail(report)
    return [out for _, out, _ in outs]


def test_every_pool_kind_on_8_devices_matches_one_device(tmp_path):
    (out,) = _finish([_start("single", str(tmp_path / "hlo"))], timeout=300)
    assert out.strip().endswith("ok")
    # Every module XLA compiled (eager and jitted updates, connector kernels) is free of
    # pool-sized collectives.
    modules = list((tmp_path / "hlo").glob("*after_optimizations.txt"))
    assert any("scatter" in m.read_text() for m in modules)
    for module in modules:
        assert not pool_sized_collectives(module.read_text()), module.name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_store_and_reload_a_prefix_shard_by_shard(tmp_path):
    folder = str(tmp_path / "store")
    for phase in ("store", "load"):
        port = str(_free_port())
        procs = [_start("worker", str(pid), port, folder, phase) for pid in (0, 1)]
        outs = _finish(procs, timeout=240)  # a loaded machine; a healthy pair takes ~10 s
        # gloo prints its own lines too, possibly after ours
        assert all(f"ok {pid}" in out.splitlines() for pid, out in enumerate(outs)), (phase, outs)
    # Each process wrote its own shards: 4 blocks x 8 head shards, one file each.
    assert sum(len(files) for _, _, files in os.walk(folder)) >= 32
