"""`RedisStore` against a server that answers what Redis never answers.

A scriptable fake server (`fake_resp.FakeRedis`, on loopback) answers chosen commands with every
RESP2 type, wrong types for the command, non-numeric integers, nested and absurdly deep arrays,
garbage, cut replies, closed connections, huge declared lengths and tails that arrive late.
Each public method of the store (and a `TieredStore` and a `KVConnector` over it) must then
raise nothing, answer misses or dropped writes (never a wrong record), count the failure,
and answer right again once the server behaves. Also: values of another type under a block
key, `discard`, and exceptions that are not the server's doing.

Needs redis-py, not `redis-server`. Without redis-py these tests skip (fail under CI).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time

import numpy as np
import pytest
from fake_resp import (
    NULL_ARRAY,
    NULL_BULK,
    FakeRedis,
    Reply,
    array,
    bulk,
    error,
    integer,
    simple,
)
from helpers import random_connector_pool, row_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv.connector import HostStore, KVConnector, RedisStore, TieredStore, _records
from jaxkv.connector._records import BlockRecord

try:
    import redis  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("redis-py is not installed (`pip install 'jaxkv[redis]'`)", allow_module_level=True)

PREFIX = "t:"
# Commands redis-py sends to set a connection up: the scripts leave them to the fake server.
HANDSHAKE = {b"CLIENT", b"HELLO", b"SELECT", b"PING", b"AUTH"}
# Waits of the breaker in these tests: short, so that healing takes one short sleep.
RETRY_S = 0.005


@pytest.fixture(scope="module")
def server():
    with FakeRedis() as fake:
        yield fake


@pytest.fixture
def fake(server):
    """The module's server, behaving and empty."""
    _reset(server)
    yield server
    _reset(server)


def _reset(server: FakeRedis) -> None:
    server.script = None
    server.oom = False
    server.data.clear()
    server.commands.clear()


def _record(i: int) -> BlockRecord:
    key = hashlib.sha256(f"block {i}".encode()).hexdigest()
    parts = {"k": (np.arange(8, dtype=np.float32) + i).reshape(1, 2, 4)}
    return BlockRecord(key, "fake-layout", f"tokens {i}", parts)


RECORDS = [_record(i) for i in range(4)]


def _store(server: FakeRedis, **kwargs) -> RedisStore:
    # A generous timeout: no reply of these tests makes the client wait (cut replies close the
    # connection) except those that test waiting, which set their own.
    kwargs = {"timeout_s": 2.0, "retry_after_s": RETRY_S, "max_retry_after_s": RETRY_S, **kwargs}
    return RedisStore(server.url, key_prefix=PREFIX, **kwargs)


def _same(a: BlockRecord | None, b: BlockRecord) -> bool:
    return (
        a is not None
        and (a.key, a.layout, a.tokens) == (b.key, b.layout, b.tokens)
        and a.parts.keys() == b.parts.keys()
        and all(np.array_equal(a.parts[n], b.parts[n]) for n in b.parts)
    )


def _on_data(reply):
    """A script answering every command but the handshake with `reply`."""
    return lambda args: None if args[0] in HANDSHAKE else reply


def _heals(store: RedisStore, server: FakeRedis, record: BlockRecord = RECORDS[3]) -> None:
    """Once the server behaves (and the breaker's short wait is over), the same store answers
    right: a garbled reply left nothing behind that a later call reads as its own."""
    server.script = None
    server.data.clear()
    time.sleep(3 * RETRY_S)
    assert store.contains_many([record.key]).values == [False]
    assert store.put_many([record]).values == [True]
    assert store.contains_many([record.key]).values == [True]
    assert _same(store.get_many([record.key]).values[0], record)
    # At least that block: the server may still run commands a failed call had sent, as a
    # real one runs whatever it received before the client hung up.
    assert store.stats()["blocks"] >= 1


def _delta(before: dict, after: dict, name: str) -> int:
    return after[name] - before[name]


