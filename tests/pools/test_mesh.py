"""Pools over 8 devices and two processes (tests/mesh_checks.py does the work in fresh
interpreters: the device count is fixed when jax starts)."""

import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from helpers import REPO, python_env
from mesh_checks import pool_sized_collectives

SCRIPT = str(REPO / "tests" / "mesh_checks.py")


def _start(*args: str) -> subprocess.Popen:
    # Output goes to files, not pipes: a child is never blocked on a pipe nobody reads while
    # `_finish` watches its peers.
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, *args],
        cwd=REPO,
        env=python_env(),
        stdout=out,
        stderr=err,
        text=True,
    )
    proc.logs = (out, err)
    return proc


def _read(f) -> str:
    f.seek(0)
    text = f.read()
    f.close()
    return text


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Waits for every process. As soon as one fails (or the deadline passes) the others are
    killed, not left waiting on a dead peer, and the test fails with each one's exit status
    and output tail. Returns their stdouts."""
    deadline = time.monotonic() + timeout
    late = False
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            late = time.monotonic() > deadline
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    outs = [(p.wait(), _read(p.logs[0]), _read(p.logs[1])) for p in procs]
    if late or any(rc != 0 for rc, _, _ in outs):
        report = "\n".join(
            f"process {i}: exit {rc}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}"
            for i, (rc, out, err) in enumerate(outs)
        )
        pytest.fail((f"(killed after {timeout} s)\n" if late else "") + report)
    return [out for _, out, _ in outs]


@pytest.mark.slow  # fresh 8-device interpreters
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


@pytest.mark.slow  # fresh 8-device interpreters
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
