"""The L3 tier under sglang-jax's HiCache stays reliable (`jaxkv.integrations.sglang_jax`).

A block the store no longer holds is written again by the next backup and served from the
store again, whatever dropped it: the store's own eviction, a damaged record, a `discard`,
another process (a read finds it missing) or the reader refusing a wrong record. Settings are
range-checked, ASCII and spaced the same way for every kind. `--jaxkv-check` proves the store
works end to end (write, read back, remove) and prints why it does not. The tier's counters
reach the `jaxkv` logger at most once per interval, when they changed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sgl_jax
import sgljax_pools as sp
import sgljax_trees as st
from sgl_jax.srt.mem_cache.base_prefix_cache import MatchPrefixParams

from jaxkv import testing
from jaxkv.connector import BlockStore, DiskStore, HostStore, StoreResult
from jaxkv.integrations.sglang_jax import _store_settings, _store_sides, serve, storage

HERE = Path(__file__).resolve().parent
PATIENT = 30.0
CONFIG = st.CONFIGS["mha-bf16-p4"]


@pytest.fixture
def trees(monkeypatch):
    """Trees built over a store object (closed after the test). A prompt's prefetch may be
    asked again at once: these tests serve one prompt several times within seconds."""
    monkeypatch.setattr(_store_sides, "_RECHECK_S", 0.0)
    built: list[st.Tree] = []

    def build(store: BlockStore, rng) -> st.Tree:
        t = st.build(CONFIG, rng, store=store, tier={"wait_s": PATIENT})
        built.append(t)
        return t

    yield build
    for t in built:
        t.tree.jaxkv.close()


def _prompt(rng, n: int = 40) -> np.ndarray:
    return rng.integers(0, 50_000, size=n)


def _cached(t: st.Tree, tokens) -> np.ndarray:
    """Caches `tokens` (a request computed them) and backs them up to the store; the tree is
    left empty. Returns the rows the store was handed."""
    want = st.rows(t, st.insert(t, tokens))
    st.evict_everything(t)
    return want


def _served(t: st.Tree, tokens) -> np.ndarray:
    """The rows of the prefix served for `tokens`, which must be all of it, from the store."""
    before = t.tree.jaxkv.stats()["loaded_tokens"]
    prefix, _ = st.serve(t, tokens)
    assert len(prefix) == len(tokens), f"served {len(prefix)} of {len(tokens)} tokens"
    assert t.tree.jaxkv.stats()["loaded_tokens"] - before == len(tokens)
    rows = st.rows(t, prefix)
    st.evict_everything(t)
    return rows


def _not_served(t: st.Tree, tokens) -> None:
    prefix, _ = st.serve(t, tokens)
    assert len(prefix) == 0
    assert st.balanced(t)


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kvb"))


def _keys(t: st.Tree, tokens) -> list[str]:
    """The store keys of `tokens`' blocks, in order (a pool on one device: one per block)."""
    return [key for (key,) in t.tree.jaxkv.writer.block_keys(tokens)]


# ---- A: a block the store dropped is written again ---------------------------------------


def test_a_block_the_store_evicted_is_written_again(trees, rng):
    # Room for about 16 blocks; each prompt is 10. Three more prompts evict all of the first's.
    block = CONFIG.layer_num * CONFIG.page_size * np.prod(sp.buffer_shape(CONFIG)[2:]) * 2
    store = HostStore(int(16 * block), preallocate_bytes=0)
    evicted: list[str] = []
    store.on_drop(lambda key, reason: evicted.append(key) if reason == "evicted" else None)
    t = trees(store, rng)
    tokens = _prompt(rng)
    _cached(t, tokens)
    for _ in range(3):
        _cached(t, _prompt(rng))
    keys = _keys(t, tokens)
    assert set(keys) <= set(evicted) and not any(store.contains_many(keys).values)

    # Nothing read the store since: only the eviction itself can say the blocks are gone.
    want = _cached(t, tokens)  # recomputed at other device slots: other rows

    np.testing.assert_array_equal(_served(t, tokens), want)


def test_a_damaged_record_is_written_again(trees, rng, tmp_path):
    store = DiskStore(tmp_path)
    t = trees(store, rng)
    tokens = _prompt(rng)
    old = _cached(t, tokens)
    file = tmp_path / _keys(t, tokens)[0][:2] / f"{_keys(t, tokens)[0]}.kvb"
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF  # the payload: the checksum fails on the read, which removes the file
    file.write_bytes(bytes(data))

    _not_served(t, tokens)  # the first block is damaged: nothing after it loads
    assert not file.exists()
    new = _cached(t, tokens)

    assert file.exists()
    served = _served(t, tokens)
    np.testing.assert_array_equal(served[:, :4], new[:, :4])  # written again
    np.testing.assert_array_equal(served[:, 4:], old[:, 4:])  # held all along


