"""Torch tensors on an accelerator through the connector, as SGLang holds them on a GPU.

The connector reads and writes such buffers with torch's own indexing, in place. This needs
torch with a CUDA device; without one (CI has neither) the module is skipped with that reason,
and the same path is exercised on CPU tensors by the SGLang comparison suite.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch tensors on an accelerator need torch")
if not torch.cuda.is_available():
    pytest.skip("torch tensors on an accelerator need a CUDA device", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

from jaxkv import MHAPool, testing  # noqa: E402
from jaxkv.connector import HostStore, KVConnector  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
PAGE, SIZE, LAYERS = 4, 64, 2


class _Pool:
    def __init__(self, **buffers):
        self.page_size = PAGE
        self.__dict__.update(buffers)


def _pool(kind: str, dtype, seed: int, logical=None) -> _Pool:
    """An SGLang-shaped pool of CUDA tensors filled with random bytes (NaN payloads too)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = SIZE + PAGE

    def family(shape, dt=dtype):
        out = []
        for _ in range(LAYERS):
            t = torch.empty((rows, *shape), dtype=dt, device="cuda")
            raw = t.view(torch.uint8)
            raw.copy_(
                torch.randint(0, 256, raw.shape, generator=gen, device="cuda").to(torch.uint8)
            )
            out.append(t)
        return out

    if kind == "mha":
        pool = _Pool(k_buffer=family((2, 8)), v_buffer=family((2, 4)))
    elif kind == "k_only":
        pool = _Pool(k_buffer=family((2, 8)))
    elif kind == "mla":
        pool = _Pool(kv_buffer=family((1, 24)))
    else:  # NSA: index keys of 16 bytes plus a 4-byte scale per token, page-packed
        index = [t.view(rows // PAGE, PAGE * 20) for t in family((20,), torch.uint8)]
        pool = _Pool(kv_buffer=family((1, 24)), index_k_with_scale_buffer=index)
    if logical is not None:
        pool.dtype = logical
    return pool


def _attrs(pool) -> list[str]:
    names = ("k_buffer", "v_buffer", "kv_buffer", "index_k_with_scale_buffer")
    return [a for a in names if hasattr(pool, a)]


def _layers(pool) -> dict[str, list]:
    return {a: getattr(pool, a) for a in _attrs(pool)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["mha", "k_only", "mla", "nsa"])
def test_torch_cuda_pools_round_trip_in_place(kind, dtype):
    src, dst = _pool(kind, dtype, 1), _pool(kind, dtype, 2)
    slots = np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in (3, 9, 1, 5)])
    dst_slots = np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in (2, 16, 4, 7)])
    tokens = np.arange(len(slots))
    conn = KVConnector(src, HostStore(1 << 24), block_size=PAGE)
    assert conn.store(src, tokens, slots) == len(slots) // PAGE
    pointers = testing.buffer_pointers(_layers(dst))
    before = {a: testing.buffer_bits(layers) for a, layers in _layers(dst).items()}
    out, n = conn.load(dst, tokens, dst_slots)
    assert n == len(slots) and out is dst
    testing.assert_updated_in_place(pointers, _layers(dst))
    for attr in _attrs(dst):
        for li, (s, d) in enumerate(zip(getattr(src, attr), getattr(dst, attr))):
            got, want, old = testing.raw_bits(d), testing.raw_bits(s), before[attr][li]
            if attr == "index_k_with_scale_buffer":
                width = 16
                for a, b in zip(slots, dst_slots):
                    (ps, os_), (pd, od) = divmod(int(a), PAGE), divmod(int(b), PAGE)
                    np.testing.assert_array_equal(
                        got[pd, od * width : (od + 1) * width],
                        want[ps, os_ * width : (os_ + 1) * width],
                    )
                continue
            np.testing.assert_array_equal(got[dst_slots], want[slots])
            untouched = np.setdiff1d(np.arange(got.shape[0]), dst_slots)
            np.testing.assert_array_equal(got[untouched], old[untouched])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_torch_cuda_fp8_store_buffers_share_blocks_with_a_jaxkv_pool(dtype):
    """SGLang's fp8 convention on a GPU: uint8 buffers and a logical `dtype`."""
    sgl = _pool("mha", torch.uint8, 3, logical=dtype)
    conn = KVConnector(sgl, HostStore(1 << 24), block_size=PAGE)
    pool = MHAPool.create(
        size=SIZE,
        page_size=PAGE,
        dtype=jnp.dtype(str(dtype).removeprefix("torch.")),
        head_num=2,
        head_dim=8,
        v_head_dim=4,
        layer_num=LAYERS,
    )
    slots = np.arange(PAGE, 5 * PAGE)
    assert conn.store(sgl, np.arange(16), slots) == 4
    pool, n = conn.load(pool, np.arange(16), slots)
    assert n == 16
    for attr in ("k_buffer", "v_buffer"):
        for t, j in zip(getattr(sgl, attr), getattr(pool, attr)):
            np.testing.assert_array_equal(np.asarray(j)[slots], testing.raw_bits(t)[slots])
