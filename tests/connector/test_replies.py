"""The connector against stores that answer wrongly: another block's record for a key, another
tenant's, a record of other tokens, answers of the wrong type or length, exceptions of any class.

Whatever a store answers, `load` copies only records that are the blocks their keys name, a
record that is not is discarded from the store (so `lookup` stops promising it and the next
`store` repairs it), and nothing a store does raises into a non-strict connector's calls.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from helpers import random_mha_pool, raw_rows
from hypothesis import HealthCheck, given, settings

from jaxkv.connector import BlockStore, HostStore, KVConnector
from jaxkv.errors import StoreReplyError

BS = 4


class Relabelling(HostStore):
    """A faulty store: `get_many` answers each key in `swap` with the record held under
    another key (say, the same tokens under another prefix, or another tenant's)."""

    def __init__(self):
        super().__init__(1 << 20)
        self.swap: dict[str, str] = {}
        self.discards: list[str] = []

    def get_many(self, keys, *, stop_at_miss=False, strict=None):
        keys = [self.swap.get(k, k) for k in keys]
        return super().get_many(keys, stop_at_miss=stop_at_miss, strict=strict)

    def contains_many(self, keys, *, stop_at_miss=False, strict=None):
        keys = [self.swap.get(k, k) for k in keys]
        return super().contains_many(keys, stop_at_miss=stop_at_miss, strict=strict)

    def discard(self, key):
        self.discards.append(key)
        self.swap.pop(key, None)
        return True


def test_a_record_served_under_another_key_is_never_loaded_and_is_discarded():
    store = Relabelling()
    pool = random_mha_pool()
    conn = KVConnector(pool, store, block_size=BS)
    a = np.array([1, 2, 3, 4, 9, 9, 9, 9])
    b = np.array([5, 6, 7, 8, 9, 9, 9, 9])  # its second block holds the same tokens as a's
    assert conn.store(pool, a, np.arange(1, 9)) == 2
    assert conn.store(pool, b[:BS], np.arange(11, 15)) == 1
    key_a, key_b = conn.block_hashes(a)[1], conn.block_hashes(b)[1]
    store.swap[key_b] = key_a  # b's second key answers a's second record
    assert conn.lookup(b) == 2 * BS  # the store claims it: lookup cannot see inside records

    before = raw_rows(pool, np.arange(40, 48))
    pool, n = conn.load(pool, b, np.arange(40, 48))
    assert n == BS  # the chain ends where the record stops being b's
    assert np.array_equal(raw_rows(pool, np.arange(44, 48)), before[:, BS:])  # untouched
    assert store.discards == [key_b]
    stats = conn.stats()
    assert stats["verification_failures"] == 1 and stats["discarded"] == 1
    assert conn.lookup(b) == BS  # the discarded key is no longer promised


def test_another_tenants_record_is_never_loaded():
    store = Relabelling()
    pool = random_mha_pool()
    conn = KVConnector(pool, store, block_size=BS)
    tokens = np.arange(2 * BS)
    assert conn.store(pool, tokens, np.arange(1, 9), salt="tenant-a") == 2
    for mine, theirs in zip(
        conn.block_hashes(tokens, salt="tenant-b"), conn.block_hashes(tokens, salt="tenant-a")
    ):
        store.swap[mine] = theirs
    pool, n = conn.load(pool, tokens, np.arange(20, 28), salt="tenant-b")
    assert n == 0
    assert conn.stats()["verification_failures"] == 1


def test_a_record_of_other_tokens_under_the_right_key_is_discarded_then_repaired():
    pool = random_mha_pool()
    store = HostStore(1 << 20)
    conn = KVConnector(pool, store, block_size=BS)
    tokens = np.arange(2 * BS)
    other = tokens + 100
    # A record with the right key but the token digest of other tokens (a store's bug, or
    # a hash collision's effect): planted by storing `other` and renaming its records.
    spy = KVConnector(pool, HostStore(1 << 20), block_size=BS)
    spy.store(pool, other, np.arange(1, 9))
    for key, wrong in zip(conn.block_hashes(tokens), spy.block_hashes(other)):
        record = spy.backend.get(wrong)
        store.put(type(record)(key, record.layout, record.tokens, dict(record.parts)))
    assert conn.lookup(tokens) == 2 * BS
    pool, n = conn.load(pool, tokens, np.arange(20, 28))
    assert n == 0
    st_ = conn.stats()
    assert st_["verification_failures"] == 1
    # Removed where the store can remove it; counted where it cannot.
    assert st_["discarded"] + st_["store"].get("undiscarded", 0) == 1
    if st_["discarded"]:
        assert conn.lookup(tokens) == 0
        assert conn.store(pool, tokens, np.arange(1, 9)) >= 1  # repaired
        pool, n = conn.load(pool, tokens, np.arange(20, 28))
        assert n >= BS


class Garbage(BlockStore):
    """A store whose every answer is `reply` (or raises it, when it is an exception)."""

    def __init__(self, reply):
        super().__init__()
        self.reply = reply

    def _answer(self):
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply() if callable(self.reply) else self.reply

    def contains(self, key):
        return self._answer()

    def get(self, key):
        return self._answer()

    def put(self, record):
        return self._answer()

    def contains_many(self, keys, *, stop_at_miss=False, strict=None):
        return self._answer()

    def get_many(self, keys, *, stop_at_miss=False, strict=None):
        return self._answer()

    def put_many(self, records, *, strict=None):
        return self._answer()

    def discard(self, key):
        return self._answer()

    def stats(self):
        return self._answer()

    def __len__(self):
        return 0


REPLIES = [
    None,
    0,
    1,
    "yes",
    b"\x00",
    [],
    [True],
    [None],
    [1, 0, 1],
    ["record"],
    {"hits": 1},
    (x for x in [True, True]),
    lambda: [True] * 1000,
    ValueError("bad value"),
    TypeError("bad type"),
    KeyError("k"),
    AttributeError("no such thing"),
    IndexError("out of range"),
    OSError("disk gone"),
    RuntimeError("store bug"),
]


def _serve_through(store) -> KVConnector:
    pool = random_mha_pool()
    conn = KVConnector(pool, store, block_size=BS)
    tokens, slots = np.arange(3 * BS), np.arange(1, 3 * BS + 1)
    before = raw_rows(pool, np.arange(30, 42))
    # A list of 3 bools is a well-formed answer to `contains_many`: lookup may believe it.
    assert conn.lookup(tokens) in (0, BS, 2 * BS, 3 * BS)
    assert conn.store(pool, tokens, slots) == 0
    conn.store_async(pool, tokens, slots).result()
    conn.flush()
    pool, n = conn.load(pool, tokens, np.arange(30, 42))
    assert n == 0
    assert np.array_equal(raw_rows(pool, np.arange(30, 42)), before)
    stats = conn.stats()
    assert isinstance(stats["store"], dict)
    # No answer is well-formed for both `contains_many` (bools) and `get_many` (records).
    assert stats["io_errors"] >= 1
    return conn


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_no_store_answer_raises_into_a_lenient_connector(reply):
    _serve_through(Garbage(reply))


@pytest.mark.parametrize("reply", [None, 0, "yes", [1, 0], ValueError("bad"), KeyError("k")])
def test_a_strict_connector_raises_a_malformed_answer_as_a_store_error(reply):
    pool = random_mha_pool()
    conn = KVConnector(pool, Garbage(reply), block_size=BS, strict=True)
    with pytest.raises(StoreReplyError) as info:
        conn.lookup(np.arange(2 * BS))
    assert isinstance(info.value, OSError)
    assert "Garbage" in str(info.value)


_ANSWERS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 2),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.lists(
        st.one_of(st.none(), st.booleans(), st.integers(0, 1), st.text(max_size=1)), max_size=4
    ),
    st.dictionaries(st.text(max_size=3), st.one_of(st.integers(), st.text(max_size=2)), max_size=3),
    st.sampled_from([ValueError("v"), TypeError("t"), OSError("o"), LookupError("l")]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reply=_ANSWERS)
