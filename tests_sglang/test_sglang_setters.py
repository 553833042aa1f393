"""jaxkv's setters against SGLang's pool writers, bit for bit.

Both sides start from zeroed pools of the same shape, write the same values at the same
random slots, and must then hold the same bytes in every buffer. Values are drawn well inside
each dtype's range: out-of-range float8_e5m2 values are a deliberate difference (jaxkv
saturates, torch's cast gives inf), tested in test_sglang_differences.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from sgl_helpers import DTYPES, FP8, NSA_PAGE, jaxkv_pool, sglang_pool
from sglang.kernels.ops.quantization.act_quant_triton import act_quant

from jaxkv import testing

T = 12  # tokens per write
SIZE, PAGE = 32, 4
SCALES = {"unscaled": (None, None), "scaled": (0.37, 1.9)}


def _values(shape, dtype: str, seed: int, spread: float = 4.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * spread).to(DTYPES[dtype][0])


def _as_jax(x: torch.Tensor):
    """The same values as a jax array of the same dtype (through raw bits: numpy has no bf16
    or fp8 of its own)."""
    return jnp.asarray(testing.raw_bits(x).view(jnp.dtype(str(x.dtype).removeprefix("torch."))))


def _loc(seed: int, rows: int) -> np.ndarray:
    # Slot 0 (the padding row) is left out: SGLang's MLA writers skip it (see
    # test_sglang_differences.py); jaxkv writes it like any row.
    return 1 + np.random.default_rng(seed).permutation(rows - 1)[:T].astype(np.int64)


def _assert_same_buffers(sgl, jx, attrs, where):
    """SGLang's buffers `attrs` hold jaxkv's bits (SGLang's bf16 tensors against jaxkv's raw
    uint16: the raw bits are compared)."""

    def bits(pool):
        return {f"{where}: {a}": testing.buffer_bits(getattr(pool, a)) for a in attrs}

    testing.assert_bits_equal(bits(jx), bits(sgl))


def _inputs(pool_dtype: str) -> list[str]:
    return sorted({"float32", "bfloat16", "float16", pool_dtype})


def test_the_interpreter_rounds_like_a_gpu():
    """conftest.py repairs Triton's interpreter: float32 -> fp8/bf16/fp16 conversions round to
    nearest even, as torch's casts (and a GPU's conversion instructions) do."""

    @triton.jit
    def copy(src, dst, n: tl.constexpr):
        offs = tl.arange(0, n)
        tl.store(dst + offs, tl.load(src + offs))

    x = torch.cat(
        [torch.tensor([7.79, 0.0016918, -0.4852247, 3.9]), _values(1020, "float32", 0, 50.0)]
    ).clamp(-448, 448)
    for dtype in ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16"):
        out = torch.empty(1024, dtype=DTYPES[dtype][0])
        copy[(1,)](x, out, 1024)
        want = x.to(DTYPES[dtype][0])
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), dtype


MHA_CASES = [(p, i) for p in DTYPES for i in _inputs(p)]


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize(
    "pool_dtype,input_dtype", MHA_CASES, ids=[f"{i}-into-{p}" for p, i in MHA_CASES]
)
def test_mha_set_kv_buffer(pool_dtype, input_dtype, scale):
    """SGLang divides by the scale only values whose dtype is not the pool's, then casts."""
    k_scale, v_scale = SCALES[scale]
    seed = len(pool_dtype) + 7 * len(input_dtype)
    sgl = sglang_pool("mha", pool_dtype, size=SIZE, page_size=PAGE)
    jx = jaxkv_pool("mha", pool_dtype, size=SIZE, page_size=PAGE)
    loc = _loc(seed, SIZE + PAGE)
    k = _values((T, 2, 8), input_dtype, seed)
    v = _values((T, 2, 4), input_dtype, seed + 1)
    # SGLang divides the caller's tensors in place: it gets copies.
    sgl.set_kv_buffer(
        None, torch.from_numpy(loc), k.clone(), v.clone(), k_scale, v_scale,
        layer_id_override=1,
    )  # fmt: skip
    jx = jx.set_kv(1, loc, _as_jax(k), _as_jax(v), k_scale, v_scale)
    where = f"{input_dtype} into {pool_dtype}, {scale}"
    _assert_same_buffers(sgl, jx, ("k_buffer", "v_buffer"), where)


