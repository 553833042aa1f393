"""KVConnector on SGLang's real pools and on SGLang-shaped objects holding torch tensors.

Every buffer is filled with random bytes (NaN payloads included), stored through the connector
into a HostStore and a DiskStore, and loaded into a fresh pool of the same shape at other
slots: the loaded rows must equal the stored ones byte for byte, every other byte must stay,
and every tensor must be written in place (same data_ptr, same list object).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sgl_helpers import (
    BUFFERS,
    DTYPES,
    FP8,
    NSA_PAGE,
    buffers,
    expected_load,
    fill_random,
    jaxkv_pool,
    raw,
    sglang_pool,
)

import jaxkv
from jaxkv import testing
from jaxkv.connector import DiskStore, HostStore, KVConnector, _foreign

# (kind, dtype, page_size, size): SGLang's MHA pools in all five dtypes, its K-only pool, its
# MLA pool and its DSA (NSA) pool in the dtypes each supports.
POOLS = (
    [("mha", d, 4, 64) for d in DTYPES]
    + [("mha", "bfloat16", 1, 64), ("k_only", "bfloat16", 1, 64)]
    + [("k_only", d, 4, 64) for d in ("float32", "float8_e4m3fn")]
    + [("mla", d, 4, 64) for d in ("bfloat16", "float8_e4m3fn", "float16")]
    + [("nsa", d, NSA_PAGE, 3 * NSA_PAGE) for d in ("bfloat16", "float8_e4m3fn")]
)


def _store(kind, tmp_path):
    return HostStore(1 << 26) if kind == "host" else DiskStore(tmp_path / "blocks")


def _slots(page_size: int, pages) -> np.ndarray:
    return np.concatenate([p * page_size + np.arange(page_size) for p in pages])


def _roundtrip(src, dst, kind, page_size, size, store, *, src_pages, dst_pages):
    """Stores `src` pages and loads them into `dst` pages; checks bytes and pointers."""
    conn = KVConnector(src, store)
    assert conn.block_size == (page_size if page_size > 1 else 16)
    src_slots, dst_slots = _slots(page_size, src_pages), _slots(page_size, dst_pages)
    if page_size == 1:  # token pools: any slots; take them scattered
        rng = np.random.default_rng(size)
        src_slots = rng.permutation(np.arange(1, size + 1))[:32]
        dst_slots = rng.permutation(np.arange(1, size + 1))[:32]
    tokens = np.random.default_rng(7).integers(0, 50_000, len(src_slots))
    n_blocks = len(src_slots) // conn.block_size
    assert conn.store(src, tokens, src_slots) == n_blocks
    lists = {a: getattr(dst, a) for a in BUFFERS[kind]}
    ptrs, before, src_raw = (
        testing.buffer_pointers(buffers(dst, kind)),
        raw(dst, kind),
        raw(src, kind),
    )
    out, n = conn.load(dst, tokens, dst_slots)
    assert out is dst and n == n_blocks * conn.block_size
    testing.assert_updated_in_place(ptrs, buffers(dst, kind))  # into the caller's tensors
    assert all(getattr(dst, a) is lists[a] for a in lists)
    want = expected_load(before, src_raw, src_slots[:n], dst_slots[:n], page_size)
    testing.assert_bits_equal(raw(dst, kind), want)
    return conn


@pytest.mark.parametrize("store", ["host", "disk"])
@pytest.mark.parametrize("kind,dtype,page_size,size", POOLS)
def test_sglang_pool_roundtrip_in_place(kind, dtype, page_size, size, store, tmp_path):
    src = sglang_pool(kind, dtype, size=size, page_size=page_size)
    dst = sglang_pool(kind, dtype, size=size, page_size=page_size)
    fill_random(src, kind, 1)
    fill_random(dst, kind, 2)
    n_pages = size // page_size
    _roundtrip(
        src,
        dst,
        kind,
        page_size,
        size,
        _store(store, tmp_path),
        src_pages=[n_pages, 1],
        dst_pages=[2, n_pages - 1 if n_pages > 2 else 3],
    )


def test_bf16_k_only_pool_constructs():
    """A bf16 K-only pool, page size 1, one layer: once a TypeError on torch.bfloat16."""
    pool = sglang_pool("k_only", "bfloat16", size=32, page_size=1, layer_num=1)
    conn = KVConnector(pool, HostStore(1 << 20))
    assert conn.layout.kind == "k_only" and conn.layout.dtype == "bfloat16"
    assert conn.block_size == 16


def test_disk_blocks_are_found_by_a_new_connector(tmp_path):
    """Blocks on disk outlive the process that wrote them: a fresh store and connector on the
    same path load them into a fresh pool."""
    src = sglang_pool("mha", "float8_e4m3fn", size=64, page_size=4)
    fill_random(src, "mha", 3)
    tokens, slots = np.arange(32), _slots(4, range(1, 9))
    assert KVConnector(src, DiskStore(tmp_path)).store(src, tokens, slots) == 8
    dst = sglang_pool("mha", "float8_e4m3fn", size=64, page_size=4)
    conn = KVConnector(dst, DiskStore(tmp_path))
    assert conn.lookup(tokens) == 32
    _, n = conn.load(dst, tokens, slots[::-1].copy())
    assert n == 32
    for attr in ("k_buffer", "v_buffer"):
        for s, d in zip(getattr(src, attr), getattr(dst, attr)):
            assert torch.equal(d[torch.from_numpy(slots[::-1].copy())], s[torch.from_numpy(slots)])


# --------------------------------------------------------------------------------------------
# SGLang-shaped objects of our own, holding torch tensors in every dtype


class TorchPool:
    """Per-layer lists of torch tensors under SGLang's attribute names."""

    def __init__(self, page_size, **buffers):
        self.page_size = page_size
        self.__dict__.update(buffers)