def test_fuzzed_store_answers_never_raise_and_never_load(reply):
    _serve_through(Garbage(reply))


def test_after_a_failing_store_a_good_one_round_trips_bit_exact():
    pool = random_mha_pool()
    tokens, slots = np.arange(2 * BS), np.arange(1, 2 * BS + 1)
    bad = KVConnector(pool, Garbage([7]), block_size=BS)
    assert bad.store(pool, tokens, slots) == 0
    good = KVConnector(pool, HostStore(1 << 20), block_size=BS)
    assert good.store(pool, tokens, slots) == 2
    want = raw_rows(pool, slots)
    pool, n = good.load(pool, tokens, np.arange(40, 48))
    assert n == 2 * BS and np.array_equal(raw_rows(pool, np.arange(40, 48)), want)


@pytest.mark.parametrize("store", [None, {}, "redis://localhost:6379/0", HostStore])
def test_a_store_that_is_not_a_block_store_is_refused_at_construction(store):
    with pytest.raises(TypeError, match=r"store: expected a BlockStore .* got"):
        KVConnector(random_mha_pool(), store)


@pytest.mark.parametrize("strict", [1, 0, "no", None])
def test_strict_must_be_a_bool(strict):
    with pytest.raises(TypeError, match="strict: expected a bool"):
        KVConnector(random_mha_pool(), HostStore(1 << 20), strict=strict)


@pytest.mark.parametrize("name", ["namespace", "shard"])
def test_names_utf8_cannot_encode_are_refused_at_construction(name):
    with pytest.raises(ValueError, match=f"{name}: expected a str UTF-8 can encode"):
        KVConnector(random_mha_pool(), HostStore(1 << 20), **{name: "tenant-\ud800"})
    with pytest.raises(TypeError, match=f"{name}: expected a str"):
        KVConnector(random_mha_pool(), HostStore(1 << 20), **{name: 3})


def test_a_salt_utf8_cannot_encode_is_a_value_error_naming_the_salt():
    conn = KVConnector(random_mha_pool(), HostStore(1 << 20), block_size=BS)
    tokens = np.arange(BS)
    for call in (conn.block_hashes, conn.lookup):
        with pytest.raises(ValueError, match="salt: expected a str UTF-8 can encode"):
            call(tokens, salt="tenant-\ud800")
    with pytest.raises(ValueError, match="salt"):
        conn.store(random_mha_pool(), tokens, np.arange(1, BS + 1), salt="tenant-\ud800")
    assert len(conn.backend) == 0
