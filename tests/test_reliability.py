"""Hostile arguments at the public boundary of the allocators and the connector: every call
gives the right result, or a `ValueError`/`TypeError`/`IndexError` naming the argument, and
changes nothing. Hand-picked cases first (each one a bug once), then hypothesis fuzzers."""

from __future__ import annotations

import re
import time

import hypothesis.strategies as st
import numpy as np
import pytest
from helpers import random_mha_pool
from hypothesis import HealthCheck, given, settings

from jaxkv import MHAPool, PagedAllocator, ReqToTokenPool, TokenAllocator
from jaxkv.connector import HostStore, KVConnector

BS = 4
ERRORS = (ValueError, TypeError, IndexError)


def _pool(seed: int = 0) -> MHAPool:
    return random_mha_pool(seed, size=32)


def _conn(store=None) -> KVConnector:
    return KVConnector(_pool(), store or HostStore(1 << 20), block_size=BS)


# --------------------------------------------------------------------------------------------
# Salts: str, bytes or None, nothing that `bytes()` would turn into zero bytes


@pytest.mark.parametrize("salt", [0, 3, False, True, 1.0, bytearray(b"t"), ["t"], object()])
def test_salts_other_than_str_bytes_or_none_are_refused(salt):
    conn = _conn()
    tokens = np.arange(2 * BS)
    for call in (conn.block_hashes, conn.lookup):
        with pytest.raises(TypeError, match="salt: expected a str, bytes or None"):
            call(tokens, salt=salt)
    with pytest.raises(TypeError, match="salt"):
        conn.store(_pool(), tokens, np.arange(1, 2 * BS + 1), salt=salt)
    assert len(conn.backend) == 0


def test_a_huge_int_salt_is_refused_at_once():
    start = time.perf_counter()
    with pytest.raises(TypeError, match="salt"):
        _conn().block_hashes(np.arange(BS), salt=10**10000)
    assert time.perf_counter() - start < 1.0  # not a 10**10000-byte buffer


def test_salts_keep_tenants_apart_and_text_equals_its_utf8_bytes():
    conn = _conn()
    tokens = np.arange(BS)
    keys = {
        repr(s): conn.block_hashes(tokens, salt=s)[0] for s in (None, "", "a", "b", b"\0", "\0\0")
    }
    assert len(set(keys.values())) == len(keys)
    assert conn.block_hashes(tokens, salt="tenant-é") == conn.block_hashes(
        tokens, salt="tenant-é".encode()
    )


# --------------------------------------------------------------------------------------------
# Allocators


def test_paged_allocator_size_must_be_a_multiple_of_page_size():
    with pytest.raises(ValueError, match=r"size: .*page_size=4, got size=10 \(use 8 or 12\)"):
        PagedAllocator(10, 4)
    assert PagedAllocator(np.int64(12), np.int32(4)).available_size() == 12


@pytest.mark.parametrize(
    "row, start, slots, err, name",
    [
        (1.5, 0, [1], TypeError, "row"),
        (1, 1.5, [1], TypeError, "start"),
        (True, 0, [1], TypeError, "row"),
        (1, 0, [[1, 2], [3, 4]], ValueError, "slots"),
        (1, 0, [2**32 + 1], ValueError, "slots"),
        (1, 0, [2**31], ValueError, "slots"),
        (1, 0, np.array([2**63], np.uint64), ValueError, "slots"),
        (1, 0, [1.0], TypeError, "slots"),
        (5, 0, [1], IndexError, "row"),
        (1, 7, [1, 2], IndexError, "start"),
    ],
)
def test_req_to_token_write_refuses_what_would_change_meaning(row, start, slots, err, name):
    pool = ReqToTokenPool(4, 8).write(1, 0, [5, 6])
    before = np.array(pool.req_to_token)
    with pytest.raises(err, match=name):
        pool.write(row, start, slots, donate=False)
    np.testing.assert_array_equal(np.array(pool.req_to_token), before)


def test_req_to_token_write_takes_numpy_ints_and_int32_extremes():
    pool = ReqToTokenPool(4, 8).write(np.int64(2), np.uint8(1), np.array([-1, 2**31 - 1]))
    assert np.array(pool.req_to_token)[2, 1:3].tolist() == [-1, 2**31 - 1]


def test_req_to_token_free_refuses_floats_without_freeing_anything():
    pool = ReqToTokenPool(4, 8)
    rows = pool.alloc(2)
    for bad in (1.5, [rows[0], 2.5], True, [[1]]):
        with pytest.raises((TypeError, ValueError), match="free_index"):
            pool.free(bad)
    assert pool.available_size() == 2
    pool.free(np.int32(rows[0]))
    assert pool.available_size() == 3


def test_allocator_vectors_must_be_one_dimensional():
    a = PagedAllocator(16, 4)
    before = a.backup_state()
    with pytest.raises(ValueError, match="seq_lens"):
        a.alloc_extend([0, 0], [[1, 2]], [-1, -1])
    with pytest.raises(ValueError, match="free_index"):
        a.free([[4, 5]])
    with pytest.raises(ValueError, match="last_loc"):  # past the pool: not a held page
        a.alloc_decode([2], [10**6 * 4])
    for got, want in zip(a.backup_state(), before):
        np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------------------------
# Fuzzers

