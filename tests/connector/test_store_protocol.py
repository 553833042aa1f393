"""The store protocol: each `*_result` method takes the caller's strictness and returns a
`StoreResult` (the answers, and the failures the store counted and logged); a strict call stops
at its first failure and the caller raises it; `TieredStore` combines its tiers' results; the
connector decides strictness once per call and passes it down."""

from __future__ import annotations

import errno

import numpy as np
import pytest
from helpers import random_mha_pool

from jaxkv.connector import BlockRecord, BlockStore, DiskStore, HostStore, KVConnector, TieredStore
from jaxkv.connector.disk import FileOps
from jaxkv.connector.stores import StoreResult
from jaxkv.errors import StoreReplyError

BS = 4
TOKENS = np.arange(3 * BS)
SLOTS = np.arange(1, 3 * BS + 1)


class FullDisk(FileOps):
    """A disk with room for `room` more record files; later writes fail with ENOSPC."""

    def __init__(self, room: int):
        self.room = room

    def write(self, path: str, data: bytes, fsync: bool) -> None:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        self.room -= 1
        super().write(path, data, fsync)


class Undeletable(FileOps):
    """A folder where this process may not remove files."""

    def unlink(self, path: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", path)


def _records(n: int, first: int = 0) -> list[BlockRecord]:
    return [
        BlockRecord(f"{i:064x}", "layout", "tokens", {"k": np.full((2, 4), i, np.float32)})
        for i in range(first, first + n)
    ]


# --------------------------------------------------------------------------------------------
# One store: the failures of a call come back with its answers


def test_a_lenient_write_reports_every_failure_it_counted(tmp_path):
    store = DiskStore(tmp_path, _fs=FullDisk(2))
    result = store.put_many(_records(4), strict=False)
    assert result.values == [True, True, False, False]
    assert [e.errno for e in result.errors] == [errno.ENOSPC, errno.ENOSPC]
    st = store.stats()
    assert (st["io_errors"], st["blocks_stored"], len(store)) == (2, 2, 2)
    assert result.answer(strict=False) == result.values  # a lenient caller raises nothing


def test_a_strict_write_stops_at_its_first_failure_and_says_what_landed(tmp_path):
    store = DiskStore(tmp_path, _fs=FullDisk(2))
    result = store.put_many(_records(4), strict=True)
    assert result.values == [True, True, False, False]  # the fourth was never tried
    (error,) = result.errors
    assert error.errno == errno.ENOSPC and store.stats()["io_errors"] == 1
    with pytest.raises(OSError) as raised:
        result.answer(strict=True)
    assert raised.value is error
    # The plain method of a strict store is the same call, raised.
    store.strict = True
    with pytest.raises(OSError, match="No space"):
        store.put_many(_records(1, first=8)).answer(True)
    assert store.stats()["io_errors"] == 2 and len(store) == 2


def test_upkeep_after_a_landed_write_is_counted_but_no_failure_of_the_call(tmp_path):
    probe = DiskStore(tmp_path / "probe")
    probe.put(_records(1)[0])
    store = DiskStore(tmp_path / "blocks", capacity_bytes=2 * probe.nbytes, _fs=Undeletable())
    result = store.put_many(_records(4), strict=True)
    assert result.values == [True] * 4 and result.errors == ()  # every record landed
    st = store.stats()
    assert st["io_errors"] >= 2 and st["evictions"] == 0  # the evictions failed, counted


@pytest.mark.parametrize("stack", [False, True])
@pytest.mark.parametrize(
    "call",
    [
        lambda store: store.put_many([], strict="no"),
        lambda store: store.get_many([], strict=1),
        lambda store: store.contains_many([], strict=0),
        lambda store: store.discard_many([f"{0:064x}"], strict="yes"),
    ],
)
def test_batches_take_strictness_as_a_bool(tmp_path, stack, call):
    store = DiskStore(tmp_path)
    with pytest.raises(TypeError, match="strict: expected a bool"):
        call(TieredStore(HostStore(1 << 20), store) if stack else store)


# --------------------------------------------------------------------------------------------
# TieredStore: its tiers' results, combined


def test_a_stack_combines_its_tiers_results(tmp_path):
    host, disk = HostStore(1 << 20), DiskStore(tmp_path, _fs=FullDisk(1))
    stack = TieredStore(host, disk)
    lenient = stack.put_many(_records(3), strict=False)
    assert lenient.values == [True] * 3  # stored: the host tier took each
    assert len(lenient.errors) == 2 and stack.stats()["io_errors"] == 2  # the disk's, once
    strict = stack.put_many(_records(3, first=3), strict=True)
    assert strict.values == [True] * 3 and len(strict.errors) == 1  # the disk stopped at once
    assert stack.stats()["blocks_stored"] == 6 and len(disk) == 1


class RaisingTier(BlockStore):
    """A store that raises its read failures rather than reporting them."""

    def contains(self, key):
        raise OSError(errno.EIO, "Input/output error")

    def get(self, key):
        raise OSError(errno.EIO, "Input/output error")

    def put(self, record):
        return False

    def __len__(self):
        return 0


def test_a_tier_that_raises_fails_the_stack_and_a_lenient_read_goes_on(tmp_path):
    (record,) = _records(1)
    slow = HostStore(1 << 20)
    slow.put(record)
    stack = TieredStore(RaisingTier(), slow)
    lenient = stack.get_many([record.key], strict=False)
    assert lenient.values[0].key == record.key  # the next tier answered
    assert [e.errno for e in lenient.errors] == [errno.EIO]
    st = stack.stats()
    assert (st["io_errors"], st["hits"], st["tiers"][0]["io_errors"]) == (1, 1, 0)  # the stack's
    strict = stack.get_many([record.key], strict=True)
    assert strict.values == [None] and len(strict.errors) == 1
    assert stack.stats()["hits"] == 1 and slow.stats()["hits"] == 1  # nothing more was read
    stack.strict = True  # the plain methods of a strict stack raise it
    with pytest.raises(OSError, match="Input/output"):
        stack.contains(record.key)


def test_a_stack_discard_asks_every_tier_and_reports_each_failure(tmp_path):
    first = DiskStore(tmp_path / "a", _fs=Undeletable())
    second = DiskStore(tmp_path / "b", _fs=Undeletable())
    (record,) = _records(1)
    stack = TieredStore(first, second)
    assert stack.put(record)
    result = stack.discard_many([record.key], strict=True)
    assert result.values == [False] and [type(e) for e in result.errors] == [PermissionError] * 2
    assert (first.stats()["io_errors"], second.stats()["io_errors"]) == (1, 1)
    assert not first.contains(record.key) and not second.contains(record.key)  # never promised


# --------------------------------------------------------------------------------------------
# The connector: strictness decided once per call, failures read from the result


class Recording(HostStore):
    """A host store that notes the strictness each batch call was given."""

    def __init__(self):
        super().__init__(1 << 20, preallocate_bytes=0)
        self.given: list[bool] = []

    def contains_many(self, keys, *, stop_at_miss=False, strict=None):
        self.given.append(strict)
        return super().contains_many(keys, stop_at_miss=stop_at_miss, strict=strict)

    def get_many(self, keys, *, stop_at_miss=False, strict=None):
        self.given.append(strict)
        return super().get_many(keys, stop_at_miss=stop_at_miss, strict=strict)

    def put_many(self, records, *, strict=None):
        self.given.append(strict)
        return super().put_many(records, strict=strict)


@pytest.mark.parametrize(
    "connector_strict, store_strict, given",
    [(False, False, False), (True, False, True), (False, True, True)],
)
def test_the_connector_passes_the_strictness_it_decided(connector_strict, store_strict, given):
    pool = random_mha_pool()
    store = Recording()
    store.strict = store_strict
    conn = KVConnector(pool, store, block_size=BS, strict=connector_strict)
    assert conn.store(pool, TOKENS, SLOTS) == 3
    assert conn.lookup(TOKENS) == 3 * BS
    assert conn.load(pool, TOKENS, SLOTS + 20)[1] == 3 * BS
    assert len(store.given) == 4 and set(store.given) == {given}  # held, put, held, get


class HalfWrites(HostStore):
    """Stores the first half of every batch and reports a failure for the rest."""

    def put_many(self, records, *, strict=None):
        half = len(records) // 2
        stored = super().put_many(records[:half], strict=strict).values
        self._count("io_errors")  # a reported failure is counted by the store that met it
        return StoreResult(stored + [False] * (len(records) - half), (OSError("half full"),))


@pytest.mark.parametrize("strict", [False, True])
def test_what_a_failing_write_stored_is_counted_from_its_result(strict):
    pool = random_mha_pool()
    tokens, slots = np.arange(4 * BS), np.arange(1, 4 * BS + 1)
    store = HalfWrites(1 << 20)
    conn = KVConnector(pool, store, block_size=BS, strict=strict)
    if strict:
        with pytest.raises(OSError, match="half full"):
            conn.store(pool, tokens, slots)
    else:
        assert conn.store(pool, tokens, slots) == 2
    st = conn.stats()
    assert st["blocks_stored"] == st["store"]["blocks_stored"] == len(store) == 2
    assert st["io_errors"] == st["store"]["io_errors"] == 1  # counted once, by the store


class MalformedResults(HostStore):
    def __init__(self, result):
        super().__init__(1 << 20, preallocate_bytes=0)
        self.result = result

    def get_many(self, keys, *, stop_at_miss=False, strict=None):
        return self.result


@pytest.mark.parametrize(
    "result", [None, StoreResult([None], ("not an error",)), StoreResult([None], [OSError()])]
)
def test_a_malformed_result_is_a_store_failure(result):
    pool = random_mha_pool()
    lenient = KVConnector(pool, MalformedResults(result), block_size=BS)
    lenient.store(pool, TOKENS[:BS], SLOTS[:BS])
    assert lenient.load(pool, TOKENS[:BS], SLOTS[:BS] + 20)[1] == 0
    assert lenient.stats()["io_errors"] == 1
    strict = KVConnector(pool, MalformedResults(result), block_size=BS, strict=True)
    strict.store(pool, TOKENS[:BS], SLOTS[:BS])
    with pytest.raises(StoreReplyError, match="StoreResult"):
        strict.load(pool, TOKENS[:BS], SLOTS[:BS] + 20)


class PlainBatches(HostStore):
    """A store whose batches answer plain lists, as batches did before they reported their
    failures: its answers are the values, with no failure reported."""

    def contains_many(self, keys, *, stop_at_miss=False, strict=None):
        return super().contains_many(keys, stop_at_miss=stop_at_miss, strict=strict).values

    def get_many(self, keys, *, stop_at_miss=False, strict=None):
        return tuple(super().get_many(keys, stop_at_miss=stop_at_miss, strict=strict).values)

    def put_many(self, records, *, strict=None):
        return super().put_many(records, strict=strict).values


@pytest.mark.parametrize("stacked", [False, True])
def test_batches_answering_plain_lists_serve_the_connector(stacked):
    pool = random_mha_pool()
    store = PlainBatches(1 << 20, preallocate_bytes=0)
    backend = TieredStore(HostStore(1 << 20, preallocate_bytes=0), store) if stacked else store
    conn = KVConnector(pool, backend, block_size=BS, strict=True)
    assert conn.store(pool, TOKENS, SLOTS) == 3
    assert conn.lookup(TOKENS) == 3 * BS
    new, n = conn.load(pool, TOKENS, SLOTS + 20)
    assert n == 3 * BS
    assert conn.stats()["io_errors"] == 0
