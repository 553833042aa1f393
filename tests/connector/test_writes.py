"""KVConnector.store_async / flush / close: snapshot first, write in the background, never a
torn or missing-but-promised block."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import raw_rows

import jaxkv
from jaxkv import testing
from jaxkv.connector import HostStore, KVConnector

TOKENS = np.arange(64) % 7 + 3
SLOTS = np.arange(1, 65)


class GatedStore(HostStore):
    """A HostStore whose block writes wait at a gate until the test lets them through, to hold
    blocks in flight for as long as a test needs (no timing assumptions). `writing` is set when
    a write reaches the gate; `allow(n)` lets `n` more writes through."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.gate = threading.Semaphore(0)
        self.writing = threading.Event()

    def allow(self, n=1 << 20):
        self.gate.release(n)

    def put(self, record):
        self.writing.set()
        assert self.gate.acquire(timeout=60), "the test never let this write through"
        return super().put(record)


class Arrivals:
    """Wraps a method of an object: counts the calls that reached it, so a test can wait until
    another thread is inside (blocked in) that call."""

    def __init__(self, obj, name, monkeypatch):
        self.count = 0
        self.cond = threading.Condition()
        inner = getattr(obj, name)

        def counted(*args, **kwargs):
            with self.cond:
                self.count += 1
                self.cond.notify_all()
            return inner(*args, **kwargs)

        monkeypatch.setattr(obj, name, counted)

    def wait_for(self, n):
        with self.cond:
            assert self.cond.wait_for(lambda: self.count >= n, timeout=60), (self.count, n)