# The calls of the store, each with what a failed call answers.
def _calls(store: RedisStore):
    keys = [r.key for r in RECORDS[:2]]
    return {
        "contains_many": (lambda: store.contains_many(keys).values, [False, False]),
        "contains_many_stop": (
            lambda: store.contains_many(keys, stop_at_miss=True).values,
            [False] * 2,
        ),
        "get_many": (lambda: store.get_many(keys).values, [None, None]),
        "get_many_stop": (lambda: store.get_many(keys, stop_at_miss=True).values, [None, None]),
        "put_many": (lambda: store.put_many(RECORDS[:2]).values, [False, False]),
        "len": (lambda: len(store), 0),
        "nbytes": (lambda: store.nbytes, 0),
        "stats": (
            lambda: {k: store.stats()[k] for k in ("blocks", "bytes")},
            {"blocks": 0, "bytes": 0},
        ),
        "discard": (lambda: store.discard(keys[0]), False),
    }


METHODS = list(_calls(None))

# Replies no Redis server gives to any command the store sends.
GARBAGE = {
    "non-numeric integer": integer("abc"),
    "empty integer": integer(""),
    "float integer": integer("1.5"),
    "array of integers": array(integer(1), integer(2)),
    "nested arrays": array(array(integer(1), bulk(b"x")), array()),
    "nested 5000 deep": b"*1\r\n" * 5000 + integer(1),
    "not RESP": b"HTTP/1.1 400 Bad Request\r\n",
    "RESP3 null": b"_\r\n",
    "RESP3 map": b"%1\r\n+a\r\n:1\r\n",
    "RESP3 boolean": b"#t\r\n",
    "huge negative integer": integer("-" + "9" * 5000),
    "cut bulk string": Reply(b"$10\r\nabc", close=True),
    "cut array": Reply(b"*3\r\n:1\r\n", close=True),
    "huge declared bulk": Reply(b"$99999999999\r\nabc", close=True),
    "huge declared array": Reply(b"*99999999\r\n:1\r\n", close=True),
    "negative bulk length": Reply(b"$-5\r\n", close=True),
    "closed at once": Reply(close=True),
    "garbage bytes": Reply(bytes(range(256)), close=True),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(GARBAGE))
def test_a_reply_no_server_gives_is_an_io_failure_of_every_method(fake, method, name):
    store = _store(fake)
    call, failed = _calls(store)[method]
    before = store.stats()
    fake.script = _on_data(GARBAGE[name])
    assert call() == failed
    after = store.stats()  # the breaker is open: answered without the network
    assert _delta(before, after, "io_errors") >= 1
    assert _delta(before, after, "breaker_trips") >= 1
    assert after["hits"] == after["blocks_stored"] == 0
    _heals(store, fake)


def test_ok_to_everything_is_read_as_failures_and_a_damaged_value(fake, caplog):
    """A proxy answering `+OK` to every command: OK is the answer of a store (`SET`), the
    bytes "OK" are a damaged value for `GET` (deleted), and nothing else takes it."""
    store = _store(fake)
    key = RECORDS[0].key
    fake.script = _on_data(simple("OK"))
    answers = []
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        for call in (
            lambda: store.contains_many([key]).values,
            lambda: store.get_many([key]).values,
            lambda: store.put_many(RECORDS[:1]).values,
            lambda: len(store),
            lambda: store.nbytes,
            lambda: store.discard(key),
        ):
            answers.append(call())
            time.sleep(3 * RETRY_S)  # past the breaker's wait: each call reaches the server
        stats = store.stats()
    assert answers == [[False], [None], [True], 0, 0, False]
    assert stats["verification_failures"] == 1  # the bytes GET returned
    # STRLEN, the DEL of the damaged value, DBSIZE (len, nbytes, stats), DEL (discard).
    assert stats["io_errors"] == 6
    assert stats["blocks"] == stats["bytes"] == 0
    logged = [r.getMessage() for r in caplog.records if r.name == "jaxkv"]
    damaged = [m for m in logged if m.startswith(f"RedisStore: the record of key {key} ")]
    assert len(damaged) == 1 and "failed verification" in damaged[0], logged
    assert logged and all(
        m.startswith("RedisStore: server reply failed") for m in logged if m not in damaged
    )
    _heals(store, fake)


