"""A process writing (and reading) `DiskStore` records, for tests/connector/test_disk_processes.py.

Run as a script it loads only the store modules (numpy, no JAX: the stores and the record
format import none), so that a test can start it many times in a few seconds:

    python tests/_disk_worker.py FOLDER CAPACITY FIRST COUNT NBYTES PUTS

writes records FIRST..FIRST+COUNT-1 round-robin (PUTS of them, or forever when PUTS is 0),
reading a random record of `[0, 2 * COUNT)` after each write and checking that it is either
absent or exactly the record written; prints "ready" once the store is open and a JSON line
of the store's counters (and `bad`, the wrong reads) at the end.

    python tests/_disk_worker.py --fork FOLDER FIRST COUNT NBYTES

serves many short-lived writers cheaply: on each "spawn CAPACITY" line read from stdin it forks
a child that opens the store with that capacity (0: none), writes one record (from a random
one on), prints "ready PID" and writes on forever (until the test kills it); on "reap PID" it
waits for that child, so that its pid is free and its temporary files count as stale.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import sys
import types

if "jaxkv" not in sys.modules:  # a script: skip jaxkv/__init__ (and its JAX import)
    _REPO = pathlib.Path(__file__).resolve().parents[1]
    for _name in ("jaxkv", "jaxkv.connector"):
        _mod = types.ModuleType(_name)
        _mod.__path__ = [str(_REPO.joinpath(*_name.split(".")))]
        sys.modules[_name] = _mod

import numpy as np  # noqa: E402

from jaxkv.connector._records import BlockRecord  # noqa: E402
from jaxkv.connector.disk import DiskStore  # noqa: E402


def key(i: int) -> str:
    return hashlib.sha256(f"block-{i}".encode()).hexdigest()


@functools.cache  # made once: a writer's time goes to writing
def record(i: int, nbytes: int) -> BlockRecord:
    """Record number `i`: its key, layout, token fingerprint and bytes all derive from `i`."""
    data = np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8).reshape(2, -1)
    return BlockRecord(key(i), "test-layout", f"tokens-{i}", {"k": data})


def same(got: BlockRecord | None, i: int, nbytes: int) -> bool:
    """`got` is absent or exactly record `i`."""
    if got is None:
        return True
    want = record(i, nbytes)
    return (got.key, got.layout, got.tokens, set(got.parts)) == (
        want.key,
        want.layout,
        want.tokens,
        {"k"},
    ) and np.array_equal(got.parts["k"], want.parts["k"])


def main(folder: str, capacity: int, first: int, count: int, nbytes: int, puts: int) -> None:
    store = DiskStore(folder, capacity_bytes=capacity or None)
    rng = np.random.default_rng()
    print("ready", flush=True)
    bad, n = 0, 0
    while puts == 0 or n < puts:
        store.put(record(first + n % count, nbytes))
        j = int(rng.integers(0, 2 * count))
        bad += not same(store.get(key(j)), j, nbytes)
        n += 1
    print(json.dumps({**store.stats(), "bad": bad}), flush=True)


def forker(folder: str, first: int, count: int, nbytes: int) -> None:
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "spawn":
            if os.fork() == 0:  # the child: a fresh writer, killed by the test
                try:
                    store = DiskStore(folder, capacity_bytes=int(cmd[1]) or None)
                    n = int(np.random.default_rng().integers(count))  # not always 0, 1, ...
                    store.put(record(first + n % count, nbytes))
                    # Ready once it has written: on a busy machine a writer killed a few
                    # milliseconds after its start might not have reached a write at all.
                    print(f"ready {os.getpid()}", flush=True)
                    while True:
                        n += 1
                        store.put(record(first + n % count, nbytes))
                finally:
                    os._exit(1)
        elif cmd[0] == "reap":
            os.waitpid(int(cmd[1]), 0)
            print("reaped", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--fork":
        forker(sys.argv[2], *map(int, sys.argv[3:]))
    else:
        main(sys.argv[1], *map(int, sys.argv[2:]))