@pytest.mark.parametrize("pool_dtype", list(DTYPES))
def test_k_only_set_k_buffer(pool_dtype):
    for n, input_dtype in enumerate(_inputs(pool_dtype)):
        sgl = sglang_pool("k_only", pool_dtype, size=SIZE, page_size=PAGE)
        jx = jaxkv_pool("k_only", pool_dtype, size=SIZE, page_size=PAGE)
        loc = _loc(n, SIZE + PAGE)
        k = _values((T, 2, 8), input_dtype, n)
        sgl.set_k_buffer(1, torch.from_numpy(loc), k.clone())
        jx = jx.set_k(1, loc, _as_jax(k))
        _assert_same_buffers(sgl, jx, ("k_buffer",), f"{input_dtype} into {pool_dtype}")


@pytest.mark.parametrize("pool_dtype", list(DTYPES))
def test_mla_set_mla_kv_buffer_and_set_kv_buffer(pool_dtype):
    for n, input_dtype in enumerate(_inputs(pool_dtype)):
        where = f"{input_dtype} into {pool_dtype}"
        sgl = sglang_pool("mla", pool_dtype, size=SIZE, page_size=PAGE)
        jx = jaxkv_pool("mla", pool_dtype, size=SIZE, page_size=PAGE)
        loc = _loc(n, SIZE + PAGE)
        nope, rope = _values((T, 1, 16), input_dtype, n), _values((T, 1, 8), input_dtype, n + 50)
        sgl.set_mla_kv_buffer(None, torch.from_numpy(loc), nope, rope, layer_id_override=0)
        jx = jx.set_mla_kv(0, loc, _as_jax(nope), _as_jax(rope))
        row = _values((T, 1, 24), input_dtype, n + 100)
        sgl.set_kv_buffer(None, torch.from_numpy(loc[::-1].copy()), row, None, layer_id_override=1)
        jx = jx.set_kv(1, loc[::-1].copy(), _as_jax(row), None)
        _assert_same_buffers(sgl, jx, ("kv_buffer",), where)


@pytest.mark.parametrize("input_dtype", ["bfloat16", "float32"])
def test_nsa_bf16_set_mla_kv_buffer(input_dtype):
    sgl = sglang_pool("nsa", "bfloat16", size=2 * NSA_PAGE, page_size=NSA_PAGE)
    jx = jaxkv_pool("nsa", "bfloat16", size=2 * NSA_PAGE, page_size=NSA_PAGE)
    loc = _loc(1, 3 * NSA_PAGE)
    nope, rope = _values((T, 1, 512), input_dtype, 1), _values((T, 1, 64), input_dtype, 2)
    sgl.set_mla_kv_buffer(None, torch.from_numpy(loc), nope, rope, layer_id_override=1)
    jx = jx.set_mla_kv(1, loc, _as_jax(nope), _as_jax(rope))
    _assert_same_buffers(sgl, jx, ("kv_buffer",), input_dtype)


def test_nsa_fp8_set_mla_kv_buffer_packs_like_sglang():
    """SGLang's DSA fp8 writer (its Triton quantiser, then the row scatter): per tile of 128
    latent values scale = amax / 448 and codes x * (1 / scale) as fp8-e4m3, the rope as bf16,
    656 bytes a row. Tiles span magnitudes from 1e-3 to 1e2."""
    sgl = sglang_pool("nsa", "float8_e4m3fn", size=2 * NSA_PAGE, page_size=NSA_PAGE)
    jx = jaxkv_pool("nsa", "float8_e4m3fn", size=2 * NSA_PAGE, page_size=NSA_PAGE)
    n = 2 * T
    loc = 1 + np.random.default_rng(2).permutation(3 * NSA_PAGE - 1)[:n]
    gen = torch.Generator().manual_seed(3)
    magnitude = 10.0 ** torch.randint(-3, 3, (n, 1, 4, 1), generator=gen)
    nope = (torch.randn(n, 1, 4, 128, generator=gen) * magnitude).reshape(n, 1, 512)
    nope, rope = nope.to(torch.bfloat16), _values((n, 1, 64), "bfloat16", 4)
    sgl.set_mla_kv_buffer(None, torch.from_numpy(loc), nope, rope, layer_id_override=0)
    jx = jx.set_mla_kv(0, loc, _as_jax(nope), _as_jax(rope))
    assert sgl.kv_buffer[0].shape[-1] == jx.kv_buffer[0].shape[-1] == 656
    _assert_same_buffers(sgl, jx, ("kv_buffer",), "packed fp8 rows")