def test_get_and_mget_answered_with_integers_are_misses(fake):
    store = _store(fake)
    assert store.put_many(RECORDS[:2]).values == [True, True]
    fake.script = lambda args: integer(5) if args[0] in (b"GET", b"MGET") else None
    assert store.get_many([r.key for r in RECORDS[:2]]).values == [None, None]
    assert store.stats()["io_errors"] == 1
    fake.script = None
    time.sleep(3 * RETRY_S)
    assert all(
        _same(*pair) for pair in zip(store.get_many([r.key for r in RECORDS[:2]]).values, RECORDS)
    )


def test_a_late_tail_of_a_garbled_reply_is_not_read_by_the_next_call(fake):
    """The server answers one lookup with a bulk string where an integer belongs, and the
    integer `1` half a second later. The connection it came on is closed: the next lookup, on
    a fresh connection, reads its own answer, not that `1`."""
    store = _store(fake)
    state = {"sent": False}

    def script(args):
        if args[0] in HANDSHAKE or state["sent"]:
            return None
        state["sent"] = True
        return Reply(bulk(b"OK"), later=integer(1), delay=0.5)

    fake.script = script
    assert store.contains_many([RECORDS[0].key]).values == [False]
    assert store.stats()["io_errors"] == 1
    time.sleep(3 * RETRY_S)
    assert store.contains_many([RECORDS[1].key]).values == [False]  # not held: not the stale `1`
    assert store.put_many(RECORDS[1:2]).values == [True]
    assert store.contains_many([RECORDS[1].key]).values == [True]
    assert store.stats()["io_errors"] == 1


def test_a_reply_cut_and_left_hanging_costs_the_timeout_then_heals(fake):
    store = _store(fake, timeout_s=0.3)
    fake.script = _on_data(Reply(b"$100\r\nabc", hang=True))
    assert store.get_many([RECORDS[0].key]).values == [None]
    stats = store.stats()
    assert stats["io_errors"] >= 1 and stats["breaker_trips"] >= 1
    # Healed: a 0.3 s timeout can fire on a loaded machine, so a few tries, never wrong data.
    fake.script, deadline = None, time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(3 * RETRY_S)
        if (
            store.put_many(RECORDS[:1]).values == [True]
            or store.contains_many([RECORDS[0].key]).values[0]
        ):
            break
    got = store.get_many([RECORDS[0].key]).values[0]
    assert got is None or _same(got, RECORDS[0])
    assert fake.data.get((PREFIX + RECORDS[0].key).encode()) == _records.encode(RECORDS[0])


def test_the_store_speaks_resp2_to_a_server_without_hello(fake):
    """Redis before 6 and many proxies know no `HELLO` (the fake answers it an error, as they
    do): the store must not need it, whatever redis-py's default protocol."""
    store = _store(fake)
    assert store.put_many(RECORDS[:1]).values == [True]
    assert _same(store.get_many([RECORDS[0].key]).values[0], RECORDS[0])
    assert b"HELLO" not in {c[0] for c in fake.commands}
    assert store.stats()["io_errors"] == 0


# --------------------------------------------------------------------------------------------
# Errors the server answers to one command