def _torch_object(kind, torch_dtype, *, page_size=4, size=64, layers=2, logical=None):
    rows = size + page_size

    def family(shape, dt=torch_dtype):
        return [torch.zeros((rows, *shape), dtype=dt) for _ in range(layers)]

    if kind == "mha":
        obj = TorchPool(page_size, k_buffer=family((2, 8)), v_buffer=family((2, 4)))
    elif kind == "k_only":
        obj = TorchPool(page_size, k_buffer=family((2, 8)))
    elif kind == "mla":
        obj = TorchPool(page_size, kv_buffer=family((1, 24)))
    else:
        index = [
            torch.zeros((rows // page_size, page_size * (16 + 4)), dtype=torch.uint8)
            for _ in range(layers)
        ]
        obj = TorchPool(page_size, kv_buffer=family((1, 24)), index_k_with_scale_buffer=index)
    if logical is not None:
        obj.dtype = logical
    return obj


TORCH_DTYPES = [d for d, _ in DTYPES.values()]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["mha", "k_only", "mla", "nsa"])
def test_torch_objects_every_dtype(kind, dtype):
    src, dst = _torch_object(kind, dtype), _torch_object(kind, dtype)
    fill_random(src, kind, 4)
    fill_random(dst, kind, 5)
    conn = _roundtrip(
        src, dst, kind, 4, 64, HostStore(1 << 24), src_pages=[3, 9, 1], dst_pages=[2, 16, 5]
    )
    assert conn.layout.dtype == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", FP8)
def test_torch_uint8_buffers_under_an_fp8_dtype_share_with_jaxkv(dtype):
    """SGLang's fp8 convention on a plain object: uint8 store buffers, logical `dtype`."""
    obj = _torch_object("mha", torch.uint8, logical=DTYPES[dtype][0])
    fill_random(obj, "mha", 6)
    conn = KVConnector(obj, HostStore(1 << 24))
    pool = jaxkv_pool("mha", dtype, size=64, page_size=4)
    assert conn.fingerprint == KVConnector(pool, HostStore(1 << 20)).fingerprint
    slots = _slots(4, [1, 2, 3, 4])
    assert conn.store(obj, np.arange(16), slots) == 4
    pool, n = conn.load(pool, np.arange(16), slots)
    assert n == 16
    for attr in ("k_buffer", "v_buffer"):
        for t, j in zip(getattr(obj, attr), getattr(pool, attr)):
            np.testing.assert_array_equal(np.asarray(j)[slots], t.numpy()[slots])


def test_tensors_that_require_grad_are_read_and_written():
    src = _torch_object("k_only", torch.float32)
    fill_random(src, "k_only", 7)
    dst = _torch_object("k_only", torch.float32)
    for t in src.k_buffer + dst.k_buffer:
        t.requires_grad_(True)
    conn = KVConnector(src, HostStore(1 << 20))
    slots = _slots(4, [1, 2, 3, 4])
    assert conn.store(src, np.arange(16), slots) == 4
    conn.load(dst, np.arange(16), slots)
    for s, d in zip(src.k_buffer, dst.k_buffer):
        idx = torch.from_numpy(slots)
        assert torch.equal(s[idx].view(torch.int32), d[idx].view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("kind", ["mha", "nsa"])
def test_the_accelerator_path_moves_torch_tensors_with_torch_indexing(kind, dtype, monkeypatch):
    """Torch tensors on an accelerator are gathered and scattered with torch's own indexing.
    No accelerator here: CPU tensors are routed down that path, and must give the same bytes
    as the numpy path, in place."""
    host_only = _foreign.kind
    monkeypatch.setattr(
        _foreign, "kind", lambda x: "torch" if _foreign.is_torch(x) else host_only(x)
    )
    src, dst = _torch_object(kind, dtype), _torch_object(kind, dtype)
    fill_random(src, kind, 8)
    fill_random(dst, kind, 9)
    assert isinstance(
        _foreign.direct_view(src.kv_buffer[0] if kind == "nsa" else src.k_buffer[0]), torch.Tensor
    )
    conn = _roundtrip(src, dst, kind, 4, 64, HostStore(1 << 24), src_pages=[4, 2], dst_pages=[7, 1])
    exported = conn.export_blocks(src, _slots(4, [4, 2]))
    monkeypatch.setattr(_foreign, "kind", host_only)
    for key, arr in conn.export_blocks(src, _slots(4, [4, 2])).items():
        np.testing.assert_array_equal(exported[key], arr)


def test_a_jaxkv_pool_and_an_sglang_pool_of_another_dtype_do_not_share():
    sgl = sglang_pool("mha", "float8_e4m3fn", size=64, page_size=4)
    conn = KVConnector(sgl, HostStore(1 << 20))
    other = jaxkv_pool("mha", "float8_e5m2", size=64, page_size=4)
    assert conn.fingerprint != KVConnector(other, HostStore(1 << 20)).fingerprint
    with pytest.raises(ValueError, match="expected the layout"):
        conn.load(other, np.arange(16), np.arange(4, 20))


def test_unsupported_objects_still_name_the_layouts():
    class NotAPool:
        key_cache = [torch.zeros(4, 2)]

    with pytest.raises(jaxkv.UnsupportedKVCacheError, match="^Unsupported KV cache type NotAPool:"):
        KVConnector(NotAPool(), HostStore(1 << 20))
