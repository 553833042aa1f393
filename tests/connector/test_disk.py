"""`DiskStore`: persistence across instances and processes, atomic writes, eviction, and
verification: no damaged, truncated or misplaced record file is ever loaded, only plain files
are opened and no link inside the folder is followed.

Then faults, async failures and the counters: every failure is a counted miss or dropped write
(or, with `strict=True`, an `OSError`), and what `lookup` reports is what `load` serves. Faults
are injected through `DiskStore`'s one file-operations object (`FileOps`): a full disk (ENOSPC),
a read-only or forbidden folder (EROFS, EACCES), a file that vanishes (ENOENT) and a read error
(EIO).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import stat
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    REPO,
    STORE_BLOCK_SIZE,
    assert_rows,
    block_key,
    random_mha_pool,
    raw_rows,
    record_path,
    run_python,
    small_record,
    token_seq,
)

import jaxkv.connector.disk as disk_module
from jaxkv import MHAPool
from jaxkv.connector import BlockRecord, DiskStore, HostStore, KVConnector, TieredStore
from jaxkv.connector.disk import FileOps

# The blocks of token_seq, and the connector's default block for the token pools here.
BS = STORE_BLOCK_SIZE
N_BLOCKS = 4
TOKENS = np.arange(N_BLOCKS * BS) + 7
SLOTS = np.arange(1, N_BLOCKS * BS + 1)


def _files(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
    )


# --------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------
# DiskStore: persistence, atomic writes, eviction


def test_disk_store_capacity_must_be_positive_or_none(tmp_path):
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="capacity_bytes"):
            DiskStore(tmp_path, capacity_bytes=bad)
    DiskStore(tmp_path, capacity_bytes=None)


def test_disk_store_persists_across_instances(tmp_path):
    src = random_mha_pool(size=128, layer_num=2)
    slots = np.arange(5, 69)
    tokens = token_seq(3, blocks=4)
    early = DiskStore(tmp_path)  # open before another instance writes (another process's)
    conn = KVConnector(src, DiskStore(tmp_path))
    assert conn.store(src, np.concatenate([tokens, [1, 2, 3]]), np.arange(5, 72)) == 4
    files = _files(tmp_path)
    assert len(files) == 4 and all(f.endswith(".kvb") for f in files)

    reopened = DiskStore(tmp_path)  # a restart: nothing but the folder
    assert len(reopened) == 4
    assert reopened.nbytes == sum(os.path.getsize(tmp_path / f) for f in files)
    for store in (early, reopened):
        dst = MHAPool.create(size=128, dtype=np.float32, head_num=1, head_dim=2, layer_num=2)
        conn2 = KVConnector(dst, store)
        assert conn2.lookup(tokens) == 64
        dst_slots = np.arange(65, 129)
        dst, n = conn2.load(dst, tokens, dst_slots)
        assert n == 64
        assert_rows(dst, dst_slots, raw_rows(src, slots))
        assert conn2.store(src, tokens, slots) == 0  # already on disk


_WRITER = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from helpers import random_mha_pool, token_seq
from jaxkv.connector import DiskStore, KVConnector
src = random_mha_pool(seed=5, size=128, layer_num=2)
conn = KVConnector(src, DiskStore(sys.argv[1]))
print(conn.store(src, token_seq(9, blocks=3), np.arange(10, 58)))
"""


@pytest.mark.slow  # a second interpreter; in one process: test_disk_store_persists_across_instances
def test_disk_store_persists_across_processes(tmp_path):
    early = DiskStore(tmp_path)  # open before the other process writes
    proc = run_python("-c", _WRITER.format(tests=str(REPO / "tests")), str(tmp_path), timeout=120)
    assert proc.stdout.split() == ["3"]
    src = random_mha_pool(seed=5, size=128, layer_num=2)
    want = raw_rows(src, np.arange(10, 58))
    tokens = token_seq(9, blocks=3)
    for store in (early, DiskStore(tmp_path)):
        dst = MHAPool.create(size=128, dtype=np.float32, head_num=1, head_dim=2, layer_num=2)
        conn = KVConnector(dst, store)
        assert conn.lookup(tokens) == 48
        dst_slots = np.arange(70, 118)
        dst, n = conn.load(dst, tokens, dst_slots)
        assert n == 48
        assert_rows(dst, dst_slots, want)


def test_disk_store_writes_leave_no_temporary_files(tmp_path):
    src = random_mha_pool()
    conn = KVConnector(src, DiskStore(tmp_path))
    for i in range(5):
        conn.store(src, token_seq(i, blocks=2), np.arange(1, 33))
    files = _files(tmp_path)
    assert len(files) == 10
    assert all(f.endswith(".kvb") and ".tmp" not in f for f in files)