@pytest.mark.parametrize(
    "reply,trips",
    [
        (error("ERR unknown command"), False),
        (error("READONLY You can't write against a read only replica."), False),
        (error("NOPERM this user has no permissions"), False),
        (error("LOADING Redis is loading the dataset in memory"), True),  # the server is down
    ],
)
def test_an_error_reply_fails_its_command_and_only_a_down_server_trips(fake, caplog, reply, trips):
    store = _store(fake, retry_after_s=60, max_retry_after_s=60)
    fake.script = _on_data(reply)
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        assert store.contains_many([RECORDS[0].key]).values == [False]
        assert store.get_many([RECORDS[0].key]).values == [None]
        assert store.put_many(RECORDS[:1]).values == [False]
        assert store.discard(RECORDS[0].key) is False
    stats = store.stats()
    assert stats["breaker_trips"] == (1 if trips else 0)
    assert stats["io_errors"] == (1 if trips else 5)  # then answered by the open breaker
    assert stats["dropped"] == 1 and stats["rejected"] == 0
    kind = "server call" if trips else "server command"
    logged = [r.getMessage() for r in caplog.records if r.name == "jaxkv"]
    assert logged and all(m.startswith(f"RedisStore: {kind} failed") for m in logged)


def test_out_of_memory_is_a_rejected_write_not_an_io_failure(fake):
    store = _store(fake)
    fake.oom = True
    assert store.put_many(RECORDS[:2]).values == [False, False]
    stats = store.stats()
    assert (stats["rejected"], stats["dropped"], stats["io_errors"]) == (2, 2, 0)
    fake.oom = False
    assert store.put_many(RECORDS[:2]).values == [True, True]


def test_stats_of_a_server_without_used_memory_is_an_io_failure(fake):
    store = _store(fake)
    fake.script = lambda args: bulk(b"# Memory\r\n") if args[0] == b"INFO" else None
    assert store.put_many(RECORDS[:1]).values == [True]
    stats = store.stats()
    assert (stats["blocks"], stats["bytes"], stats["io_errors"], stats["breaker_trips"]) == (
        0,
        0,
        1,
        0,
    )


# --------------------------------------------------------------------------------------------
# Values of another type under a block key


@pytest.mark.parametrize("found_by", ["contains_many", "get_many"])
def test_a_key_of_another_type_is_no_block_and_is_deleted_so_a_store_repairs_it(fake, found_by):
    store = _store(fake)
    record = RECORDS[0]
    name = (PREFIX + record.key).encode()
    fake.data[name] = [b"a list", b"not a record"]
    if found_by == "contains_many":
        assert store.contains_many([record.key]).values == [False]
    else:
        assert store.get_many([record.key], stop_at_miss=True).values == [None]
    assert name not in fake.data
    stats = store.stats()
    assert (stats["verification_failures"], stats["io_errors"]) == (1, 0)
    assert stats["round_trips"] == 2  # the reads, then the DEL of what was damaged
    assert store.put_many([record]).values == [True]
    assert store.contains_many([record.key]).values == [True]
    assert _same(store.get_many([record.key]).values[0], record)


def test_lookup_reports_only_strings_and_reads_use_per_key_commands(fake):
    """One round trip per call; a list between two blocks ends a prefix lookup there."""
    store = _store(fake)
    assert store.put_many([RECORDS[0], RECORDS[2]]).values == [True, True]
    fake.data[(PREFIX + RECORDS[1].key).encode()] = [b"x"]
    keys = [r.key for r in RECORDS[:3]]
    fake.commands.clear()
    assert store.contains_many(keys, stop_at_miss=True).values == [True, False, False]
    sent = [c[0] for c in fake.commands if c[0] not in HANDSHAKE]
    assert sent == [b"STRLEN"] * 3 + [b"DEL"]
    got = store.get_many(keys).values
    assert _same(got[0], RECORDS[0]) and got[1] is None and _same(got[2], RECORDS[2])


# --------------------------------------------------------------------------------------------
# discard


