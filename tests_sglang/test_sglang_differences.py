"""Where jaxkv differs from SGLang 0.5.23 on purpose: each test shows SGLang's behaviour on its
real classes and jaxkv's on the same calls (README, "Using jaxkv with SGLang")."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from sgl_helpers import jaxkv_pool, sglang_pool
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

import jaxkv
from jaxkv import testing


def _paged(size=16, page_size=4, need_sort=True):
    return PagedTokenToKVPoolAllocator(
        size, page_size, torch.int64, "cpu", kvcache=None, need_sort=need_sort
    )


def test_a_page_freed_twice_is_listed_twice_in_sglang_once_in_jaxkv():
    sgl, jx = _paged(), jaxkv.PagedAllocator(16, 4)
    slots = sgl.alloc(8)
    assert np.array_equal(jx.alloc(8), slots.numpy())
    for _ in range(2):
        sgl.free(slots)
        jx.free(slots.numpy())
    assert sgl.available_size() == 24 > 16  # SGLang counts pages 1 and 2 twice
    assert jx.available_size() == 16
    theirs = sgl.alloc(16).numpy()
    assert len(np.unique(theirs)) == 8  # the same page handed out twice in one allocation
    ours = jx.alloc(16)
    assert np.array_equal(np.sort(ours), np.arange(4, 20))


def test_freeing_page_0_lets_sglang_hand_out_the_padding_slots():
    sgl, jx = _paged(), jaxkv.PagedAllocator(16, 4)
    sgl.free(torch.arange(0, 4))
    jx.free(np.arange(0, 4))
    theirs = sgl.alloc(20)
    assert theirs is not None and set(range(4)) <= set(theirs.tolist())
    assert jx.alloc(20) is None  # page 0 never joins the free list
    assert 0 not in jx.alloc(16)


def test_a_partial_page_alloc_is_an_error_in_jaxkv():
    theirs = _paged().alloc(6)
    assert len(theirs) == 4  # SGLang returns one page, silently short
    with pytest.raises(ValueError, match="need_size: expected a multiple of page_size=4"):
        jaxkv.PagedAllocator(16, 4).alloc(6)


def test_sglang_without_need_sort_reuses_the_last_freed_page_first():
    """jaxkv reproduces need_sort=True (freed pages wait, merged sorted when short); SGLang's
    need_sort=False puts freed pages in front of the free list."""
    sgl, jx = _paged(need_sort=False), jaxkv.PagedAllocator(16, 4)
    a = sgl.alloc(4)
    sgl.alloc(4)
    jx.alloc(4), jx.alloc(4)
    sgl.free(a)
    jx.free(a.numpy())
    assert sgl.alloc(4).tolist() == [4, 5, 6, 7]  # page 1 again
    assert jx.alloc(4).tolist() == [12, 13, 14, 15]  # page 3: page 1 waits for a merge


def test_sglang_paged_decode_at_page_size_1_takes_no_page():
    """SGLang counts new decode pages as `seq_len % page_size == 1`, never true at page size
    1: its paged allocator then hands out `last_loc + 1`, a slot nobody allocated. (SGLang runs
    page size 1 with its token allocator, which has no decode call.)"""
    sgl, jx = _paged(size=8, page_size=1), jaxkv.PagedAllocator(8, 1)
    first = sgl.alloc(1)
    jx.alloc(1)
    theirs = sgl.alloc_decode(torch.tensor([2]), torch.tensor([2]), first)
    assert theirs.tolist() == [2] and sgl.available_size() == 7
    ours = jx.alloc_decode([2], first.numpy())
    assert ours.tolist() == [2] and jx.available_size() == 6


def test_slot_minus_1_wraps_to_the_last_row_in_sglang_and_is_dropped_by_jaxkv():
    sgl = sglang_pool("mha", "bfloat16", size=8, page_size=1)
    jx = jaxkv_pool("mha", "bfloat16", size=8, page_size=1)
    k = torch.ones(1, 2, 8, dtype=torch.bfloat16)
    v = torch.ones(1, 2, 4, dtype=torch.bfloat16)
    sgl.set_kv_buffer(None, torch.tensor([-1]), k, v, layer_id_override=0)
    assert torch.equal(sgl.k_buffer[0][-1], k[0])  # row 8, a real slot, overwritten
    jx = jx.set_kv(0, np.array([-1]), jnp.ones((1, 2, 8), jnp.bfloat16), jnp.ones((1, 2, 4)))
    assert not testing.raw_bits(jx.k_buffer[0]).any()


def test_sglang_divides_the_callers_tensor_in_place():
    sgl = sglang_pool("mha", "float8_e4m3fn", size=8, page_size=1)
    k, v = torch.full((1, 2, 8), 2.0), torch.full((1, 2, 4), 2.0)
    sgl.set_kv_buffer(None, torch.tensor([1]), k, v, 0.5, 0.25, layer_id_override=0)
    assert float(k[0, 0, 0]) == 4.0 and float(v[0, 0, 0]) == 8.0  # the caller's data changed
    jx = jaxkv_pool("mha", "float8_e4m3fn", size=8, page_size=1)
    k_np, v_np = np.full((1, 2, 8), 2.0, np.float32), np.full((1, 2, 4), 2.0, np.float32)
    jx = jx.set_kv(0, np.array([1]), k_np, v_np, 0.5, 0.25)
    assert (k_np == 2.0).all() and (v_np == 2.0).all()
    testing.assert_bits_equal(testing.raw_bits(jx.k_buffer[0]), testing.raw_bits(sgl.k_buffer[0]))


def test_sglang_k_only_set_k_buffer_forgets_start_layer():
    sgl = sglang_pool("k_only", "bfloat16", size=8, page_size=1, layer_num=4, start_layer=2)
    jx = jaxkv_pool("k_only", "bfloat16", size=8, page_size=1, layer_num=4, start_layer=2)
    k = torch.ones(1, 2, 8, dtype=torch.bfloat16)
    sgl.set_k_buffer(2, torch.tensor([1]), k)
    assert not sgl.get_key_buffer(2).any()  # global layer 2 is local 0: it was not written
    assert torch.equal(sgl.get_key_buffer(4)[1], k[0])  # local 2 (global 4) was
    jx = jx.set_k(2, np.array([1]), jnp.ones((1, 2, 8), jnp.bfloat16))
    assert float(jx.get_key_buffer(2)[1, 0, 0]) == 1.0
    assert not testing.raw_bits(jx.k_buffer[2]).any()


def test_sglang_mla_writers_skip_slot_0_and_jaxkv_writes_it():
    """Slot 0 is the padding sink: SGLang's Triton MLA writer drops writes to it, jaxkv
    writes them (padded tokens may land there; nothing reads it)."""
    sgl = sglang_pool("mla", "bfloat16", size=8, page_size=1)
    jx = jaxkv_pool("mla", "bfloat16", size=8, page_size=1)
    nope, rope = torch.ones(1, 1, 16), torch.ones(1, 1, 8)
    sgl.set_mla_kv_buffer(None, torch.tensor([0]), nope, rope, layer_id_override=0)
    assert not sgl.kv_buffer[0][0].any()
    jx = jx.set_mla_kv(0, np.array([0]), jnp.ones((1, 1, 16)), jnp.ones((1, 1, 8)))
    assert float(jx.get_key_buffer(0)[0, 0, 0]) == 1.0


def test_e5m2_casts_saturate_in_jaxkv_and_overflow_to_inf_in_sglang():
    """torch (2.14) saturates float8_e4m3fn casts, as jaxkv does, but rounds float8_e5m2 casts
    past its largest finite value to inf; jaxkv never turns a finite input into inf."""
    for dtype, big, theirs, ours in (
        ("float8_e4m3fn", 1000.0, 448.0, 448.0),
        ("float8_e5m2", 1e6, float("inf"), 57344.0),
    ):
        sgl = sglang_pool("mha", dtype, size=8, page_size=1)
        jx = jaxkv_pool("mha", dtype, size=8, page_size=1)
        k, v = torch.full((1, 2, 8), big), torch.full((1, 2, 4), -big)
        sgl.set_kv_buffer(None, torch.tensor([1]), k.clone(), v.clone(), layer_id_override=0)
        assert (sgl.get_key_buffer(0)[1].float() == theirs).all(), dtype
        assert (sgl.get_value_buffer(0)[1].float() == -theirs).all(), dtype
        jx = jx.set_kv(0, np.array([1]), k.numpy(), v.numpy())
        assert (np.asarray(jx.get_key_buffer(0)[1]).astype(np.float32) == ours).all(), dtype
        assert (np.asarray(jx.get_value_buffer(0)[1]).astype(np.float32) == -ours).all(), dtype