def test_a_discarded_record_is_written_again(trees, rng, tmp_path):
    store = DiskStore(tmp_path)
    t = trees(store, rng)
    tokens = _prompt(rng)
    _cached(t, tokens)
    for file in _files(tmp_path):
        assert store.discard(file.name.removesuffix(".kvb"))
    assert not _files(tmp_path)

    want = _cached(t, tokens)  # no read in between: the discard itself is heard

    np.testing.assert_array_equal(_served(t, tokens), want)


def test_a_record_another_process_removed_is_written_again(trees, rng, tmp_path):
    store = DiskStore(tmp_path)
    t = trees(store, rng)
    tokens = _prompt(rng)
    _cached(t, tokens)
    for file in _files(tmp_path):
        file.unlink()  # as another process sharing the folder evicts: no listener hears it

    _not_served(t, tokens)  # the prefetch finds the first block missing
    want = _cached(t, tokens)

    np.testing.assert_array_equal(_served(t, tokens), want)


class RefusedOnce(BlockStore):
    """`inner`, answering its first read with a record of other tokens (the reader refuses
    it), and removing records on `discard` without telling its own listeners: as a store
    whose drops no listener hears."""

    def __init__(self, inner: BlockStore):
        super().__init__()
        self.inner = inner
        self.lied = False

    def contains(self, key):
        return self.inner.contains(key)

    def get(self, key):
        return self.get_many([key]).values[0]

    def get_many(self, keys, *, stop_at_miss=False, strict=None):
        got = self.inner.get_many(keys, stop_at_miss=stop_at_miss, strict=strict).values
        if got and got[0] is not None and not self.lied:
            self.lied = True
            got[0] = dataclasses.replace(got[0], tokens=bytes(len(got[0].tokens)))
        return StoreResult(got)

    def put(self, record):
        return self.inner.put(record)

    def discard(self, key):
        return self.inner.discard(key)

    def __len__(self) -> int:
        return len(self.inner)


def test_a_record_the_reader_refused_is_written_again(trees, rng):
    inner = HostStore(1 << 24)
    t = trees(RefusedOnce(inner), rng)
    tokens = _prompt(rng)
    old = _cached(t, tokens)

    _not_served(t, tokens)  # the first block's record names other tokens: discarded
    assert t.tree.jaxkv.stats()["reader"]["verification_failures"] >= 1
    deadline = time.monotonic() + 10
    while len(inner) == len(tokens) // 4 and time.monotonic() < deadline:
        time.sleep(0.01)  # the store's discard runs in the background
    assert len(inner) < len(tokens) // 4
    want = _cached(t, tokens)

    served = _served(t, tokens)
    np.testing.assert_array_equal(served[:, :4], want[:, :4])  # the refused block, written again
    np.testing.assert_array_equal(served[:, 4:], old[:, 4:])


