"""jaxkv's allocators against SGLang's, slot for slot, on random streams of calls.

SGLang 0.5.23 picks its allocator kernels by platform: `PagedTokenToKVPoolAllocator` launches
its Triton kernels only where `current_platform.capabilities.supports_triton` (CUDA, ROCm,
XPU, ...); on the CPU it runs `alloc_extend_naive` / `alloc_decode_naive`, torch code with the
same results. `need_sort=True` (SGLang's setting for prefill/decode disaggregation) keeps freed
pages in a release list that is merged, sorted, into the free list only when an allocation runs
short; that is the behaviour jaxkv reproduces. With `need_sort=False` SGLang puts freed pages in
front of the free list instead (see test_sglang_differences.py).

Streams are seeded (numpy), so a failure names its seed and step; each stream mixes
allocations with frees of whole requests between calls, until pages run out and beyond.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool as SGLangReqToTokenPool

import jaxkv

SEEDS = range(24)
STEPS = 80


def _t(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x, np.int64), dtype=torch.int64)


def _np(x):
    return None if x is None else x.cpu().numpy().astype(np.int64)


class _Paged:
    """Both paged allocators, fed the same calls; every answer compared."""

    def __init__(self, size, page_size):
        self.page_size = page_size
        self.sgl = PagedTokenToKVPoolAllocator(
            size, page_size, torch.int64, "cpu", kvcache=None, need_sort=True
        )
        assert self.sgl.use_triton_kernels is False  # the CPU path: the *_naive functions
        self.jx = jaxkv.PagedAllocator(size, page_size)

    def check(self, where, theirs, ours):
        theirs = _np(theirs)
        if theirs is None or ours is None:
            assert theirs is None and ours is None, f"{where}: SGLang {theirs}, jaxkv {ours}"
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=where)
        assert self.jx.available_size() == self.sgl.available_size(), f"{where}: available"
        return ours

    def alloc(self, where, n):
        return self.check(where, self.sgl.alloc(n), self.jx.alloc(n))

    def extend(self, where, prefix, seq, last):
        theirs = self.sgl.alloc_extend(
            _t(prefix), _t(prefix), _t(seq), _t(seq), _t(last), int(sum(seq) - sum(prefix))
        )
        return self.check(where, theirs, self.jx.alloc_extend(prefix, seq, last))

    def decode(self, where, seq, last):
        theirs = self.sgl.alloc_decode(_t(seq), _t(seq), _t(last))
        return self.check(where, theirs, self.jx.alloc_decode(seq, last))

    def free(self, where, slots):
        self.sgl.free(_t(slots))
        self.jx.free(slots)
        self.check(where, _t([]), np.zeros(0, np.int64))


def _paged_stream(seed: int, page_size: int) -> None:
    rng = np.random.default_rng(seed)
    p = page_size
    alloc = _Paged(size=p * int(rng.integers(6, 16)), page_size=p)
    live: list[list[int]] = []  # each request's slots, in token order
    for step in range(STEPS):
        where = f"seed {seed}, page {p}, step {step}"
        op = rng.choice(["alloc", "extend", "decode", "free"], p=[0.15, 0.35, 0.3, 0.2])
        if op == "alloc":
            out = alloc.alloc(where + " alloc", p * int(rng.integers(0, 4)))
            if out is not None and out.size:
                live.append(list(out))
        elif op == "extend":
            picked = [i for i in range(len(live)) if rng.random() < 0.3][:3]
            fresh = int(rng.integers(0 if picked else 1, 3))
            prefix = [len(live[i]) for i in picked] + [0] * fresh
            last = [live[i][-1] for i in picked] + [-1] * fresh
            seq = [n + int(rng.integers(1, 3 * p)) for n in prefix]
            out = alloc.extend(where + f" extend {prefix}->{seq}", prefix, seq, last)
            if out is not None:
                ends = np.cumsum(np.subtract(seq, prefix))
                chunks = np.split(out, ends[:-1])
                for i, chunk in zip(picked, chunks):
                    live[i].extend(chunk.tolist())
                live.extend(c.tolist() for c in chunks[len(picked) :])
        elif op == "decode" and live:
            picked = rng.permutation(len(live))[: int(rng.integers(1, 5))]
            seq = [len(live[i]) + 1 for i in picked]
            last = [live[i][-1] for i in picked]
            out = alloc.decode(where + f" decode {seq}", seq, last)
            if out is not None:
                for i, s in zip(picked, out.tolist()):
                    live[i].append(s)
        elif op == "free" and live:
            slots = live.pop(int(rng.integers(len(live))))
            alloc.free(where + " free", rng.permutation(slots))


@pytest.mark.parametrize("page_size", [2, 4, 16])
def test_paged_allocator_streams_match_sglang(page_size):
    for seed in SEEDS:
        _paged_stream(seed, page_size)


def test_the_reference_extend_example():
    """Free pages [7, 8, 9]: prefixes 3, 4, 0 grow to 6, 5, 3 (page size 4)."""
    alloc = _Paged(size=36, page_size=4)
    alloc.alloc("take pages 1-6", 24)
    out = alloc.extend("example", [3, 4, 0], [6, 5, 3], [10, 19, -1])
    np.testing.assert_array_equal(out, [11, 28, 29, 32, 36, 37, 38])


def _token_stream(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(8, 40))
    sgl = TokenToKVPoolAllocator(size, torch.int64, "cpu", kvcache=None, need_sort=True)
    jx = jaxkv.TokenAllocator(size)
    live: list[np.ndarray] = []
    for step in range(STEPS):
        where = f"seed {seed}, step {step}"
        if live and rng.random() < 0.35:
            slots = rng.permutation(live.pop(int(rng.integers(len(live)))))
            sgl.free(_t(slots))
            jx.free(slots)
        else:
            n = int(rng.integers(0, 8))
            theirs, ours = _np(sgl.alloc(n)), jx.alloc(n)
            if theirs is None or ours is None:
                assert theirs is None and ours is None, f"{where}: {theirs} vs {ours}"
            else:
                np.testing.assert_array_equal(ours, theirs, err_msg=where)
                if n:
                    live.append(ours)
        assert jx.available_size() == sgl.available_size(), where


def test_token_allocator_streams_match_sglang():
    for seed in SEEDS:
        _token_stream(seed)


def test_req_to_token_pool_rows_match_sglang():
    """Rows are handed out in SGLang's order (the last free rows first, freed rows next),
    and neither side ever hands out row 0, the padding row of padded batches."""
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        size = int(rng.integers(2, 12))
        sgl = SGLangReqToTokenPool(size, 16, device="cpu", enable_memory_saver=False)
        jx = jaxkv.ReqToTokenPool(size, 16)
        assert tuple(sgl.req_to_token.shape) == tuple(jx.req_to_token.shape) == (size + 1, 16)
        held: list[int] = []
        for step in range(STEPS):
            where = f"seed {seed}, step {step}"
            if held and rng.random() < 0.4:
                rows = [held.pop(int(rng.integers(len(held)))) for _ in range(min(2, len(held)))]
                sgl.free_rows(rows)
                jx.free(rows)
            else:
                n = int(rng.integers(0, 4))
                theirs, ours = sgl.alloc_rows(n), jx.alloc(n)
                assert ours == theirs, where
                if ours:
                    assert 0 not in ours, where
                    held.extend(ours)
            assert jx.available_size() == sgl.available_size(), where