def _in_thread(fn):
    """Runs `fn` in a thread; returns the thread and a dict that gets its result."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", fn()), daemon=True)
    thread.start()
    return thread, out


class FailingStore(HostStore):
    def put(self, record):
        raise OSError("disk gone")


def _pool(seed=0):
    pool = jaxkv.MHAPool.create(size=256, head_num=2, head_dim=8, layer_num=2)
    rng = np.random.default_rng(seed)
    for layer in range(2):
        k, v = rng.standard_normal((2, 64, 2, 8)).astype(np.float32)
        pool = pool.set_kv(layer, SLOTS, k, v)
    return pool


def test_store_async_returns_the_written_count_and_blocks_load_bit_exact():
    pool = _pool()
    want = raw_rows(pool, SLOTS)
    with KVConnector(pool, HostStore(1 << 22)) as conn:
        future = conn.store_async(pool, TOKENS, SLOTS)
        assert future.result(timeout=30) == 4
        assert conn.store_async(pool, TOKENS, SLOTS).result(timeout=30) == 0  # all present
        pool, n = conn.load(pool, TOKENS, SLOTS + 100)
    assert n == 64
    for got, ref in zip(raw_rows(pool, SLOTS + 100), want):
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("pinned", [False, True], ids=["cpu", "pinned"])
def test_snapshot_is_taken_before_return_so_the_pool_can_be_donated_at_once(pinned):
    # pinned: the accelerator path, run on CPU (the snapshot is a segment in pinned memory).
    pool = _pool()
    want = raw_rows(pool, SLOTS)
    store = GatedStore(1 << 22)  # nothing reaches the store until the pool has been overwritten
    conn = KVConnector(pool, store, transfer="pinned" if pinned else None)
    pointers = testing.buffer_pointers(pool)
    future = conn.store_async(pool, TOKENS, SLOTS)
    step = jax.jit(lambda p, loc, k: p.set_kv(0, loc, k, k), donate_argnums=0)
    pool = step(pool, jnp.asarray(SLOTS), jnp.zeros((64, 2, 8), jnp.bfloat16))
    testing.assert_updated_in_place(pointers, pool)  # no live export held a buffer
    store.allow()
    assert future.result(timeout=30) == 4
    pool, n = conn.load(pool, TOKENS, SLOTS + 100)
    assert n == 64
    for got, ref in zip(raw_rows(pool, SLOTS + 100), want):  # the snapshot, not the zeros
        np.testing.assert_array_equal(got, ref)
    held = store.get(conn.block_hashes(TOKENS)[0])
    # Kept as the transfer's output (the pinned path, always taken on accelerators) or copied.
    assert (held.source is not None) == (pinned or jax.default_backend() != "cpu")
    conn.close()


def test_lookup_counts_and_load_waits_for_blocks_in_flight(monkeypatch):
    pool = _pool()
    want = raw_rows(pool, SLOTS)
    store = GatedStore(1 << 22)
    conn = KVConnector(pool, store)
    future = conn.store_async(pool, TOKENS, SLOTS)
    assert store.writing.wait(timeout=60) and not future.done()  # held at the gate
    assert conn.lookup(TOKENS) == 64  # promised: being written
    assert conn.stats()["pending_blocks"] == 4
    # The load starts while the first block is still held, so it must wait instead of missing.
    waits = Arrivals(conn._writes, "wait_for", monkeypatch)
    loader, out = _in_thread(lambda: conn.load(pool, TOKENS, SLOTS + 100))
    waits.wait_for(1)
    assert loader.is_alive() and not future.done()
    store.allow()
    loader.join(timeout=60)
    pool, n = out["result"]
    assert n == 64 and future.done()
    for got, ref in zip(raw_rows(pool, SLOTS + 100), want):
        np.testing.assert_array_equal(got, ref)
    conn.close()
    assert conn.stats()["pending_blocks"] == 0


def test_flush_waits_for_every_pending_write_and_max_pending_bounds_the_queue(monkeypatch):
    pool = _pool()
    store = GatedStore(1 << 22)
    conn = KVConnector(pool, store, max_pending=1)
    rooms = Arrivals(conn._writes._room, "acquire", monkeypatch)
    first = conn.store_async(pool, TOKENS, SLOTS)
    # The second call waits for room behind `first`, held at the gate: it returns only after
    # all of `first`'s 4 blocks are written (its own stay held).
    caller, out = _in_thread(
        lambda: (conn.store_async(pool, TOKENS + 1, SLOTS), store.stats()["blocks_stored"])
    )
    rooms.wait_for(2)
    assert caller.is_alive() and not first.done()
    store.allow(4)
    caller.join(timeout=60)
    second, stored_when_it_returned = out["result"]
    assert stored_when_it_returned == 4 and not second.done()
    store.allow(4)
    conn.flush()
    assert first.done() and second.done() and first.result() == second.result() == 4
    assert store.stats()["blocks_stored"] == 8
    conn.close()


def test_a_failing_write_reaches_the_future_and_clears_the_pending_blocks():
    pool = _pool()
    conn = KVConnector(pool, FailingStore(1 << 22), strict=True)
    future = conn.store_async(pool, TOKENS, SLOTS)
    with pytest.raises(OSError, match="disk gone"):
        future.result(timeout=30)
    conn.close()  # does not raise: the error belongs to the future
    assert conn.stats()["pending_blocks"] == 0
    assert conn.lookup(TOKENS) == 0


def test_flush_raises_a_pending_write_error():
    pool = _pool()
    store = FailingStore(1 << 22)
    conn = KVConnector(pool, store, strict=True)
    conn.store_async(pool, TOKENS, SLOTS)
    with pytest.raises(OSError, match="disk gone"):
        conn.flush()
    conn.close()


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="per-layer staging of snapshots above 32 MiB is the CPU mechanism (fresh glibc mmaps "
    "fault in every page); accelerators snapshot into pinned segments, tested on the pinned path",
)
@pytest.mark.parametrize("use_async", [False, True])
def test_large_snapshots_stage_per_layer_and_round_trip_bit_exact(use_async):
    pool = jaxkv.NSAPool.create(
        size=256,
        page_size=16,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        index_head_dim=16,
        layer_num=3,
    )
    rng = np.random.default_rng(5)
    for layer in range(3):
        pool = pool.set_kv(layer, SLOTS, rng.standard_normal((64, 1, 40)), None)
        pool = pool.set_index_k(layer, SLOTS, rng.standard_normal((64, 16)))
    want_kv = [np.asarray(b)[SLOTS] for b in pool.kv_buffer]
    want_index = [np.asarray(pool.get_index_k(layer, SLOTS)) for layer in range(3)]
    conn = KVConnector(pool, HostStore(1 << 24))
    assert conn.transfer_path.name == "gather"  # NSA's index pages are not token-major
    conn.transfer_path.stack_above_bytes = 0  # take the per-layer path at any size
    if use_async:
        assert conn.store_async(pool, TOKENS, SLOTS).result(timeout=30) == 4
    else:
        assert conn.store(pool, TOKENS, SLOTS) == 4
    assert conn.transfer_path.staging.idle_bytes > 0  # the staging went back for reuse
    pool, n = conn.load(pool, TOKENS, SLOTS + 100)
    assert n == 64
    for layer in range(3):
        np.testing.assert_array_equal(
            np.asarray(pool.kv_buffer[layer])[SLOTS + 100], want_kv[layer]
        )
        np.testing.assert_array_equal(
            np.asarray(pool.get_index_k(layer, SLOTS + 100)), want_index[layer]
        )
    conn.close()
