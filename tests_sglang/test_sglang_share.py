"""One model, one layout key: blocks stored from an SGLang pool load into the jaxkv pool of the
same shape, and blocks stored from that jaxkv pool load back into an SGLang pool, bit-exact.

SGLang keeps fp8 pools as uint8 buffers with `dtype=torch.float8_e4m3fn`, as jaxkv does; its
16-bit pools keep bf16/fp16 tensors where jaxkv keeps their raw uint16 bits. The layout key
uses the logical dtype and the raw-bit row shapes, so both sides agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sgl_helpers import BUFFERS, DTYPES, NSA_PAGE, buffers, fill_random, jaxkv_pool, sglang_pool

from jaxkv import testing
from jaxkv.connector import HostStore, KVConnector

CASES = (
    [("mha", d, 4, 64) for d in DTYPES]
    + [("k_only", d, 1, 64) for d in ("bfloat16", "float8_e5m2")]
    + [("mla", d, 4, 64) for d in ("float8_e4m3fn", "bfloat16", "float32")]
    + [("nsa", d, NSA_PAGE, 2 * NSA_PAGE) for d in ("bfloat16", "float8_e4m3fn")]
)


def _rows(buffers_bytes, attr, slots, page_size):
    """Per layer, the bits of the tokens at `slots` (NSA index: key bytes then scale)."""
    out = []
    for buf in buffers_bytes:
        if attr != "index_k_with_scale_buffer":
            out.append(buf[slots])
            continue
        width = buf.shape[1] // page_size - 4
        keys = page_size * width
        recs = []
        for s in slots:
            p, o = divmod(int(s), page_size)
            recs.append(
                np.concatenate(
                    [buf[p, o * width : (o + 1) * width], buf[p, keys + 4 * o : keys + 4 * o + 4]]
                )
            )
        out.append(np.stack(recs))
    return out


def _pool_rows(pool, kind, slots, page_size):
    return {
        a: _rows(testing.buffer_bits(getattr(pool, a)), a, slots, page_size) for a in BUFFERS[kind]
    }


@pytest.mark.parametrize("kind,dtype,page_size,size", CASES)
def test_sglang_to_jaxkv_and_back(kind, dtype, page_size, size):
    sgl = sglang_pool(kind, dtype, size=size, page_size=page_size)
    fill_random(sgl, kind, 11)
    jx = jaxkv_pool(kind, dtype, size=size, page_size=page_size)
    to_jaxkv = KVConnector(sgl, HostStore(1 << 26))
    assert to_jaxkv.fingerprint == KVConnector(jx, HostStore(1 << 20)).fingerprint
    bs = to_jaxkv.block_size
    n_pages = size // page_size
    src = np.arange(page_size, page_size + 2 * bs)  # from page 1 on
    dst = np.arange(size + page_size - 2 * bs, size + page_size)  # the last pages
    tokens = np.random.default_rng(3).integers(0, 1 << 20, 2 * bs)
    assert to_jaxkv.store(sgl, tokens, src) == 2
    jx, n = to_jaxkv.load(jx, tokens, dst)
    assert n == 2 * bs and n_pages >= 2
    want = _pool_rows(sgl, kind, src, page_size)
    got = _pool_rows(jx, kind, dst, page_size)
    for attr in want:
        for li, (g, w) in enumerate(zip(got[attr], want[attr])):
            np.testing.assert_array_equal(g, w, err_msg=f"jaxkv {attr}[{li}]")

    # Back: stored from the jaxkv pool by a connector made on it, loaded into SGLang's pool.
    to_sglang = KVConnector(jx, HostStore(1 << 26))
    assert to_sglang.store(jx, tokens, dst) == 2
    fresh = sglang_pool(kind, dtype, size=size, page_size=page_size)
    fill_random(fresh, kind, 12)
    ptrs = testing.buffer_pointers(buffers(fresh, kind))
    out, n = to_sglang.load(fresh, tokens, src)
    assert out is fresh and n == 2 * bs
    testing.assert_updated_in_place(ptrs, buffers(fresh, kind))
    back = _pool_rows(fresh, kind, src, page_size)
    for attr in want:
        for li, (g, w) in enumerate(zip(back[attr], want[attr])):
            np.testing.assert_array_equal(g, w, err_msg=f"SGLang {attr}[{li}]")


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_fp8_values_read_alike_on_both_sides(kind):
    """Past the bits: the fp8 values SGLang's readers return equal jaxkv's after the trip."""
    sgl = sglang_pool(kind, "float8_e4m3fn", size=32, page_size=4)
    fill_random(sgl, kind, 13)
    jx = jaxkv_pool(kind, "float8_e4m3fn", size=32, page_size=4)
    conn = KVConnector(sgl, HostStore(1 << 24))
    slots = np.arange(4, 12)
    assert conn.store(sgl, np.arange(8), slots) == 2
    jx, _ = conn.load(jx, np.arange(8), slots)
    for layer in range(2):
        theirs = sgl.get_key_buffer(layer)[torch.from_numpy(slots)]
        assert theirs.dtype == torch.float8_e4m3fn
        ours = np.asarray(jx.get_key_buffer(layer))[slots]
        np.testing.assert_array_equal(
            ours.view(np.uint8), theirs.view(torch.uint8).numpy(), err_msg=f"layer {layer}"
        )