_ARG = st.one_of(
    st.integers(-(2**65), 2**65),
    st.integers(-3, 40),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.lists(st.integers(-5, 40), max_size=6),
    st.lists(st.integers(-(2**64), 2**64), max_size=3),
    st.lists(st.floats(-5, 40), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=2), min_size=1, max_size=2),
    st.builds(np.int64, st.integers(-5, 40)),
    st.builds(lambda n: np.arange(n, dtype=np.uint64) + np.uint64(2**63), st.integers(1, 3)),
)


def _names_an_argument(err: BaseException, names) -> bool:
    return any(re.search(rf"\b{n}\b", str(err)) for n in names)


def _alloc_state(a):
    if isinstance(a, ReqToTokenPool):
        return list(a._rows.free_slots), np.array(a.req_to_token)
    return tuple(x.copy() for x in a.backup_state())


def _same(x, y) -> bool:
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return np.array_equal(x, y)


_CALLS = {
    "alloc": ("need_size",),
    "free": ("free_index",),
    "alloc_extend": ("prefix_lens", "seq_lens", "last_loc"),
    "alloc_decode": ("seq_lens", "last_loc"),
    "write": ("row", "start", "slots"),
}


@settings(
    max_examples=10 * settings.default.max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.data())
def test_fuzz_allocators(data):
    kind = data.draw(st.sampled_from(["token", "paged", "req"]))
    a = {
        "token": lambda: TokenAllocator(12),
        "paged": lambda: PagedAllocator(16, 4),
        "req": lambda: ReqToTokenPool(4, 8),
    }[kind]()
    if kind != "req":
        a.alloc(4)  # something held, so frees and extends have pages to talk about
    method = data.draw(
        st.sampled_from(
            {
                "token": ["alloc", "free"],
                "paged": ["alloc", "free", "alloc_extend", "alloc_decode"],
                "req": ["alloc", "free", "write"],
            }[kind]
        )
    )
    names = _CALLS[method]
    args = [data.draw(_ARG, label=n) for n in names]
    before = _alloc_state(a)
    available = a.available_size()
    try:
        out = getattr(a, method)(*args)
    except ERRORS as err:
        assert _names_an_argument(err, names), f"{type(err).__name__}: {err}"
        assert _same(_alloc_state(a), before), f"{method} changed state before raising"
        return
    # Accepted: the result is a right one.
    if method == "write":
        assert isinstance(out, ReqToTokenPool)
        return
    if method == "free":
        assert out is None and a.available_size() >= available
        return
    if out is None:  # refused for want of room: nothing taken
        assert _same(_alloc_state(a), before)
        return
    taken = np.asarray(out).reshape(-1)
    if kind == "req":
        assert all(1 <= r <= a.size for r in taken) and len(set(taken)) == len(taken)
    else:
        end = (a.num_pages + 1) * a.page_size
        assert np.all((taken >= a.page_size) & (taken < end)), taken
    assert a.available_size() <= available


@pytest.fixture(scope="module")
def fuzz_conn():
    return _conn()


_TOKENS = st.one_of(
    st.lists(st.integers(0, 50), max_size=3 * BS).map(np.array),
    _ARG,
    st.lists(st.integers(2**32 - 2, 2**32 + 2), min_size=1, max_size=BS).map(np.array),
)


@settings(
    max_examples=6 * settings.default.max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    st.sampled_from(["block_hashes", "lookup", "store", "load"]),
    _TOKENS,
    st.one_of(st.none(), _ARG, st.lists(st.integers(-2, 40), max_size=3 * BS).map(np.array)),
    st.one_of(st.none(), st.sampled_from(["", "t", b"t"]), _ARG),
)
def test_fuzz_connector(fuzz_conn, method, tokens, slots, salt):
    conn = fuzz_conn
    store = conn.backend
    kept = dict(store.stats())
    src = _pool()
    before = np.array(src.k_buffer[0])
    args = {"block_hashes": (tokens,), "lookup": (tokens,)}.get(method, (src, tokens, slots))
    try:
        out = getattr(conn, method)(*args, salt=salt)
    except ERRORS as err:
        assert _names_an_argument(err, ("token_ids", "slots", "salt")), f"{err!r}"
        after = store.stats()
        assert (after["blocks"], after["blocks_stored"]) == (kept["blocks"], kept["blocks_stored"])
        np.testing.assert_array_equal(np.array(src.k_buffer[0]), before)
        return
    assert salt is None or isinstance(salt, (str, bytes)), f"salt {salt!r} was taken"
    n_blocks = len(np.asarray(tokens)) // BS
    if method == "block_hashes":
        assert len(out) == n_blocks and all(re.fullmatch("[0-9a-f]{64}", h) for h in out)
    elif method == "lookup":
        assert out % BS == 0 and 0 <= out <= n_blocks * BS
    elif method == "store":
        assert 0 <= out <= n_blocks
        assert conn.lookup(tokens, salt=salt) == n_blocks * BS
    else:
        pool, n = out
        assert n == conn.lookup(tokens, salt=salt)
        # Bit-exact: what was loaded at slots[:n] is what the source pool held there when
        # the blocks were stored (every store in this test stores from the same `_pool()`).
        got = np.array(pool.k_buffer[0])[np.asarray(slots)[:n]]
        np.testing.assert_array_equal(got, np.array(_pool().k_buffer[0])[np.asarray(slots)[:n]])