def test_discard_deletes_counts_and_never_raises(fake):
    store = _store(fake)
    assert store.put_many(RECORDS[:1]).values == [True]
    assert store.discard(RECORDS[0].key) is True
    assert (PREFIX + RECORDS[0].key).encode() not in fake.data
    assert store.discard(RECORDS[0].key) is False  # nothing left
    assert store.contains_many([RECORDS[0].key]).values == [False]
    assert store.put_many(RECORDS[:1]).values == [True]  # the next store writes the block again
    stats = store.stats()
    assert (stats["discarded"], stats["undiscarded"], stats["io_errors"]) == (1, 0, 0)
    fake.script = _on_data(integer("abc"))
    store.strict = True  # even strict: RedisStore never raises the server's failures
    assert store.discard(RECORDS[0].key) is False
    assert store.discard(RECORDS[0].key) is False  # the breaker is open: no network
    stats = store.stats()
    assert (stats["discarded"], stats["unavailable"]) == (1, 1)
    assert stats["io_errors"] >= 1


# --------------------------------------------------------------------------------------------
# Not the server's doing


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_exceptions_of_this_process_propagate_and_leave_the_store_working(fake, monkeypatch, exc):
    import redis.connection

    store = _store(fake)
    assert store.put_many(RECORDS[:1]).values == [True]
    real = redis.connection.Connection.read_response
    raised = []

    def read_response(self, *args, **kwargs):
        if not raised:
            raised.append(exc)
            raise exc()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.Connection, "read_response", read_response)
    with pytest.raises(exc):
        store.contains_many([RECORDS[0].key])  # its `STRLEN` reply is left unread
    assert store.stats()["io_errors"] == 0
    assert store.contains_many([RECORDS[1].key]).values == [False]  # not the unread reply
    assert store.contains_many([RECORDS[0].key]).values == [True]


# --------------------------------------------------------------------------------------------
# Fuzzing the replies of each method

SAFE_TEXT = st.text(st.characters(blacklist_characters="\r\n", codec="utf-8"), max_size=12)


def _complete() -> st.SearchStrategy[tuple]:
    """Whole RESP2 values (tagged, so that the test knows what it sent)."""
    leaves = st.one_of(
        st.just(("valid",)),
        st.just(("null_bulk",)),
        st.just(("null_array",)),
        st.tuples(st.just("simple"), st.sampled_from(["OK", "PONG", "QUEUED", ""]) | SAFE_TEXT),
        st.tuples(
            st.just("error"),
            st.sampled_from(
                ["ERR x", "WRONGTYPE x", "OOM x", "READONLY x", "LOADING x", "MOVED 1 h:1"]
            )
            | SAFE_TEXT,
        ),
        st.tuples(st.just("int"), st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, 2])),
        st.tuples(
            st.just("int_text"), st.sampled_from(["abc", "", "1.5", "0x10", "--1", "9" * 50])
        ),
        st.tuples(st.just("bulk"), st.binary(max_size=40)),
        st.just(("record_other",)),
        st.just(("record_damaged",)),
        st.tuples(st.just("deep"), st.sampled_from([3, 900, 4000])),
        st.tuples(
            st.just("resp3"), st.sampled_from([b"_\r\n", b"#f\r\n", b",1.5\r\n", b"(12\r\n"])
        ),
    )
    return st.recursive(
        leaves, lambda inner: st.tuples(st.just("array"), st.lists(inner, max_size=3)), max_leaves=6
    )


def _shapes() -> st.SearchStrategy[tuple]:
    """A reply for one command: a whole value, or one cut short / garbled, then a close."""
    return st.one_of(
        _complete(),
        _complete().flatmap(
            lambda s: st.tuples(st.just("cut"), st.just(s), st.integers(0, 1 << 16))
        ),
        st.just(("close",)),
        st.tuples(st.just("garbage"), st.binary(min_size=1, max_size=30)),
        st.tuples(
            st.just("huge"), st.sampled_from([b"$99999999999\r\nab", b"*999999999\r\n:1\r\n"])
        ),
        st.tuples(st.just("negative"), st.sampled_from([b"$-7\r\n", b"$-2\r\nab"])),
    )


def _key_of(args: list[bytes]) -> str | None:
    if len(args) > 1 and args[1].startswith(PREFIX.encode()):
        return args[1][len(PREFIX) :].decode()
    return None