def test_disk_store_failed_write_leaves_nothing(tmp_path, monkeypatch):
    src = random_mha_pool()
    store = DiskStore(tmp_path)
    conn = KVConnector(src, store)

    def failing_replace(self, src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(disk_module.FileOps, "replace", failing_replace)
    assert conn.store(src, token_seq(0), np.arange(1, 17)) == 0
    monkeypatch.undo()
    assert _files(tmp_path) == []
    assert store.stats()["io_errors"] == 1 and len(store) == 0
    assert conn.lookup(token_seq(0)) == 0
    assert conn.store(src, token_seq(0), np.arange(1, 17)) == 1  # works again once the disk does


def test_disk_store_cleans_stale_temporary_files_on_open_and_keeps_live_writers(tmp_path):
    src = random_mha_pool()
    conn = KVConnector(src, DiskStore(tmp_path))
    conn.store(src, token_seq(0), np.arange(1, 17))
    key = conn.block_hashes(token_seq(0))[0]
    final = record_path(tmp_path, key)
    dead = run_python("-c", "import os; print(os.getpid())", timeout=60)
    dead_pid = int(dead.stdout)
    other = os.path.join(tmp_path, "ab", "f" * 64 + ".kvb")
    stale = [
        f"{final}.{disk_module._HOST}-{dead_pid}.deadbeef.tmp",  # its writer died before the rename
        other + ".99.1.cafe0000.tmp",  # unknown owner, older than the stale age
    ]
    live = [
        f"{final}.{disk_module._HOST}-{os.getppid()}.0123abcd.tmp",  # a live process is writing it
        f"{other}.00000000-{dead_pid}.0123abcd.tmp",  # another machine's writer: too young
    ]
    os.makedirs(os.path.dirname(other), exist_ok=True)
    for path in stale + live:
        with open(path, "wb") as f:
            f.write(b"half a record")
    old = time.time() - disk_module.STALE_TMP_SECONDS - 60
    os.utime(stale[1], (old, old))
    store = DiskStore(tmp_path)
    assert [os.path.exists(p) for p in stale + live] == [False, False, True, True]
    assert os.path.exists(final) and len(store) == 1


def test_disk_store_evicts_least_recently_used_past_capacity(tmp_path):
    src = random_mha_pool()
    slots = np.arange(1, 17)
    probe = tmp_path / "probe"
    KVConnector(src, DiskStore(probe)).store(src, token_seq(0), slots)
    file_size = os.path.getsize(probe / _files(probe)[0])

    root = tmp_path / "kv"
    store = DiskStore(root, capacity_bytes=3 * file_size + file_size // 2)
    conn = KVConnector(src, store)
    a, b, c, d, e = (token_seq(i) for i in range(5))
    for seq in (a, b, c):
        assert conn.store(src, seq, slots) == 1
    assert conn.lookup(a) == BS  # order b, c, a
    assert conn.store(src, d, slots) == 1  # evicts b
    dst = random_mha_pool(1)
    dst, n = conn.load(dst, c, slots)  # order a, d, c
    assert n == BS
    assert conn.store(src, e, slots) == 1  # evicts a
    held = {name: conn.lookup(seq) == BS for name, seq in dict(a=a, b=b, c=c, d=d, e=e).items()}
    assert held == {"a": False, "b": False, "c": True, "d": True, "e": True}
    assert len(_files(root)) == 3
    st = store.stats()
    assert st["evictions"] == 2 and st["blocks"] == 3 and st["bytes"] <= store.capacity_bytes


def test_disk_store_stats_counters(tmp_path):
    src = random_mha_pool()
    store = DiskStore(tmp_path)
    conn = KVConnector(src, store)
    conn.store(src, token_seq(0, blocks=2), np.arange(1, 33))
    dst = random_mha_pool(1)
    dst, n = conn.load(dst, token_seq(0, blocks=3), np.arange(1, 49))
    assert n == 32
    st = store.stats()
    want = {
        "hits": 2,
        "misses": 1,
        "blocks_stored": 2,
        "bytes_stored": 512,
        "blocks_loaded": 2,
        "bytes_loaded": 512,
        "verification_failures": 0,
        "evictions": 0,
        "io_errors": 0,
        "blocks": 2,
        "bytes": sum(os.path.getsize(tmp_path / f) for f in _files(tmp_path)),
    }
    assert {k: st[k] for k in want} == want


def test_disk_lookup_changes_no_files(tmp_path):
    src = random_mha_pool()
    store = DiskStore(tmp_path)
    conn = KVConnector(src, store)
    conn.store(src, token_seq(0, blocks=3), np.arange(1, 49))
    snapshot = {f: (tmp_path / f).read_bytes() for f in _files(tmp_path)}
    for _ in range(2):
        assert conn.lookup(token_seq(0, blocks=3)) == 48
        assert conn.lookup(token_seq(1, blocks=3)) == 0
    assert {f: (tmp_path / f).read_bytes() for f in _files(tmp_path)} == snapshot
    assert store.stats()["blocks_stored"] == 3


# --------------------------------------------------------------------------------------------
# DiskStore: corruption is never loaded


@pytest.fixture
def two_blocks(tmp_path):
    """A DiskStore holding two blocks of one sequence; the second block's file bytes."""
    src = random_mha_pool()
    store = DiskStore(tmp_path)
    conn = KVConnector(src, store)
    tokens, slots = token_seq(1, blocks=2), np.arange(1, 33)
    assert conn.store(src, tokens, slots) == 2
    path = record_path(tmp_path, conn.block_hashes(tokens)[1])
    with open(path, "rb") as f:
        good = f.read()
    return conn, store, tokens, raw_rows(src, slots), path, good


def _load_after_tampering(conn, store, tokens, want, path, data, dst):
    """Writes `data` as the second block's file and loads; asserts the load either returns the
    original data or stops before that block (removing and counting the bad file)."""
    with open(path, "wb") as f:
        f.write(data)
    failures = store.stats()["verification_failures"]
    slots = np.arange(33, 65)
    dst, n = conn.load(dst, tokens, slots)
    if n == 2 * BS:
        assert_rows(dst, slots, want)
        return dst, False
    assert n == BS, n
    assert_rows(dst, slots[:BS], want[:, :BS])
    assert not os.path.exists(path)
    assert store.stats()["verification_failures"] == failures + 1
    return dst, True


def test_disk_store_every_single_byte_flip_is_caught(two_blocks):
    conn, store, tokens, want, path, good = two_blocks
    assert len(good) < 2000  # small enough to try every offset
    dst = random_mha_pool(2)
    caught = 0
    for offset in range(len(good)):
        for mask in (0xFF, 0x01, 0x80):
            bad = bytearray(good)
            bad[offset] ^= mask
            dst, hit = _load_after_tampering(conn, store, tokens, want, path, bytes(bad), dst)
            caught += hit
    assert caught == 3 * len(good)  # a CRC catches every single-byte error
    dst, hit = _load_after_tampering(conn, store, tokens, want, path, good, dst)
    assert not hit  # the intact file still loads


def test_disk_store_truncated_records_are_caught(two_blocks):
    conn, store, tokens, want, path, good = two_blocks
    dst = random_mha_pool(2)
    for length in range(len(good)):
        dst, hit = _load_after_tampering(conn, store, tokens, want, path, good[:length], dst)
        assert hit
    extended = good + b"\0"
    dst, hit = _load_after_tampering(conn, store, tokens, want, path, extended, dst)
    assert hit


def test_disk_store_rejects_a_record_under_another_blocks_name(two_blocks, tmp_path):
    conn, store, tokens, want, path, good = two_blocks
    first = record_path(tmp_path, conn.block_hashes(tokens)[0])
    with open(first, "rb") as f:
        first_bytes = f.read()
    dst = random_mha_pool(2)
    _, hit = _load_after_tampering(conn, store, tokens, want, path, first_bytes, dst)
    assert hit
    # Also a whole record of an unrelated sequence, copied over block 0's name.
    other = token_seq(7)
    src = random_mha_pool()
    conn.store(src, other, np.arange(1, 17))
    shutil.copyfile(record_path(tmp_path, conn.block_hashes(other)[0]), first)
    before = store.stats()["verification_failures"]
    dst = random_mha_pool(3)
    raw = raw_rows(dst, np.arange(33, 65))
    dst, n = conn.load(dst, tokens, np.arange(33, 65))
    assert n == 0
    assert_rows(dst, np.arange(33, 65), raw)
    assert not os.path.exists(first)
    assert store.stats()["verification_failures"] == before + 1


def test_disk_store_ignores_foreign_files(tmp_path):
    (tmp_path / "README").write_text("not a block")
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.txt").write_text("nor this")
    store = DiskStore(tmp_path)
    assert len(store) == 0
    assert (tmp_path / "README").exists() and (tmp_path / "ab" / "notes.txt").exists()


# --------------------------------------------------------------------------------------------
# DiskStore: only plain files are opened, no link inside the folder is followed

# Generous: these calls take milliseconds; the bound only turns a hang into a failure.
_HANG_S = 30.0


def _returns(call, *args, unblock=None):
    """`call(*args)`'s result, run in a thread; fails the test when the call has not returned
    within `_HANG_S` (it hangs), after `unblock()` has released the thread."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call(*args)), daemon=True)
    thread.start()
    thread.join(_HANG_S)
    if thread.is_alive():
        if unblock is not None:
            unblock()
        pytest.fail(f"{getattr(call, '__name__', call)} did not return: it blocks")
    assert out, "the call raised (see the thread's traceback above)"
    return out[0]


def _release_fifo_reader(path):
    """Opens the FIFO `path` for writing (and closes it), which returns a reader blocked
    opening it."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _disk_record(i: int) -> BlockRecord:
    return small_record(block_key(i), float(i))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_disk_store_never_blocks_on_a_fifo_under_a_block_name(tmp_path):
    store = DiskStore(tmp_path)
    fifos = {}
    for i in (1, 2, 3):
        fifos[i] = record_path(tmp_path, block_key(i))
        os.makedirs(os.path.dirname(fifos[i]), exist_ok=True)
        os.mkfifo(fifos[i])
    assert (
        _returns(store.contains, block_key(1), unblock=lambda: _release_fifo_reader(fifos[1]))
        is False
    )
    assert _returns(store.get, block_key(2), unblock=lambda: _release_fifo_reader(fifos[2])) is None
    # A put over it: the name is found damaged, and the record written in its place.
    assert _returns(store.put, _disk_record(3), unblock=lambda: _release_fifo_reader(fifos[3]))
    assert not os.path.exists(fifos[1]) and not os.path.exists(fifos[2])
    assert os.path.isfile(fifos[3]) and store.get(block_key(3)).key == block_key(3)
    st = store.stats()
    assert st["verification_failures"] == 3 and st["io_errors"] == 0
    assert (st["hits"], st["misses"]) == (1, 1)


def test_disk_store_never_follows_a_link_to_a_record_elsewhere(tmp_path):
    other = DiskStore(tmp_path / "other")  # another tenant's folder
    assert other.put(_disk_record(1)) and other.put(_disk_record(2))
    store = DiskStore(tmp_path / "mine")
    for i in (1, 2):
        link = record_path(tmp_path / "mine", block_key(i))
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(record_path(tmp_path / "other", block_key(i)), link)
    assert store.contains(block_key(1)) is False
    assert store.get(block_key(2)) is None
    for i in (1, 2):  # the links are gone, their targets are not
        assert not os.path.lexists(record_path(tmp_path / "mine", block_key(i)))
        assert other.get(block_key(i)).key == block_key(i)
    assert store.stats()["verification_failures"] == 2 and store.stats()["hits"] == 0


def test_disk_store_never_follows_a_linked_subfolder(tmp_path):
    other = DiskStore(tmp_path / "other")
    records = [_disk_record(i) for i in (0x10, 0x11)]  # keys in subfolder "00"
    assert other.put_many(records).values == [True, True]
    sub = os.path.dirname(record_path(tmp_path / "mine", records[0].key))
    os.makedirs(os.path.dirname(sub))
    os.symlink(os.path.dirname(record_path(tmp_path / "other", records[0].key)), sub)
    size = os.path.getsize(record_path(tmp_path / "other", records[0].key))
    # The rescan indexes nothing through the link (nor would eviction remove anything there).
    store = DiskStore(tmp_path / "mine", capacity_bytes=size + size // 2)
    assert len(store) == 0 and not os.path.lexists(sub)
    assert store.stats()["verification_failures"] == 1
    os.symlink(os.path.dirname(record_path(tmp_path / "other", records[0].key)), sub)
    assert store.get(records[0].key) is None and not os.path.lexists(sub)
    os.symlink(os.path.dirname(record_path(tmp_path / "other", records[0].key)), sub)
    assert store.contains(records[1].key) is False and not os.path.lexists(sub)
    # A write makes a real subfolder; eviction (room for one file) stays in this folder.
    assert store.put(_disk_record(0x12)) and os.path.isdir(sub) and not os.path.islink(sub)
    assert store.put(_disk_record(0x13)) and store.stats()["evictions"] == 1
    assert store.stats()["verification_failures"] == 3
    assert [other.get(r.key).key for r in records] == [r.key for r in records]


def test_disk_store_removes_sockets_devices_and_links_under_block_names(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    made = []
    sock_path = record_path(tmp_path, block_key(1))
    os.makedirs(os.path.dirname(sock_path), exist_ok=True)
    if hasattr(socket, "AF_UNIX"):
        monkeypatch.chdir(os.path.dirname(sock_path))  # a socket's name must be short
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(os.path.basename(sock_path))  # opening it fails (ENXIO): a damaged name
        sock.close()
        made.append(block_key(1))
    if os.path.exists(os.devnull) and hasattr(os, "symlink"):
        os.symlink(os.devnull, record_path(tmp_path, block_key(2)))
        made.append(block_key(2))
    try:
        os.mknod(record_path(tmp_path, block_key(3)), 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        made.append(block_key(3))
    except (AttributeError, OSError):
        pass  # making device nodes needs privileges
    if not made:
        pytest.skip("cannot make sockets, links or devices here")
    assert [_returns(store.contains, k) for k in made] == [False] * len(made)
    assert not any(os.path.lexists(record_path(tmp_path, k)) for k in made)
    st = store.stats()
    assert st["verification_failures"] == len(made) and st["io_errors"] == 0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_disk_store_rescan_skips_and_removes_what_is_not_a_plain_file(tmp_path):
    good = DiskStore(tmp_path)
    assert good.put(_disk_record(1))
    elsewhere = DiskStore(tmp_path / "elsewhere")
    assert elsewhere.put(_disk_record(2))
    fifo, link = record_path(tmp_path, block_key(3)), record_path(tmp_path, block_key(2))
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.mkfifo(fifo)
    os.symlink(record_path(tmp_path / "elsewhere", block_key(2)), link)
    store = _returns(DiskStore, tmp_path, unblock=lambda: _release_fifo_reader(fifo))
    assert len(store) == 1 and store.contains(block_key(1))
    assert not os.path.lexists(fifo) and not os.path.lexists(link)
    assert store.stats()["verification_failures"] == 2
    assert elsewhere.get(block_key(2)) is not None


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's read counter")
def test_disk_store_never_reads_a_file_longer_than_its_record_whole(tmp_path):
    store = DiskStore(tmp_path)
    assert store.put(_disk_record(1))
    path = record_path(tmp_path, block_key(1))
    extra = 64 << 20
    with open(path, "r+b") as f:  # a sparse tail: costs no disk, would cost a read
        f.truncate(os.path.getsize(path) + extra)
    before = _bytes_read()
    assert store.get(block_key(1)) is None
    assert _bytes_read() - before < extra // 4
    assert not os.path.exists(path) and store.stats()["verification_failures"] == 1


def test_disk_store_keys_and_names_match_whole(tmp_path):
    store = DiskStore(tmp_path)
    for call in (store.contains, store.get, store.discard):
        with pytest.raises(ValueError, match="key"):
            call(block_key(1) + "\n")


def test_disk_store_removes_a_temporary_file_whose_pid_cannot_be(tmp_path):
    name = f"{block_key(1)}.kvb.{disk_module._HOST}-{'9' * 30}.0123abcd.tmp"
    tmp = os.path.join(tmp_path, block_key(1)[:2], name)
    os.makedirs(os.path.dirname(tmp))
    with open(tmp, "wb") as f:
        f.write(b"half a record")
    store = DiskStore(tmp_path)
    assert not os.path.exists(tmp) and len(store) == 0


def test_disk_store_serves_what_contains_promised_or_removes_it(tmp_path):
    """`contains` checks a file's header and size, not its checksum: a payload bit flip is
    still promised until a read, which then removes it, so that the next put repairs it."""
    store = DiskStore(tmp_path)
    record = _disk_record(5)
    assert store.put(record)
    path = record_path(tmp_path, record.key)
    raw = bytearray(Path(path).read_bytes())
    raw[-8] ^= 0x04  # in the payload
    Path(path).write_bytes(bytes(raw))
    assert store.contains(record.key) is True
    assert store.get(record.key) is None and not os.path.exists(path)
    assert store.contains(record.key) is False
    assert store.put(record) is True
    got = store.get(record.key)
    np.testing.assert_array_equal(got.parts["k"], record.parts["k"])
    assert store.stats()["verification_failures"] == 1


# --------------------------------------------------------------------------------------------
# Arguments


def test_store_flags_take_numpy_bools(tmp_path):
    store = DiskStore(tmp_path, strict=np.True_, fsync=np.bool_(True))
    assert store.strict is True and store.fsync is True
    store.strict = np.False_
    assert store.strict is False


@pytest.mark.parametrize("bad", [None, 3, b"/tmp/x", ["a"]])
def test_disk_store_path_must_be_a_str_or_pathlike(bad):
    with pytest.raises(TypeError, match="path"):
        DiskStore(bad)


def test_disk_store_path_must_not_be_empty():
    with pytest.raises(ValueError, match="path"):
        DiskStore("")


def test_disk_store_path_cannot_be_reassigned(tmp_path):
    store = DiskStore(tmp_path / "a")
    with pytest.raises(AttributeError):
        store.path = str(tmp_path / "b")
    assert store.path == str(tmp_path / "a")


# --------------------------------------------------------------------------------------------
# discard


def test_disk_store_discard_removes_the_file(tmp_path):
    store = DiskStore(tmp_path)
    assert store.put(_disk_record(1)) and store.put(_disk_record(2))
    assert store.discard(block_key(1)) is True
    assert not os.path.exists(record_path(tmp_path, block_key(1)))
    assert not store.contains(block_key(1)) and store.get(block_key(1)) is None and len(store) == 1
    assert store.discard(block_key(1)) is False  # gone already: no error
    assert store.discard(block_key(3)) is False
    st = store.stats()
    assert (st["discarded"], st["io_errors"], st["undiscarded"]) == (1, 0, 0)
    assert store.put(_disk_record(1)) is True and store.contains(block_key(1))


# --------------------------------------------------------------------------------------------
# Faults injected through FileOps


class FaultyOps(FileOps):
    """`FileOps` whose operation `op` fails with `code` on its calls number `after` onwards
    (0-based, counting only that operation), `times` times (None: for good)."""

    def __init__(self):
        self.faults: dict[str, tuple[int, int, int | None]] = {}
        self.calls: dict[str, int] = {}

    def fail(self, op: str, code: int, *, after: int = 0, times: int | None = None) -> None:
        self.faults[op] = (code, after, times)
        self.calls[op] = 0

    def clear(self) -> None:
        self.faults.clear()

    def _check(self, op: str, path: str) -> None:
        if op not in self.faults:
            return
        code, after, times = self.faults[op]
        n = self.calls[op]
        self.calls[op] = n + 1
        if n >= after and (times is None or n < after + times):
            raise OSError(code, os.strerror(code), path)


def _wrap(name):
    def method(self, path, *args):
        self._check(name, path)
        return getattr(FileOps, name)(self, path, *args)

    return method


_OPS = (
    "makedirs",
    "mkdir",
    "write",
    "replace",
    "read",
    "head",
    "listdir",
    "stat",
    "touch",
    "unlink",
)
for _name in _OPS:
    setattr(FaultyOps, _name, _wrap(_name))


def _pool(seed: int = 0) -> MHAPool:
    return random_mha_pool(seed, size=128, head_dim=4, layer_num=2)


def _disk(tmp_path, **kw):
    fs = FaultyOps()
    return DiskStore(tmp_path / "blocks", _fs=fs, **kw), fs


def _kvb_files(root) -> int:
    return sum(f.endswith(".kvb") for _, _, fs in os.walk(root) for f in fs)


def _tmp_files(root) -> int:
    return sum(f.endswith(".tmp") for _, _, fs in os.walk(root) for f in fs)


def _assert_consistent(conn, store, root):
    """Connector, store and folder agree on what was written, and lookup on what load
    serves."""
    st = conn.stats()
    assert st["blocks_stored"] == st["store"]["blocks_stored"]
    assert _kvb_files(root) == len(store)
    n = conn.lookup(TOKENS)
    dst = _pool(9)
    dst, loaded = conn.load(dst, TOKENS, SLOTS + 60)
    assert loaded == n
    src = _pool()
    np.testing.assert_array_equal(raw_rows(dst, SLOTS[:n] + 60), raw_rows(src, SLOTS[:n]))


@pytest.mark.parametrize(
    "op, code",
    [
        ("mkdir", errno.ENOSPC),
        ("write", errno.ENOSPC),
        ("write", errno.EACCES),
        ("replace", errno.EROFS),
    ],
)
def test_a_write_fault_mid_store_is_a_counted_dropped_write(tmp_path, op, code, caplog):
    store, fs = _disk(tmp_path)
    conn = KVConnector(_pool(), store)
    # The first block's folder (and file) succeed, every later one fails.
    fs.fail(op, code, after=1)
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        written = conn.store(_pool(), TOKENS, SLOTS)
    failed = fs.calls[op] - 1
    assert written == N_BLOCKS - failed and failed >= 1
    st = conn.stats()
    assert st["io_errors"] == st["store"]["io_errors"] == failed
    assert _tmp_files(tmp_path) == 0 and _kvb_files(tmp_path) == written
    _assert_consistent(conn, store, tmp_path)
    # One log line per failure class at the 1st, 2nd, 4th... failure, each with its count.
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxkv"]
    assert lines and all("DiskStore: write failed" in line for line in lines)
    assert [int(line.split("(")[1].split()[0]) for line in lines] == [
        n for n in (1, 2, 4, 8) if n <= failed
    ]
    # The disk has room again: the dropped blocks are written by the next store.
    fs.clear()
    assert conn.store(_pool(), TOKENS, SLOTS) == failed
    _assert_consistent(conn, store, tmp_path)
    assert conn.lookup(TOKENS) == N_BLOCKS * BS


def test_strict_store_and_strict_connector_raise_the_io_error(tmp_path):
    store, fs = _disk(tmp_path, strict=True)
    conn = KVConnector(_pool(), store)
    fs.fail("mkdir", errno.ENOSPC, after=2)
    with pytest.raises(OSError) as err:
        conn.store(_pool(), TOKENS, SLOTS)
    assert err.value.errno == errno.ENOSPC
    st = conn.stats()
    assert st["blocks_stored"] == st["store"]["blocks_stored"] == 2 == _kvb_files(tmp_path)
    assert st["io_errors"] == 1

    store, fs = _disk(tmp_path / "b")
    strict = KVConnector(_pool(), store, strict=True)
    fs.fail("read", errno.EIO)
    strict.store(_pool(), TOKENS, SLOTS)
    with pytest.raises(OSError):
        strict.load(_pool(1), TOKENS, SLOTS)
    # The same store behind a lenient connector: a miss, counted.
    lenient = KVConnector(_pool(), store)
    assert lenient.load(_pool(1), TOKENS, SLOTS)[1] == 0
    assert lenient.stats()["misses"] == N_BLOCKS
    assert store.stats()["io_errors"] == 2


def test_a_read_error_ends_the_loaded_prefix_and_is_counted(tmp_path):
    store, fs = _disk(tmp_path)
    conn = KVConnector(_pool(), store)
    assert conn.store(_pool(), TOKENS, SLOTS) == N_BLOCKS
    fs.fail("read", errno.EIO, after=2, times=1)
    dst, n = conn.load(_pool(1), TOKENS, SLOTS)
    assert n == 2 * BS
    st = conn.stats()
    assert (st["hits"], st["misses"], st["io_errors"]) == (2, 2, 1)
    assert st["store"]["misses"] == 1  # the third block's read; the fourth was never asked for
    _assert_consistent(conn, store, tmp_path)  # the read works again: all four served


def test_a_vanished_file_is_a_miss_not_an_error(tmp_path):
    store, fs = _disk(tmp_path)
    conn = KVConnector(_pool(), store)
    conn.store(_pool(), TOKENS, SLOTS)
    assert conn.lookup(TOKENS) == N_BLOCKS * BS
    fs.fail("read", errno.ENOENT, after=1, times=1)  # another process evicted it meanwhile
    dst, n = conn.load(_pool(1), TOKENS, SLOTS)
    assert n == BS
    assert conn.stats()["io_errors"] == 0 and conn.stats()["misses"] == N_BLOCKS - 1


def test_opening_a_folder_whose_files_vanish_does_not_crash(tmp_path):
    store, _ = _disk(tmp_path)
    KVConnector(_pool(), store).store(_pool(), TOKENS, SLOTS)
    fs = FaultyOps()
    fs.fail("stat", errno.ENOENT, after=1)  # listed, then gone before its stat
    reopened = DiskStore(tmp_path / "blocks", _fs=fs)
    assert len(reopened) == 1 and reopened.stats()["io_errors"] == 0
    fs = FaultyOps()
    fs.fail("listdir", errno.EACCES, after=1)  # unreadable subfolders
    reopened = DiskStore(tmp_path / "blocks", _fs=fs)
    assert reopened.stats()["io_errors"] == fs.calls["listdir"] - 1 >= 1


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_file_is_dropped_and_rewritten(tmp_path, damage):
    store, _ = _disk(tmp_path)
    conn = KVConnector(_pool(), store)
    conn.store(_pool(), TOKENS, SLOTS)
    key = conn.block_hashes(TOKENS)[1]
    path = Path(record_path(tmp_path / "blocks", key))
    raw = bytearray(path.read_bytes())
    if damage == "truncate":  # a torn write: lookup sees it without reading the payload
        path.write_bytes(bytes(raw[: len(raw) // 2]))
        assert conn.lookup(TOKENS) == BS
    else:  # bit rot: only the checksum sees it, on the first load
        raw[-8] ^= 0x40
        path.write_bytes(bytes(raw))
        assert conn.lookup(TOKENS) == N_BLOCKS * BS
        assert conn.load(_pool(1), TOKENS, SLOTS)[1] == BS
        assert conn.lookup(TOKENS) == BS
    assert not path.exists() and store.stats()["verification_failures"] == 1
    assert conn.store(_pool(), TOKENS, SLOTS) == 1  # rewritten
    _assert_consistent(conn, store, tmp_path)


def test_a_failing_async_write_never_makes_load_raise(tmp_path):
    store, fs = _disk(tmp_path)
    conn = KVConnector(_pool(), store)
    gate = threading.Event()
    original = fs.write

    def slow_failing_write(path, data, fsync):
        gate.wait(10)  # hold the write until load is waiting on it
        raise OSError(errno.ENOSPC, "No space left on device", path)

    fs.write = slow_failing_write
    future = conn.store_async(_pool(), TOKENS, SLOTS)
    assert conn.lookup(TOKENS) == N_BLOCKS * BS  # pending blocks count as stored
    threading.Timer(0.05, gate.set).start()
    dst, n = conn.load(_pool(1), TOKENS, SLOTS)
    assert n == 0
    assert future.result(timeout=10) == 0
    conn.flush()  # dropped writes are counted, not raised
    st = conn.stats()
    assert st["io_errors"] == N_BLOCKS and st["async_failures"] == 0 and st["pending_blocks"] == 0
    fs.write = original
    assert conn.store(_pool(), TOKENS, SLOTS) == N_BLOCKS
    conn.close()


def test_a_strict_tier_raises_through_a_stack_and_what_faster_tiers_stored_counts(tmp_path):
    disk, fs = _disk(tmp_path, strict=True)
    host = HostStore(1 << 20)
    conn = KVConnector(_pool(), TieredStore(host, disk))  # a lenient connector
    fs.fail("mkdir", errno.ENOSPC, after=2)
    with pytest.raises(OSError) as err:
        conn.store(_pool(), TOKENS, SLOTS)
    assert err.value.errno == errno.ENOSPC
    st = conn.stats()
    # The host tier took every block before the disk tier failed on its third.
    assert len(host) == N_BLOCKS and _kvb_files(tmp_path) == 2
    assert st["blocks_stored"] == st["store"]["blocks_stored"] == N_BLOCKS
    assert st["io_errors"] == st["store"]["io_errors"] == 1
    lenient = TieredStore(HostStore(1 << 20), _disk(tmp_path / "b")[0])
    assert not lenient.strict
    lenient.strict = True  # as on any store
    assert lenient.strict and not lenient.tiers[1].strict


def test_strict_async_failure_reaches_flush_but_not_load(tmp_path):
    store, fs = _disk(tmp_path)
    conn = KVConnector(_pool(), store, strict=True)
    fs.fail("write", errno.ENOSPC)
    future = conn.store_async(_pool(), TOKENS, SLOTS)
    assert conn.load(_pool(1), TOKENS, SLOTS)[1] == 0
    with pytest.raises(OSError):
        conn.flush()
    assert isinstance(future.exception(timeout=10), OSError)
    assert conn.stats()["async_failures"] == 1
    conn.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_max_pending_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_pending"):
        KVConnector(_pool(), HostStore(1 << 20), max_pending=bad)


def test_max_pending_takes_numpy_ints():
    conn = KVConnector(_pool(), HostStore(1 << 20), max_pending=np.int64(1))
    assert conn.store_async(_pool(), TOKENS, SLOTS).result(timeout=30) == N_BLOCKS
    conn.close()


def test_a_closed_connector_rejects_new_work_and_starts_no_thread():
    conn = KVConnector(_pool(), HostStore(1 << 20))
    conn.store_async(_pool(), TOKENS[:BS], SLOTS[:BS]).result(timeout=30)
    conn.close()
    before = {t for t in threading.enumerate() if t.name.startswith("jaxkv-store")}
    for call in (conn.store_async, conn.store, conn.load):
        with pytest.raises(RuntimeError, match="closed"):
            call(_pool(), TOKENS, SLOTS)
    after = {t for t in threading.enumerate() if t.name.startswith("jaxkv-store")}
    assert after <= before
    assert conn.lookup(TOKENS) == BS  # reading what is there still answers
    conn.flush()


def test_stores_take_numpy_ints_and_refuse_a_file_as_folder(tmp_path):
    assert HostStore(np.int64(1 << 20), preallocate_bytes=np.int32(0)).capacity_bytes == 1 << 20
    assert DiskStore(tmp_path / "d", np.uint32(1 << 20)).capacity_bytes == 1 << 20
    file = tmp_path / "a_file"
    file.write_bytes(b"x")
    with pytest.raises(ValueError, match="path: expected a folder"):
        DiskStore(file)
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="capacity_bytes"):
            HostStore(bad)
        with pytest.raises(ValueError, match="capacity_bytes"):
            DiskStore(tmp_path / "e", bad)


def test_lookup_and_load_count_apart(tmp_path):
    conn = KVConnector(_pool(), HostStore(1 << 20))
    conn.store(_pool(), TOKENS[: 2 * BS], SLOTS[: 2 * BS])
    assert conn.lookup(TOKENS) == 2 * BS
    conn.load(_pool(1), TOKENS, SLOTS)
    st = conn.stats()
    assert (st["lookups"], st["lookup_hits"], st["lookup_misses"]) == (1, 2, 2)
    assert (st["loads"], st["hits"], st["misses"], st["blocks_loaded"]) == (1, 2, 2, 2)
    assert (st["store"]["hits"], st["store"]["misses"]) == (2, 1)


# --------------------------------------------------------------------------------------------
# What a store promises when it cannot remove a file, and failures after a write landed


def _records(n: int) -> list[BlockRecord]:
    return [
        BlockRecord(f"{i:064x}", "layout", "tokens", {"k": np.full((2, 4), i, np.float32)})
        for i in range(n)
    ]


def _damage_payload(store, key) -> None:
    path = record_path(store.path, key)
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        byte = f.read(1)
        f.seek(-8, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_damaged_file_that_cannot_be_removed_is_not_promised_again(tmp_path):
    store, fs = _disk(tmp_path)
    (record,) = _records(1)
    assert store.put(record)
    _damage_payload(store, record.key)
    fs.fail("unlink", errno.EACCES)  # a folder where this process may not remove files
    assert store.contains(record.key) is True  # the header and size are whole
    assert store.get(record.key) is None
    st = store.stats()
    assert (st["verification_failures"], st["io_errors"]) == (1, 1)
    assert store.contains(record.key) is False and store.get(record.key) is None
    assert store.put(record) is True  # the rename still replaces it
    np.testing.assert_array_equal(store.get(record.key).parts["k"], record.parts["k"])
    assert store.contains(record.key) is True


@pytest.mark.parametrize("strict", [False, True])
def test_a_discard_that_cannot_remove_the_file_stops_serving_it(tmp_path, strict):
    store, fs = _disk(tmp_path, strict=strict)
    (record,) = _records(1)
    assert store.put(record)
    fs.fail("unlink", errno.EACCES)
    if strict:
        with pytest.raises(PermissionError):
            store.discard(record.key)
    else:
        assert store.discard(record.key) is False
    st = store.stats()
    assert (st["discarded"], st["io_errors"]) == (0, 1)
    assert store.contains(record.key) is False and store.get(record.key) is None
    fs.clear()
    assert store.put(record) is True and store.get(record.key) is not None
    assert store.discard(record.key) is True and store.stats()["discarded"] == 1


@pytest.mark.parametrize("strict", [False, True])
def test_a_failed_eviction_is_not_counted_nor_fails_the_write_that_landed(tmp_path, strict):
    records = _records(4)
    probe = DiskStore(tmp_path / "probe")
    probe.put(records[0])
    size = probe.nbytes
    store, fs = _disk(tmp_path, capacity_bytes=2 * size, strict=strict)
    assert store.put_many(records[:2]).values == [True, True]
    fs.fail("unlink", errno.EACCES)
    assert store.put_many(records[2:]).values == [True, True]  # each evicts, and removing fails
    st = store.stats()
    assert st["evictions"] == 0 and st["io_errors"] >= 2 and st["blocks_stored"] == 4
    assert _kvb_files(tmp_path / "blocks") == 4
    fs.clear()
    assert store.put(_records(5)[4])  # removals work again: the rescan finds all five files
    assert store.stats()["evictions"] == 3 and _kvb_files(tmp_path / "blocks") == 2


@pytest.mark.parametrize("stored_first", [0, 2])
def test_a_failed_promotion_keeps_the_records_read(tmp_path, stored_first):
    records = _records(4)
    slow = DiskStore(tmp_path / "slow")
    slow.put_many(records)
    fast, fs = _disk(tmp_path / "fast", strict=True)
    fs.fail("mkdir", errno.ENOSPC, after=stored_first)  # the fast disk fills up
    stack = TieredStore(fast, slow)
    got = stack.get_many([r.key for r in records]).values
    assert [g.key for g in got] == [r.key for r in records]
    st = stack.stats()
    assert st["promotions"] == stored_first == len(fast)
    assert st["io_errors"] == st["tiers"][0]["io_errors"] == 1  # the strict tier stopped there
    assert st["hits"] == 4


def test_a_strict_connector_loads_what_a_failed_promotion_read(tmp_path):
    src = _pool()
    slow = DiskStore(tmp_path / "slow")
    KVConnector(src, slow).store(src, TOKENS, SLOTS)
    fast, fs = _disk(tmp_path / "fast")
    fs.fail("write", errno.ENOSPC)
    conn = KVConnector(src, TieredStore(fast, slow), strict=True)
    dst, n = conn.load(_pool(1), TOKENS, SLOTS + 60)
    assert n == N_BLOCKS * BS
    np.testing.assert_array_equal(raw_rows(dst, SLOTS + 60), raw_rows(src, SLOTS))
    # The strict write stopped at its first failure, counted once (the store's count).
    assert fast.stats()["io_errors"] == conn.stats()["io_errors"] == 1 and len(fast) == 0


def test_a_stack_set_strict_raises_its_tiers_io_errors(tmp_path):
    disk, fs = _disk(tmp_path)
    (record,) = _records(1)
    stack = TieredStore(HostStore(1 << 20), disk)
    disk.put(record)
    fs.fail("read", errno.EIO)
    assert stack.get(record.key) is None  # lenient: a counted miss
    stack.strict = True
    with pytest.raises(OSError) as err:
        stack.get(record.key)
    assert err.value.errno == errno.EIO
    assert disk.stats()["io_errors"] == 2 and not disk.strict  # the tier's own flag is as set


def test_a_stack_discards_from_every_tier_before_raising_a_tiers_error(tmp_path):
    first, fs = _disk(tmp_path / "a", strict=True)
    second = DiskStore(tmp_path / "b")
    (record,) = _records(1)
    stack = TieredStore(first, second)
    assert stack.put(record)
    fs.fail("unlink", errno.EACCES)
    with pytest.raises(PermissionError):
        stack.discard(record.key)
    assert not second.contains(record.key) and not first.contains(record.key)
    assert stack.stats()["discarded"] == 1


def test_a_failed_write_names_the_whole_path(tmp_path):
    store = DiskStore(tmp_path / "kv")
    key = block_key(7)
    sub = os.path.join(store.path, key[:2])
    open(sub, "w").close()  # a file where its subfolder goes
    errors = store.put_many([small_record(key, 1.0)], strict=False).errors
    # The lookup before the write, then the write's own mkdir: each names the subfolder.
    assert [e.filename for e in errors] == [sub, sub], errors