def _index_keys(seed: int, dtype=torch.float32) -> torch.Tensor:
    """Index keys over many magnitudes, a zero row, and a row below the 1e-4 amax floor."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * T, 128, generator=gen) * torch.exp(torch.randn(2 * T, 1, generator=gen) * 3)
    x[0] = 0.0
    x[1] *= 1e-7
    return x.to(dtype)


def _records(buf: np.ndarray, slots, page_size: int) -> np.ndarray:
    """Per slot, its key bytes then its 4 scale bytes, out of SGLang's page layout."""
    width = buf.shape[1] // page_size - 4
    keys = page_size * width
    out = []
    for s in slots:
        p, o = divmod(int(s), page_size)
        scale = buf[p, keys + 4 * o : keys + 4 * o + 4]
        out.append(np.concatenate([buf[p, o * width : (o + 1) * width], scale]))
    return np.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nsa_index_k_against_the_fused_cuda_formula(dtype):
    """SGLang's preferred index-key writer is a fused CUDA kernel (not runnable here): per token
    scale = max(amax, 1e-4) / 448 and codes fp8(clip(x * (1 / scale))). Its arithmetic, in
    torch, feeds SGLang's own page writer (`set_index_k_scale_buffer`); jaxkv's `set_index_k`
    must leave the same bytes."""
    sgl = sglang_pool("nsa", "bfloat16", size=2 * NSA_PAGE, page_size=NSA_PAGE)
    jx = jaxkv_pool("nsa", "bfloat16", size=2 * NSA_PAGE, page_size=NSA_PAGE)
    x = _index_keys(5, dtype)
    loc = np.random.default_rng(5).permutation(3 * NSA_PAGE)[: len(x)]
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(-1, keepdim=True), min=1e-4) / 448.0
    codes = (xf * (1.0 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
    sgl.set_index_k_scale_buffer(0, torch.from_numpy(loc), codes.contiguous(), scale)
    jx = jx.set_index_k(0, loc, _as_jax(x))
    _assert_same_buffers(sgl, jx, ("index_k_with_scale_buffer",), "fused formula")


def test_nsa_index_k_against_the_triton_fallback():
    """SGLang's fallback (Triton `act_quant`, then the page writer) computes the scale as
    max(amax, 1e-4) * float32(1 / 448) and codes x / scale; jaxkv follows the fused CUDA
    kernel's max(amax, 1e-4) / 448. Records agree wherever those two scales agree; elsewhere
    the scales are one float32 ulp apart (and a code may move one step)."""
    sgl = sglang_pool("nsa", "bfloat16", size=2 * NSA_PAGE, page_size=NSA_PAGE)
    jx = jaxkv_pool("nsa", "bfloat16", size=2 * NSA_PAGE, page_size=NSA_PAGE)
    x = _index_keys(6)
    loc = np.random.default_rng(6).permutation(3 * NSA_PAGE)[: len(x)]
    codes, scale = act_quant(x.contiguous())
    sgl.set_index_k_scale_buffer(0, torch.from_numpy(loc), codes, scale)
    jx = jx.set_index_k(0, loc, _as_jax(x))
    theirs = _records(testing.raw_bits(sgl.index_k_with_scale_buffer[0]), loc, NSA_PAGE)
    ours = _records(testing.raw_bits(jx.index_k_with_scale_buffer[0]), loc, NSA_PAGE)
    floor = np.maximum(x.abs().amax(-1).numpy(), np.float32(1e-4))
    by_division = (floor / np.float32(448)).astype(np.float32)
    triton_scale = scale.numpy()[:, 0]
    np.testing.assert_array_equal(triton_scale, floor * np.float32(1 / 448))
    agree = triton_scale == by_division
    assert agree.any() and not agree.all()  # this draw exercises both cases
    np.testing.assert_array_equal(ours[agree], theirs[agree])
    ulps = ours[~agree, 128:].copy().view(np.int32) - theirs[~agree, 128:].copy().view(np.int32)
    assert set(np.abs(ulps).ravel().tolist()) == {1}
    assert (ours[:, 128:].copy().view(np.float32)[:, 0] == by_division).all()


@pytest.mark.parametrize("pool_dtype", FP8)
def test_fp8_reads_agree(pool_dtype):
    """The values each side reads back from the same fp8 bytes."""
    sgl = sglang_pool("mha", pool_dtype, size=SIZE, page_size=PAGE)
    jx = jaxkv_pool("mha", pool_dtype, size=SIZE, page_size=PAGE)
    loc = _loc(9, SIZE + PAGE)
    k, v = _values((T, 2, 8), "float32", 9), _values((T, 2, 4), "float32", 10)
    sgl.set_kv_buffer(None, torch.from_numpy(loc), k.clone(), v.clone(), layer_id_override=0)
    jx = jx.set_kv(0, loc, _as_jax(k), _as_jax(v))
    theirs = sgl.get_key_buffer(0).float().numpy()
    ours = np.asarray(jx.get_key_buffer(0)).astype(np.float32)
    np.testing.assert_array_equal(ours, theirs)
    assert jx.get_key_buffer(0).dtype == jnp.dtype(getattr(ml_dtypes, pool_dtype))
