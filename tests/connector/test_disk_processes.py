"""Processes sharing a `DiskStore` folder: a writer killed with SIGKILL at random moments leaves
only whole records (or none), and two processes writing at once keep the folder within its
capacity. The writers are `tests/_disk_worker.py`, which loads the store without JAX."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import _disk_worker as worker
import numpy as np
import pytest
from helpers import REPO

from jaxkv.connector import DiskStore
from jaxkv.connector.disk import RESCAN_SHARE

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and fork semantics")

WORKER = str(REPO / "tests" / "_disk_worker.py")


def _spawn(folder, capacity, first, count, nbytes, puts) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, WORKER, str(folder), *map(str, (capacity, first, count, nbytes, puts))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _files(folder, suffix: str) -> list[str]:
    # os.walk, not Path.rglob: the writers remove files and folders while it lists them.
    return [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(suffix)]


def _kvb_bytes(folder) -> int:
    total = 0
    for p in _files(folder, ".kvb"):
        try:
            total += os.path.getsize(p)
        except FileNotFoundError:
            pass  # evicted while listing
    return total


# Fresh interpreters killed at random moments. In one process: a write that fails before its
# rename leaves nothing (test_disk.py's failed-write test), and the temporary files of a dead
# writer are removed (its stale-temporary-files test).
@pytest.mark.slow
def test_a_writer_killed_at_random_moments_leaves_whole_records_or_none(tmp_path):
    folder, count, nbytes, kills = tmp_path / "blocks", 256, 64 << 10, 24
    rng = np.random.default_rng(0)
    torn = 0
    # One process imports numpy once and forks each writer: a kill costs a fork, not a start.
    forker = subprocess.Popen(
        [sys.executable, WORKER, "--fork", str(folder), "0", str(count), str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for k in range(kills):
            # Every other writer has a capacity, so kills also land in rescans and evictions.
            forker.stdin.write(f"spawn {(2 << 20) * (k % 2)}\n")
            forker.stdin.flush()
            word, pid = forker.stdout.readline().split()
            assert word == "ready"
            time.sleep(rng.uniform(0.0, 0.05))
            os.kill(int(pid), signal.SIGKILL)
            forker.stdin.write(f"reap {pid}\n")
            forker.stdin.flush()
            assert forker.stdout.readline().strip() == "reaped"
            torn += len(_files(folder, ".tmp"))  # left by this kill (the next open removes it)
    finally:
        forker.stdin.close()
        forker.wait(timeout=30)
    store = DiskStore(folder)
    assert not _files(folder, ".tmp")  # every writer is dead: their temporary files go
    served = 0
    for i in range(count):
        held = store.contains(worker.key(i))
        got = store.get(worker.key(i))
        assert worker.same(got, i, nbytes), f"record {i} is not what was written"
        assert held == (got is not None)
        served += got is not None
    assert served >= 4 and store.stats()["verification_failures"] == 0
    print(f"\n{kills} kills: {torn} temporary files seen, {served}/{count} records served")


def test_two_processes_share_a_folder_within_its_capacity(tmp_path):
    folder, capacity, count, nbytes, puts = tmp_path / "blocks", 1 << 20, 48, 32 << 10, 96
    procs = [_spawn(folder, capacity, w * count, count, nbytes, puts) for w in range(2)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    peak = 0
    while any(p.poll() is None for p in procs):
        peak = max(peak, _kvb_bytes(folder))
        time.sleep(0.005)
    stats = []
    for proc in procs:
        # Not communicate(): it reads the pipes' file descriptors and would miss what the
        # `readline` above already buffered (a fast worker's last line).
        proc.wait(timeout=60)
        out, err = proc.stdout.read(), proc.stderr.read()
        assert proc.returncode == 0, err
        stats.append(json.loads(out.splitlines()[-1]))
    record = os.path.getsize(_files(folder, ".kvb")[0])
    # Each process may write RESCAN_SHARE of the capacity (plus the record in flight) that
    # the other has not seen yet.
    bound = capacity + 2 * (capacity * RESCAN_SHARE + 2 * record)
    final = _kvb_bytes(folder)
    assert max(peak, final) <= bound, (peak, final, bound)
    assert final <= capacity + 2 * (capacity * RESCAN_SHARE + record)
    assert all(s["bad"] == 0 for s in stats)  # every read was exact or a miss
    assert all(s["blocks_stored"] >= count for s in stats)
    # Both processes' records are in the folder and read back exactly.
    store = DiskStore(folder, capacity_bytes=capacity)
    found = [worker.same(store.get(worker.key(i)), i, nbytes) for i in range(2 * count)]
    assert all(found) and store.nbytes == _kvb_bytes(folder)
    print(f"\nfolder peak {peak} B, final {final} B, capacity {capacity} B, bound {bound:.0f} B")