class Listened(HostStore):
    """A HostStore that counts its drop listeners."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.listeners = 0

    def on_drop(self, listener):
        remove = super().on_drop(listener)
        self.listeners += 1
        removed = []

        def unlisten():
            if not removed:
                removed.append(True)
                self.listeners -= 1
            remove()

        return unlisten


def test_the_tier_stops_listening_when_closed(trees, rng):
    store = Listened(1 << 20)
    t = trees(store, rng)
    assert store.listeners == 1
    t.tree.jaxkv.close()
    assert store.listeners == 0


def test_a_drop_during_a_write_is_not_remembered_as_held():
    # A tiny store: writing the second record evicts the first, within the same put_many.
    record = _record("a" * 64)
    store = HostStore(record.nbytes + record.nbytes // 2, preallocate_bytes=0)
    known = _store_sides.KnownKeys(store)
    assert known.put_many([record, _record("b" * 64)]).values == [True, True]
    assert not known.contains("a" * 64) and known.contains("b" * 64)
    known.close()


def _record(key: str):
    from jaxkv.connector import BlockRecord

    parts = {"kv": np.zeros((1, 4, 256), np.uint8)}
    return BlockRecord(key=key, layout="test", tokens="t", parts=parts)


# ---- B: settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (storage.ENV_WAIT_MS, "1e13", r"WAIT_MS: expected a number of ms from 0 to 86400000"),
        (storage.ENV_WAIT_MS, "86400001", r"got '86400001'"),
        (storage.ENV_WAIT_MS, "\u0663", r"WAIT_MS: expected .* got '\u0663'"),  # Arabic 3
        (storage.ENV_WAIT_MS, "nan", r"WAIT_MS: expected"),
        (storage.ENV_PREFETCH_MB, "1e12", r"PREFETCH_MB: expected a number of MiB above 0 to"),
        (storage.ENV_STORE, "host:\u00b2", r"_STORE: expected .* got 'host:\u00b2'"),
        (storage.ENV_STORE, f"host:{1 << 60}", r"STORE: expected host:BYTES of at most"),
    ],
)
def test_out_of_range_settings_name_the_variable(variable, value, message):
    env = {storage.ENV_STORE: "disk:/x", variable: value}
    with pytest.raises(ValueError, match=message):
        storage.StoreSettings.from_env(env)


def test_the_longest_wait_is_a_day():
    env = {storage.ENV_STORE: "disk:/x", storage.ENV_WAIT_MS: "86400000"}
    assert storage.StoreSettings.from_env(env).wait_s == 86_400
    with pytest.raises(ValueError, match=r"wait_s: expected a number of seconds from 0 to 86400"):
        storage.StoreSettings(store="disk:/x", wait_s=86_401)
    with pytest.raises(ValueError, match=r"wait_s: expected .* got 10000000000000\.0"):
        storage.StoreSettings(store="disk:/x", wait_s=1e13)
    memory = _store_settings.MEMORY_BYTES
    assert storage.StoreSettings(store="disk:/x", prefetch_bytes=memory).prefetch_bytes == memory
    with pytest.raises(ValueError, match=f"prefetch_bytes: expected an int from 1 to {memory}"):
        storage.StoreSettings(store="disk:/x", prefetch_bytes=memory + 1)


def test_spaces_around_a_spec_part_are_ignored_for_every_kind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a space taken as part of a path would land here
    folder = tmp_path / "blocks"
    assert storage.open_store(f"disk: {folder}").path == str(folder)
    assert storage.open_store(f" disk : {folder} ").path == str(folder)
    assert storage.open_store("host: 1048576 ").capacity_bytes == 1 << 20
    tiers = storage.open_store(f"host : 1048576 , disk: {folder}").tiers
    assert [type(s) for s in tiers] == [HostStore, DiskStore] and tiers[1].path == str(folder)
    assert list(tmp_path.iterdir()) == [folder]
    env = {storage.ENV_STORE: f"disk: {folder}"}
    assert storage.StoreSettings.from_env(env).store == env[storage.ENV_STORE]
    with pytest.raises(ValueError, match="got 'disk:' in 'disk: '"):
        storage.open_store("disk: ")


# ---- C: the check --------------------------------------------------------------------------


def _env(**variables: str) -> dict[str, str]:
    source = str(Path(sgl_jax.__file__).resolve().parent.parent)
    paths = [source, str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    return {**env, **variables}


def _check(store: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxkv.integrations.sglang_jax.serve", *args],
        env=_env(**{storage.ENV_STORE: store}),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_check_prints_why_redis_does_not_answer():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"

    run = _check(url, "--jaxkv-check")

    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout == ""
    assert url in run.stderr and "writing the probe record" in run.stderr
    assert "Connection" in run.stderr and str(port) in run.stderr.split("it logged:")[1]


def test_the_check_fails_a_folder_it_cannot_write(tmp_path):
    # Where the probe record's subfolder goes, a plain file: every write there fails, for
    # root too (a chmod'ed folder stays writable for root).
    folder = tmp_path / "blocks"
    folder.mkdir()
    (folder / serve.PROBE_KEY[:2]).write_bytes(b"")

    run = _check(f"disk:{folder}", "--jaxkv-check")

    assert run.returncode == 1, run.stdout + run.stderr
    assert f"disk:{folder}" in run.stderr
    assert "writing the probe record failed: NotADirectoryError" in run.stderr


def test_the_check_stands_anywhere_among_the_arguments(tmp_path):
    run = _check(f"disk:{tmp_path}", "--hicache-storage", "none", "--jaxkv-check")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "works: a probe record was written, read back and removed" in run.stdout
    assert not _files(tmp_path)  # the probe removed

    run = _check(f"disk:{tmp_path}", "--jaxkv-check", "--model-path", "x")
    assert run.returncode == 1
    assert "pass --hicache-storage none" in run.stderr


def test_the_probe_proves_each_step(tmp_path):
    assert serve.probe(HostStore(1 << 20)) is None
    store = DiskStore(tmp_path)
    assert serve.probe(store) is None and len(store) == 0
    assert "did not keep it" in serve.probe(HostStore(1024))
    assert "answered another record" in serve.probe(RefusedOnce(HostStore(1 << 20)))


# ---- D: the counters reach the log -------------------------------------------------------


def test_counters_are_logged_when_changed_at_most_once_per_interval(caplog):
    caplog.set_level(logging.INFO, logger="jaxkv")
    now = [0.0]
    counters = _store_sides.TierCounters("StoreRadixCache", every_s=60, clock=lambda: now[0])

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]

    counters.count("lookups")
    now[0] = 59.0
    counters.log_changes()
    assert lines() == []
    now[0] = 60.0
    counters.log_changes()
    assert len(lines()) == 1 and "lookups=1 hits=0" in lines()[0]
    assert lines()[0].startswith("StoreRadixCache: ")
    counters.count("hits")
    now[0] = 119.0
    counters.log_changes()
    assert len(lines()) == 1
    now[0] = 120.0
    counters.log_changes()
    assert len(lines()) == 2 and "lookups=1 hits=1" in lines()[1]
    now[0] = 500.0
    counters.log_changes()  # nothing changed
    assert len(lines()) == 2


def test_the_tier_logs_its_counters_as_a_round_starts(trees, rng, caplog):
    caplog.set_level(logging.INFO, logger="jaxkv")
    t = trees(HostStore(1 << 24), rng)
    t.tree.jaxkv.counters.every_s = 0.0
    tokens = _prompt(rng)
    _cached(t, tokens)
    _served(t, tokens)
    t.tree.check_hicache_events()  # the scheduler's call as a prefill round starts

    lines = [r.getMessage() for r in caplog.records if r.name == "jaxkv"]
    last = [line for line in lines if line.startswith("StoreRadixCache: lookups=")][-1]
    assert "lookups=1 hits=1" in last and f"loaded_tokens={len(tokens)}" in last
    count = len(caplog.records)
    t.tree.check_hicache_events()
    assert len(caplog.records) == count  # no change, no line


# ---- the store's blocks reach the pool in sglang-jax's donation-safe window ---------------


def test_store_blocks_are_written_in_finish_load_back_and_held_until_then(trees, rng):
    """`init_load_back` inserts the store's blocks and holds their records; the pool is
    written only in `finish_load_back`, where the scheduler makes writing it safe, and the
    records held survive the read-ahead memory dropping its copies in between."""
    store = HostStore(1 << 24, preallocate_bytes=0)
    t = trees(store, rng)
    tokens = _prompt(rng)
    want = _cached(t, tokens)
    t.tree.check_hicache_events()
    match = t.tree.match_prefix(MatchPrefixParams(key=st.key(tokens)))
    assert len(match.device_indices) == 0 and match.host_hit_length == len(tokens)
    before = [np.array(testing.raw_bits(b)) for b in t.pool.kv_buffer]
    new, _, plan = t.tree.init_load_back(
        match.last_host_node, match.host_hit_length, mem_quota=t.allocator.available_size(0)
    )
    assert len(new) == len(tokens)
    unchanged = [np.array(testing.raw_bits(b)) for b in t.pool.kv_buffer]
    for old, now in zip(before, unchanged):
        np.testing.assert_array_equal(now, old)  # nothing written before the window
    ahead = t.tree.jaxkv.reader.backend
    held = ahead.get_many(_keys(t, tokens)).values
    for key in _keys(t, tokens):
        ahead.cache.discard(key)  # the read-ahead memory lets go of its copies
    for i, record in enumerate(held):  # and other blocks arrive, into the memory it freed
        zeros = {name: np.zeros_like(part) for name, part in record.parts.items()}
        ahead.cache.put(dataclasses.replace(record, key=f"{i:064x}", parts=zeros))
    del held, record
    t.tree.finish_load_back(plan)
    np.testing.assert_array_equal(st.rows(t, np.asarray(new)), want)
    assert t.tree.jaxkv.stats()["errors"] == 0
    assert not ahead.contains_many(_keys(t, tokens)).values[0]  # let go once written