BY_KEY = {r.key: r for r in RECORDS}


def _encode(shape: tuple, args: list[bytes]) -> bytes:
    """The bytes of a whole value `shape`, as the answer to `args`."""
    kind = shape[0]
    record = BY_KEY.get(_key_of(args) or "", RECORDS[0])
    if kind == "valid":
        return {
            b"STRLEN": integer(len(_records.encode(record))),
            b"GET": bulk(_records.encode(record)),
            b"SET": simple("OK"),
            b"DEL": integer(1),
            b"DBSIZE": integer(3),
            b"INFO": bulk(b"# Memory\r\nused_memory:4321\r\n"),
        }.get(args[0], simple("OK"))
    if kind == "null_bulk":
        return NULL_BULK
    if kind == "null_array":
        return NULL_ARRAY
    if kind == "simple":
        return simple(shape[1])
    if kind == "error":
        return error(shape[1] or "ERR")
    if kind in ("int", "int_text"):
        return integer(shape[1])
    if kind == "bulk":
        return bulk(shape[1])
    if kind == "record_other":
        other = RECORDS[(RECORDS.index(record) + 1) % len(RECORDS)]
        return bulk(_records.encode(other))
    if kind == "record_damaged":
        data = bytearray(_records.encode(record))
        data[len(data) // 2] ^= 0x10
        return bulk(bytes(data))
    if kind == "deep":
        return b"*1\r\n" * shape[1] + integer(1)
    if kind == "resp3":
        return shape[1]
    return array(*(_encode(item, args) for item in shape[1]))  # "array"


def _reply(shape: tuple, args: list[bytes]) -> Reply:
    kind = shape[0]
    if kind == "cut":
        whole = _encode(shape[1], args)
        return Reply(whole[: shape[2] % max(1, len(whole))], close=True)
    if kind == "close":
        return Reply(close=True)
    if kind in ("garbage", "huge", "negative"):
        return Reply(shape[1], close=True)
    return Reply(_encode(shape, args))


def _int_of(data: bytes) -> int | None:
    """The integer a Redis integer reply holds, or `None` when `data` is not one."""
    match = re.fullmatch(rb":(-?[0-9]+)\r\n", data)
    return int(match.group(1)) if match and len(match.group(1)) < 4000 else None


def _legit(shape: tuple, args: list[bytes]) -> str:
    """What Redis would mean by this reply to `args`: "yes" (held, stored, removed...), "no"
    (absent, already held, out of memory), "damaged" (another type under the key, or bytes
    that are no record of it) or "failed" (an error, or no reply Redis gives)."""
    if shape[0] in ("cut", "close", "garbage", "huge", "negative"):
        return "failed"
    data, name, n = _encode(shape, args), args[0], None
    n = _int_of(data)
    if name in (b"STRLEN", b"GET") and data.startswith(b"-WRONGTYPE"):
        return "damaged"
    if name == b"STRLEN" and n is not None:
        return "yes" if n > 0 else "no" if n == 0 else "failed"
    if name == b"GET":
        if data in (NULL_BULK, NULL_ARRAY):  # redis-py reads both as nil
            return "no"
        if shape[0] == "valid":
            return "yes"
        if data[:1] in (b"$", b"+"):
            return "damaged"
    if name == b"SET":
        if data in (b"+OK\r\n", b"$2\r\nOK\r\n"):
            return "yes"
        if data in (NULL_BULK, NULL_ARRAY) or data.startswith(b"-OOM "):
            return "no"
    if name == b"DEL" and n is not None:
        return "yes" if n == 1 else "no" if n == 0 else "failed"
    if name == b"DBSIZE" and n is not None and n >= 0:
        return "yes"
    if name == b"INFO" and shape[0] == "valid":
        return "yes"
    return "failed"


class _Script:
    """Answers the i-th data command with `shapes[i % len(shapes)]`, remembering what it
    answered per command."""

    def __init__(self, shapes):
        self.shapes, self.sent = shapes, []

    def __call__(self, args):
        if args[0] in HANDSHAKE:
            return None
        shape = self.shapes[len(self.sent) % len(self.shapes)]
        self.sent.append((args, shape))
        return _reply(shape, args)

    def judged(self, command: bytes, n: int) -> list[str]:
        """Per command `command` sent, in order, what its reply meant; "unanswered" for
        the commands of the call past a closed connection (padded to `n`)."""
        got = [_legit(shape, args) for args, shape in self.sent if args[0] == command]
        return got + ["unanswered"] * (n - len(got))


def _counters(store: RedisStore) -> dict[str, int]:
    """The store's counters without asking the server (as `stats()` would)."""
    with store._lock:
        return dict(store._counters)


FUZZ = settings(
    max_examples=5 * settings.default.max_examples,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _check_size(store: RedisStore, script: _Script) -> None:
    """`len`, `nbytes` and `stats()`: each the server's figure when both replies of its round
    trip (`DBSIZE`, `INFO memory`) are, else 0 and an I/O failure."""
    for call, figure in (
        (lambda: len(store), lambda dbsize: dbsize),
        (lambda: store.nbytes, lambda dbsize: 4321),
        (lambda: store.stats()["bytes"], lambda dbsize: 4321),
    ):
        script.sent.clear()
        before = _counters(store)
        got = call()
        judged = script.judged(b"DBSIZE", 1) + script.judged(b"INFO", 1)
        assert isinstance(got, int) and got >= 0
        if not script.sent:  # the breaker was open
            assert got == 0
        elif judged == ["yes", "yes"]:
            dbsize = next(_int_of(_encode(s, a)) for a, s in script.sent if a[0] == b"DBSIZE")
            assert got == figure(dbsize)
        else:
            assert got == 0
            assert _counters(store)["io_errors"] > before["io_errors"]


@FUZZ
@given(
    method=st.sampled_from(["contains_many", "get_many", "put_many", "size", "discard"]),
    shapes=st.lists(_shapes(), min_size=1, max_size=3),
    n_keys=st.integers(1, 3),
    stop_at_miss=st.booleans(),
)
def test_fuzzed_replies_never_raise_never_serve_wrong_records_and_heal(
    fake, method, shapes, n_keys, stop_at_miss
):
    """Whatever each command is answered: nothing raises; an answer is positive only where
    its reply was Redis's positive answer (a record only the one of the key asked); a
    failed reply is counted in `io_errors`, a damaged value in `verification_failures`; then
    the same store answers right once the server behaves."""
    _reset(fake)
    store = _store(fake)
    records = RECORDS[:n_keys]
    keys = [r.key for r in records]
    script = _Script(shapes)
    fake.script = script
    if method == "size":
        _check_size(store, script)
        _heals(store, fake)
        store.close()
        return
    if method == "contains_many":
        got = store.contains_many(keys, stop_at_miss=stop_at_miss).values
        judged = script.judged(b"STRLEN", n_keys)
        assert all(isinstance(g, bool) for g in got)
        assert all(j == "yes" for g, j in zip(got, judged) if g)
    elif method == "get_many":
        got = store.get_many(keys, stop_at_miss=stop_at_miss).values
        judged = script.judged(b"GET", n_keys)
        for record, asked, j in zip(got, records, judged):
            assert record is None or (j == "yes" and _same(record, asked))
    elif method == "put_many":
        got = store.put_many(records).values
        judged = script.judged(b"SET", n_keys)
        assert all(j == "yes" for g, j in zip(got, judged) if g)
    else:
        got = [store.discard(keys[0])]
        judged = script.judged(b"DEL", 1)[:1]
        assert got == [False] or judged == ["yes"]
    if method != "discard":
        assert len(got) == n_keys
    if stop_at_miss and method in ("contains_many", "get_many") and not all(got):
        first = [bool(g) for g in got].index(False)
        assert not any(got[first:])
    counters = _counters(store)
    first_bad = next((j for j in judged if j != "yes"), None)  # every store looks at it
    if first_bad in ("failed", "unanswered"):
        assert counters["io_errors"] >= 1, (judged, script.sent)
    if first_bad == "damaged" and not {"failed", "unanswered"} & set(judged):
        assert counters["verification_failures"] >= 1, (judged, script.sent)
    _heals(store, fake)
    store.close()


# --------------------------------------------------------------------------------------------
# Through a tiered stack and a connector


def _pool(seed: int):
    return random_connector_pool("mha", seed, size=64, page_size=1, dtype=np.float32)


CONNECTOR_GARBAGE = ["non-numeric integer", "nested arrays", "cut array", "closed at once"]


@pytest.mark.parametrize("name", CONNECTOR_GARBAGE)
def test_a_connector_over_a_garbling_server_raises_nothing_then_loads_exact(fake, name):
    pool, dst = _pool(1), _pool(2)
    store = _store(fake)
    conn = KVConnector(pool, store, block_size=4)
    tokens, slots = np.arange(12) + 7, np.arange(12)
    fake.script = _on_data(GARBAGE[name])
    before = row_bits(dst, np.arange(32, 44))
    assert conn.store(pool, tokens, slots) == 0
    assert conn.lookup(tokens) == 0
    dst, n = conn.load(dst, tokens, np.arange(32, 44))
    assert n == 0
    np.testing.assert_array_equal(row_bits(dst, np.arange(32, 44)), before)
    assert conn.store_async(pool, tokens + 100, slots).result(timeout=30) == 0
    conn.flush()
    stats = conn.stats()
    assert store.stats()["io_errors"] >= 1 and isinstance(stats, dict)
    strict = KVConnector(pool, store, block_size=4, strict=True)  # still nothing raised
    time.sleep(3 * RETRY_S)
    assert (strict.lookup(tokens), strict.store(pool, tokens, slots)) == (0, 0)
    assert strict.load(dst, tokens, np.arange(32, 44))[1] == 0
    fake.script = None
    time.sleep(3 * RETRY_S)
    assert conn.store(pool, tokens, slots) == 3
    assert conn.lookup(tokens) == 12
    dst, n = conn.load(dst, tokens, np.arange(32, 44))
    assert n == 12
    np.testing.assert_array_equal(row_bits(dst, np.arange(32, 44)), row_bits(pool, slots))


@pytest.mark.parametrize("name", CONNECTOR_GARBAGE)
def test_a_tiered_stack_over_a_garbling_server_serves_from_host_memory(fake, name):
    pool, dst = _pool(3), _pool(4)
    remote = _store(fake)
    stack = TieredStore(HostStore(1 << 20), remote)
    conn = KVConnector(pool, stack, block_size=4)
    tokens, slots = np.arange(12) + 11, np.arange(12)
    fake.script = _on_data(GARBAGE[name])
    assert conn.store(pool, tokens, slots) == 3  # host memory took them
    assert conn.lookup(tokens) == 12
    dst, n = conn.load(dst, tokens, np.arange(40, 52))
    assert n == 12
    np.testing.assert_array_equal(row_bits(dst, np.arange(40, 52)), row_bits(pool, slots))
    stats = stack.stats()
    assert stats["io_errors"] >= 1 and stats["tiers"][1]["blocks"] == 0
    # An empty host tier over the same server, once it behaves: it reads the blocks stored
    # there since, and promotes them.
    fake.script = None
    time.sleep(3 * RETRY_S)
    assert conn.store(pool, tokens + 1, slots) == 3
    reader = KVConnector(pool, TieredStore(HostStore(1 << 20), remote), block_size=4)
    dst, n = reader.load(dst, tokens + 1, np.arange(40, 52))
    assert n == 12
    np.testing.assert_array_equal(row_bits(dst, np.arange(40, 52)), row_bits(pool, slots))
