"""What every store does through the `BlockStore` interface: concurrent stores and loads through
one connector, flags checked rather than taken from truthiness, and `discard`'s default for a
store that cannot remove records.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from helpers import STORE_BLOCK_SIZE, assert_rows, block_key, random_mha_pool, raw_rows, token_seq

from jaxkv import MHAPool
from jaxkv.connector import BlockStore, DiskStore, HostStore, KVConnector, TieredStore

BS = STORE_BLOCK_SIZE  # the blocks of token_seq

# --------------------------------------------------------------------------------------------
# Thread safety (both stores, through one connector)


@pytest.fixture(params=("host", "disk"))
def any_store(request, tmp_path):
    return HostStore(1 << 20) if request.param == "host" else DiskStore(tmp_path / "kv")


def test_concurrent_store_and_load_through_one_connector(any_store):
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the threads as much as possible
    try:
        _concurrent_store_and_load(any_store)
    finally:
        sys.setswitchinterval(switch)


def _concurrent_store_and_load(store):
    n_threads, rounds = 4, 3
    src = random_mha_pool(size=128, layer_num=2)
    conn = KVConnector(src, store)
    src_slots = np.arange(1, 65)
    want = raw_rows(src, src_slots)
    shared = np.arange(64) + 777_000  # every thread stores and loads this one too
    start = threading.Barrier(n_threads)
    written, loaded, errors = [], [], []
    lock = threading.Lock()

    def worker(t: int):
        try:
            rng = np.random.default_rng(t)
            dst = MHAPool.create(size=128, dtype=np.float32, head_num=1, head_dim=2, layer_num=2)
            start.wait()
            for r in range(rounds):
                own = token_seq(10 * t + r, blocks=4)
                for tokens in (shared, own):
                    w = conn.store(src, tokens, src_slots)
                    dst_slots = rng.permutation(np.arange(1, 129))[:64]
                    dst, n = conn.load(dst, tokens, dst_slots)
                    assert n == 64
                    assert_rows(dst, dst_slots, want)
                    with lock:
                        written.append(w)
                        loaded.append(n // BS)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    distinct = 4 * (1 + n_threads * rounds)
    st = conn.stats()
    assert sum(written) == distinct == st["blocks_stored"]
    assert sum(loaded) == st["blocks_loaded"] == 4 * 2 * n_threads * rounds
    ss = store.stats()
    assert ss["blocks"] == ss["blocks_stored"] == distinct
    assert ss["hits"] == ss["blocks_loaded"] == st["blocks_loaded"]
    assert ss["verification_failures"] == ss["io_errors"] == ss["evictions"] == 0
    block_bytes = 2 * BS * (2 + 2) * 4  # layers * tokens * (K + V floats) * 4 bytes
    assert st["bytes_stored"] == ss["bytes_stored"] == distinct * block_bytes


# --------------------------------------------------------------------------------------------
# Flags and arguments are checked, never taken from truthiness


@pytest.mark.parametrize("bad", ["no", "yes", 0, 1, None, [False]])
def test_store_flags_must_be_bools(tmp_path, bad):
    for name in ("strict", "fsync"):
        with pytest.raises(TypeError, match=name):
            DiskStore(tmp_path / "d", **{name: bad})
    disk, host = DiskStore(tmp_path / "d"), HostStore(1 << 20, preallocate_bytes=0)
    stack = TieredStore(host, disk)
    for store, name in ((disk, "strict"), (disk, "fsync"), (host, "strict"), (stack, "strict")):
        with pytest.raises(TypeError, match=name):
            setattr(store, name, bad)
        assert getattr(store, name) is False  # unchanged
    for store in (host, stack):
        for call in (store.contains_many, store.get_many):
            with pytest.raises(TypeError, match="stop_at_miss"):
                call([block_key(1)], stop_at_miss=bad)


# --------------------------------------------------------------------------------------------
# discard: the default of a store that cannot remove records


def test_a_store_without_discard_counts_the_call():
    class Minimal(BlockStore):
        def contains(self, key):
            return False

        def get(self, key):
            return None

        def put(self, record):
            return False

        def __len__(self):
            return 0

    store = Minimal()
    assert store.discard(block_key(1)) is False
    assert store.stats()["undiscarded"] == 1 and store.stats()["discarded"] == 0
