"""Helpers shared by the tests: small pools of every kind, every dtype, numpy references, and
the runner of fresh Python processes. Tests import them from here (`from helpers import ...`);
`conftest.py` keeps the fixtures and pytest hooks.

The references are written from the documented behaviour, independently of jaxkv's code:

* `encode_ref`: the bits a pool stores for a value. The value (divided by the scale, if any) is
  taken in float32, clipped to +-finfo.max for fp8, cast with ml_dtypes (round to nearest even)
  and viewed as the store dtype.
* `quantize_index_ref` / `index_pages_ref`: NSA indexer records, scale = max(amax, 1e-4) / 448
  in float32 (amax over the finite keys), keys = clip(x / scale) as fp8-e4m3, packed into
  SGLang's page layout.
* `pack_latent_ref` / `unpack_latent_ref`: NSA's packed fp8 latent rows (any fp8 pool dtype):
  per tile of 128 latent values scale = amax / 448 (finite values only) and codes =
  fp8-e4m3(clip(x * (1 / scale))) in float32 (0 * inf taken as a zero of x's sign), then the
  float32 scales (little-endian), then the rope as bfloat16 (saturating); readers return
  code * scale and the rope, float32.

Scaled writes, NSA scales and packed rows divide in float32. jaxkv's division is IEEE on every
backend with subnormal inputs and results taken as zero (sign kept), as XLA:CPU's arithmetic has
them, so the references flush around each division on every backend. Plain casts keep
subnormals bit-exactly.
"""

from __future__ import annotations

import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxkv
from jaxkv import KOnlyPool, MHAPool, MLAPool, NSAPool, testing
from jaxkv.connector import BlockRecord

REPO = Path(__file__).resolve().parents[1]
ALL_DTYPES = tuple(
    jnp.dtype(d)
    for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)
)
STORE_DTYPES = {
    jnp.dtype(jnp.float32): np.dtype(np.float32),
    jnp.dtype(jnp.bfloat16): np.dtype(np.uint16),
    jnp.dtype(jnp.float16): np.dtype(np.uint16),
    jnp.dtype(jnp.float8_e4m3fn): np.dtype(np.uint8),
    jnp.dtype(jnp.float8_e5m2): np.dtype(np.uint8),
}
POOL_KINDS = ("mha", "konly", "mla", "nsa")
POOL_CLASSES = {
    "mha": jaxkv.MHAPool,
    "konly": jaxkv.KOnlyPool,
    "mla": jaxkv.MLAPool,
    "nsa": jaxkv.NSAPool,
}
# Small shapes keep every test fast; v_head_dim != head_dim and kv_lora_rank != qk_rope_head_dim
# so that a swapped dimension shows up as a shape error.
SMALL = {
    "mha": dict(size=12, page_size=2, head_num=2, head_dim=4, v_head_dim=3, layer_num=2),
    "konly": dict(size=12, page_size=2, head_num=2, head_dim=4, layer_num=2),
    "mla": dict(size=12, page_size=2, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=2),
    "nsa": dict(
        size=8, page_size=4, kv_lora_rank=6, qk_rope_head_dim=2, index_head_dim=8, layer_num=2
    ),
}
# An fp8 NSA pool packs its latent in tiles of 128 values: its kv_lora_rank must be a multiple of
# 128, so those pools take the smallest such rank (and keep a small rope).
SMALL_PACKED_NSA = {"kv_lora_rank": 128}
E4M3_MAX = np.float32(448.0)
# The reference decoder of `jaxkv.models` at test size (both attention variants take it).
SMALL_DECODER = dict(
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    mlp_dim=128,
)
INDEX_AMAX_FLOOR = np.float32(1e-4)
LATENT_TILE = 128


FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _is_fp8(dtype) -> bool:
    try:
        return jnp.dtype(dtype) in FP8_DTYPES
    except TypeError:  # not a dtype at all: the pool rejects it
        return False


def small(kind: str, dtype=jnp.bfloat16) -> dict:
    """The small create() arguments of `kind` for pools of `dtype` (sizes only)."""
    if kind == "nsa" and _is_fp8(dtype):
        return {**SMALL[kind], **SMALL_PACKED_NSA}
    return dict(SMALL[kind])


def make_pool(kind: str, dtype=jnp.bfloat16, **overrides):
    """A small zeroed pool of `kind` ("mha", "konly", "mla", "nsa")."""
    return POOL_CLASSES[kind].create(dtype=dtype, **{**small(kind, dtype), **overrides})


def is_packed(pool) -> bool:
    """Whether `pool` keeps NSA's packed fp8 latent rows (an NSA pool of an fp8 dtype)."""
    return hasattr(pool, "index_k_with_scale_buffer") and _is_fp8(pool.dtype)


def packed_width(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Bytes of a packed row: fp8 latent, a float32 scale per 128 values, bfloat16 rope."""
    return kv_lora_rank + 4 * (kv_lora_rank // LATENT_TILE) + 2 * qk_rope_head_dim


def kv_row_shape(pool) -> tuple[int, ...]:
    """Per-token shape of an MLA/NSA pool's stored `kv_buffer` rows."""
    if is_packed(pool):
        return (1, packed_width(pool.kv_lora_rank, pool.qk_rope_head_dim))
    return (1, pool.kv_lora_rank + pool.qk_rope_head_dim)


def row_buffer_names(kind: str) -> tuple[str, ...]:
    """The token-major buffers of a pool kind (NSA's index buffer is page-packed)."""
    return {"mha": ("k_buffer", "v_buffer"), "konly": ("k_buffer",)}.get(kind, ("kv_buffer",))


def buffer_names(kind: str) -> tuple[str, ...]:
    return row_buffer_names(kind) + (("index_k_with_scale_buffer",) if kind == "nsa" else ())


# Each setter of each kind, with the buffers it replaces.
SETTERS = {
    "mha": {"set_kv": ("k_buffer", "v_buffer"), "set_k": ("k_buffer",)},
    "konly": {"set_k": ("k_buffer",)},
    "mla": {"set_kv": ("kv_buffer",), "set_k": ("kv_buffer",), "set_mla_kv": ("kv_buffer",)},
    "nsa": {
        "set_kv": ("kv_buffer",),
        "set_k": ("kv_buffer",),
        "set_mla_kv": ("kv_buffer",),
        "set_index_k": ("index_k_with_scale_buffer",),
    },
}


def key_row_shape(pool) -> tuple[int, ...]:
    """Per-token shape of `cache_k` (MLA/NSA: the whole latent row)."""
    if hasattr(pool, "kv_buffer"):
        return (1, pool.kv_lora_rank + pool.qk_rope_head_dim)
    return (pool.head_num, pool.head_dim)


def random_values(rng: np.random.Generator, shape, spread: float = 4.0) -> np.ndarray:
    return (rng.standard_normal(shape) * spread).astype(np.float32)


def setter_args(pool, name: str, t: int, rng: np.random.Generator) -> tuple:
    """Random float32 value arguments of setter `name` for `t` tokens (after layer_id, loc)."""
    if name == "set_index_k":
        return (random_values(rng, (t, pool.index_head_dim)),)
    if name == "set_mla_kv":
        return (
            random_values(rng, (t, 1, pool.kv_lora_rank)),
            random_values(rng, (t, 1, pool.qk_rope_head_dim)),
        )
    k = random_values(rng, (t, *key_row_shape(pool)))
    if name == "set_k":
        return (k,)
    has_v = hasattr(pool, "v_buffer")
    return (k, random_values(rng, (t, pool.head_num, pool.v_head_dim)) if has_v else None)


def call_setter(pool, name: str, layer_id: int, loc, rng: np.random.Generator, **kw):
    """Calls setter `name` with random values of the right shapes for `len(loc)` tokens."""
    return getattr(pool, name)(layer_id, loc, *setter_args(pool, name, len(loc), rng), **kw)


def fill_all(pool, kind: str, layer_id: int, loc, rng: np.random.Generator, **kw):
    """Writes random values at `loc` into every buffer of `layer_id` (one call per buffer)."""
    done = set()
    for name, writes in SETTERS[kind].items():
        if not done.issuperset(writes):
            pool = call_setter(pool, name, layer_id, loc, rng, **kw)
            done.update(writes)
    return pool


def snapshot(pool, kind: str) -> dict[str, list[np.ndarray]]:
    """Every buffer's raw bits (`jaxkv.testing.buffer_bits`), by buffer name, per layer."""
    return {name: testing.buffer_bits(getattr(pool, name)) for name in buffer_names(kind)}


def flush_subnormals(x) -> np.ndarray:
    """float32 `x` with subnormals replaced by zeros of the same sign and every NaN by the quiet
    NaN 0x7FC00000 (jaxkv's division and products do that on every backend)."""
    x = np.asarray(x, np.float32)
    tiny = np.finfo(np.float32).tiny
    x = np.where(np.abs(x) < tiny, np.copysign(np.float32(0.0), x), x).astype(np.float32)
    return np.where(np.isnan(x), np.uint32(0x7FC00000).view(np.float32), x)


def as_float32(values) -> np.ndarray:
    with np.errstate(over="ignore"):  # float64 beyond float32's range: inf, as on the device
        return np.asarray(values).astype(np.float32)


def encode_ref(values, dtype, scale=None) -> np.ndarray:
    """The stored bits (store dtype) of `values` written into a pool of logical `dtype`."""
    dtype = jnp.dtype(dtype)
    if np.asarray(values).dtype == dtype:
        scale = None  # a value already in the pool dtype is stored as it is (SGLang)
    x = as_float32(values)
    if scale is not None:
        with np.errstate(over="ignore", divide="ignore"):
            x = flush_subnormals(flush_subnormals(x) / flush_subnormals(np.float32(scale)))
        in_dtype = np.asarray(values).dtype
        if in_dtype.kind == "V" or (in_dtype.kind == "f" and in_dtype.itemsize < 4):
            # 16- and 8-bit inputs are divided in their own dtype (SGLang): the quotient is
            # rounded to it before the cast to the pool dtype.
            with np.errstate(over="ignore"):
                x = x.astype(in_dtype).astype(np.float32)
    if dtype.itemsize == 1:
        limit = np.float32(ml_dtypes.finfo(dtype).max)
        x = np.clip(x, -limit, limit)
    with np.errstate(over="ignore"):
        return x.astype(dtype).view(STORE_DTYPES[dtype])


def decode_ref(bits: np.ndarray, dtype) -> np.ndarray:
    """Stored bits -> float32 values of logical `dtype`."""
    return np.asarray(bits).view(jnp.dtype(dtype)).astype(np.float32)


def finite_amax(x: np.ndarray) -> np.ndarray:
    """max |x| over the last axis (kept) of the finite values only (0 when there are none)."""
    return np.max(np.where(np.isfinite(x), np.abs(x), 0), axis=-1, keepdims=True)


def quantize_index_ref(index_k) -> np.ndarray:
    """NSA records uint8 `(T, D + 4)`: fp8-e4m3 key bytes, then the float32 scale (LE)."""
    x = flush_subnormals(as_float32(index_k))
    amax = finite_amax(x)  # inf saturates to code 448, NaN stays in its own key
    scale = flush_subnormals(np.maximum(amax, INDEX_AMAX_FLOOR) / E4M3_MAX)
    q = flush_subnormals(x / scale)
    keys = np.clip(q, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    scale_bytes = scale.astype("<f4").view(np.uint8)
    return np.concatenate([keys, scale_bytes], axis=-1)


def _saturate(x: np.ndarray, limit) -> np.ndarray:
    """float32 `x` with magnitudes above `limit` (inf included) set to +-limit (NaN kept)."""
    limit = np.float32(limit)
    return np.where(np.abs(x) > limit, np.copysign(limit, x), x).astype(np.float32)


def pack_latent_ref(k_nope, k_rope) -> np.ndarray:
    """Packed NSA rows uint8 `(..., packed_width)` of latent `k_nope (..., L)` and `k_rope
    (..., R)`: fp8-e4m3 codes, one float32 scale per 128 latent values, bfloat16 rope."""
    x = flush_subnormals(as_float32(k_nope))
    lead = x.shape[:-1]
    tiles = x.reshape(*lead, -1, LATENT_TILE)
    scale = flush_subnormals(finite_amax(tiles) / E4M3_MAX)  # inf -> code 448, NaN kept
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inverse = flush_subnormals(np.float32(1.0) / scale)
        q = flush_subnormals(tiles * inverse)
    q = np.where(np.isnan(q) & ~np.isnan(tiles), np.copysign(np.float32(0.0), tiles), q)
    codes = np.clip(q, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    bf16_max = ml_dtypes.finfo(ml_dtypes.bfloat16).max
    rope = _saturate(as_float32(k_rope), bf16_max).astype(ml_dtypes.bfloat16)
    parts = (codes, scale.astype("<f4").view(np.uint8), rope.view(np.uint8))
    return np.concatenate([p.reshape(*lead, -1) for p in parts], axis=-1)


def unpack_latent_ref(rows, kv_lora_rank: int) -> np.ndarray:
    """Packed rows uint8 `(..., packed_width)` -> float32 `(..., L + R)`: code * scale per latent
    value (float32), then the rope values."""
    rows = np.asarray(rows)
    lead, tiles = rows.shape[:-1], kv_lora_rank // LATENT_TILE
    codes = rows[..., :kv_lora_rank].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = np.ascontiguousarray(rows[..., kv_lora_rank : kv_lora_rank + 4 * tiles]).view("<f4")
    with np.errstate(invalid="ignore"):
        nope = codes.reshape(*lead, tiles, LATENT_TILE) * flush_subnormals(scale)[..., None]
    nope = flush_subnormals(nope).reshape(*lead, kv_lora_rank)
    rope = np.ascontiguousarray(rows[..., kv_lora_rank + 4 * tiles :]).view(ml_dtypes.bfloat16)
    return np.concatenate([nope, rope.astype(np.float32)], axis=-1)


def latent_rows_ref(pool, cache_k, scale=None) -> np.ndarray:
    """The stored `kv_buffer` rows of latent rows `cache_k (T, 1, L + R)` written by `set_kv` or
    `set_k` (packed rows take no scale: each tile carries its own)."""
    if is_packed(pool):
        x = np.asarray(cache_k)
        return pack_latent_ref(x[..., : pool.kv_lora_rank], x[..., pool.kv_lora_rank :])
    return encode_ref(cache_k, pool.dtype, scale)


def mla_rows_ref(pool, k_nope, k_rope) -> np.ndarray:
    """The stored `kv_buffer` rows that `set_mla_kv(k_nope, k_rope)` writes."""
    if is_packed(pool):
        return pack_latent_ref(k_nope, k_rope)
    return np.concatenate([encode_ref(k_nope, pool.dtype), encode_ref(k_rope, pool.dtype)], -1)


def latent_read_ref(pool, rows) -> np.ndarray:
    """What latent readers return for stored rows, as float32 (packed rows: dequantised)."""
    if is_packed(pool):
        return unpack_latent_ref(rows, pool.kv_lora_rank)
    return decode_ref(rows, pool.dtype)


def index_pages_ref(records: np.ndarray, page_size: int) -> np.ndarray:
    """Per-slot records `(rows, D + 4)` -> SGLang's page layout `(pages, page_size * (D + 4))`:
    each page holds its tokens' keys, then their scales."""
    rows, width = records.shape
    pages = records.reshape(rows // page_size, page_size, width)
    keys = pages[:, :, : width - 4].reshape(rows // page_size, -1)
    scales = pages[:, :, width - 4 :].reshape(rows // page_size, -1)
    return np.concatenate([keys, scales], axis=-1)


# A numpy view or DLPack export aliases a pool buffer only for CPU arrays: on an accelerator
# np.asarray copies to the host and np.from_dlpack refuses device memory, so nothing keeps XLA
# from reusing the buffer and no copy is forced (tests that hold a view run there unviewed).
HOST_VIEWS = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="host views alias pool buffers only on CPU: no forced copy to report elsewhere",
)


def host(x) -> np.ndarray:
    """A host copy of a device array, bit-exact.

    A copy, not `np.asarray`: on CPU that is a zero-copy view, and a live view of a buffer makes
    JAX fall back to copying it when it is donated, so the donation tests would test nothing.
    """
    return np.array(jax.device_get(x), copy=True)


def random_mha_pool(
    seed: int = 0,
    *,
    size: int = 64,
    head_num: int = 1,
    head_dim: int = 2,
    layer_num: int = 1,
    dtype=np.float32,
) -> jaxkv.MHAPool:
    """An MHA pool (page size 1) whose every row, the padding row too, holds random values."""
    pool = jaxkv.MHAPool.create(
        size=size, dtype=dtype, head_num=head_num, head_dim=head_dim, layer_num=layer_num
    )
    rng = np.random.default_rng(seed)
    loc = np.arange(pool.size + 1)
    for layer in range(layer_num):
        k, v = (rng.standard_normal((loc.size, head_num, head_dim)) for _ in range(2))
        pool = pool.set_kv(layer, loc, k.astype(np.float32), v.astype(np.float32))
    return pool


def raw_rows(pool, slots) -> np.ndarray:
    """The stored rows at `slots` of every K layer, then every V layer:
    `(2 * layer_num, len(slots), *row)`, compared with `jaxkv.testing.assert_bits_equal`."""
    slots = np.asarray(slots)
    return np.stack([np.asarray(b)[slots] for b in (*pool.k_buffer, *pool.v_buffer)])


def row_bits(pool, slots) -> np.ndarray:
    """The raw bits (`jaxkv.testing.raw_bits`) of every K and V row of every layer at `slots`,
    side by side: `(len(slots), words)`, whatever the rows' shapes (K and V may differ)."""
    slots = np.asarray(slots, dtype=np.int64)
    bufs = (*pool.k_buffer, *pool.v_buffer)
    return np.concatenate(
        [
            testing.raw_bits(np.asarray(b)[slots]).reshape(slots.size, math.prod(b.shape[1:]))
            for b in bufs
        ],
        axis=1,
    )


def require(missing: list[str], what: str) -> None:
    """Nothing when `missing` is empty; else the test fails under CI (which installs what the
    tests need) and is skipped elsewhere, saying what is missing for `what`."""
    if missing:
        reason = "; ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(f"CI needs {what}: {reason}")
        pytest.skip(reason)


def python_env(env: dict | None = None) -> dict:
    """The environment of a Python process a test starts: this one's, on CPU, with the
    repository first on the path; `env` adds or overrides variables (`XLA_FLAGS` are added to
    this process's, see tests/conftest.py)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(env or {})
    if "XLA_FLAGS" in env:
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {env['XLA_FLAGS']}".strip()
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path, **env}


def run_python(*args: str, timeout: float, env: dict | None = None, check: bool = True):
    """Runs `python *args` in a fresh interpreter at the repository root and returns the
    completed process (text stdout and stderr).

    The child runs on CPU (`JAX_PLATFORMS=cpu`: an accelerator already held by this process
    cannot be shared) with the repository first on its path; `env` adds or overrides
    variables. With `check` a non-zero exit fails the test showing the child's output, and so
    does running past `timeout` seconds.
    """
    full_env = python_env(env)
    cmd = [sys.executable, *args]
    shown = " ".join(a if len(a) < 80 else a[:77] + "..." for a in cmd)
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(
            f"{shown}: still running after {timeout} s\nstdout:\n{out[-3000:]}\n"
            f"stderr:\n{err[-3000:]}"
        )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{shown}: exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-3000:]}"
        )
    return proc


def run_example(name: str) -> int | str | None:
    """Runs `examples/<name>` in this process as `python examples/<name>` runs it (as the
    `__main__` module) and returns its exit status; what it prints goes to this process's
    stdout (pytest's `capsys` reads it). Cheaper than `run_python`: no fresh interpreter
    importing jax, and the programs it compiles are this process's."""
    try:
        runpy.run_path(str(REPO / "examples" / name), run_name="__main__")
    except SystemExit as done:
        return done.code
    return 0


# --------------------------------------------------------------------------------------------
# Connector pools: every kind with random raw bits, and a numpy model of what a load leaves

# The connector tests' pool kinds, in the connector's spelling (`k_only`).
CONNECTOR_KINDS = ("mha", "k_only", "mla", "nsa")
INDEX_ATTR = "index_k_with_scale_buffer"
INDEX_HEAD_DIM = 8


def bits_dtype(dtype) -> np.dtype:
    return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


def connector_pool(kind, *, size=64, page_size=4, dtype=jnp.bfloat16, layer_num=2, start_layer=0):
    """A small zeroed jaxkv pool of connector kind `kind` (one of `CONNECTOR_KINDS`)."""
    common = dict(
        size=size, page_size=page_size, dtype=dtype, layer_num=layer_num, start_layer=start_layer
    )
    if kind == "mha":
        return MHAPool.create(head_num=2, head_dim=4, v_head_dim=3, **common)
    if kind == "k_only":
        return KOnlyPool.create(head_num=2, head_dim=4, **common)
    if kind == "mla":
        return MLAPool.create(kv_lora_rank=6, qk_rope_head_dim=2, **common)
    return NSAPool.create(
        kv_lora_rank=nsa_rank(dtype), qk_rope_head_dim=2, index_head_dim=INDEX_HEAD_DIM, **common
    )


def nsa_rank(dtype) -> int:
    """fp8 NSA pools pack the latent in tiles of 128 values: their rank is a multiple of 128."""
    return 128 if np.dtype(dtype).itemsize == 1 else 6


def nsa_kv_row(dtype) -> tuple[int, int]:
    """Per-token `kv_buffer` row of `connector_pool("nsa", dtype=dtype)`: fp8 pools keep SGLang's
    packed row (fp8 latent, a float32 scale per 128 values, bfloat16 rope), others the values."""
    rank = nsa_rank(dtype)
    return (1, rank + 4 * (rank // 128) + 2 * 2) if np.dtype(dtype).itemsize == 1 else (1, rank + 2)


def buffer_attrs(pool) -> tuple[str, ...]:
    """The per-layer buffer attributes an object has, in SGLang's names."""
    names = ("k_buffer", "v_buffer", "kv_buffer", INDEX_ATTR)
    return tuple(a for a in names if hasattr(pool, a))


def random_bits(rng, shape, dtype) -> np.ndarray:
    """Uniformly random raw bit patterns viewed as `dtype` (NaNs, infs and subnormals included)."""
    bits = bits_dtype(dtype)
    return rng.integers(0, np.iinfo(bits).max, shape, dtype=bits, endpoint=True).view(dtype)


def fill_random_bits(pool, rng):
    """Writes random bits into every row of every layer (NSA: random index keys too)."""
    loc = np.arange(pool.size + pool.page_size)
    t = loc.shape[0]
    for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
        if isinstance(pool, MHAPool):
            k = random_bits(rng, (t, pool.head_num, pool.head_dim), pool.dtype)
            v = random_bits(rng, (t, pool.head_num, pool.v_head_dim), pool.dtype)
            pool = pool.set_kv(layer, loc, jnp.asarray(k), jnp.asarray(v))
        elif isinstance(pool, KOnlyPool):
            k = random_bits(rng, (t, pool.head_num, pool.head_dim), pool.dtype)
            pool = pool.set_k(layer, loc, jnp.asarray(k))
        else:
            width = pool.kv_lora_rank + pool.qk_rope_head_dim
            latent = jnp.asarray(random_bits(rng, (t, 1, width), pool.dtype))
            if isinstance(pool, NSAPool) and np.dtype(pool.dtype).itemsize == 1:
                # Packed fp8 rows: random raw rows, written as they are (uint8 in and stored).
                latent = jnp.asarray(random_bits(rng, (t, *nsa_kv_row(pool.dtype)), np.uint8))
            pool = pool.set_kv(layer, loc, latent, None)
            if isinstance(pool, NSAPool):
                mag = 10.0 ** rng.uniform(-3, 3, (t, 1))
                index = (rng.standard_normal((t, pool.index_head_dim)) * mag).astype(np.float32)
                pool = pool.set_index_k(layer, loc, index)
    return pool


def random_connector_pool(kind: str, seed: int = 0, **create):
    """`connector_pool(kind, **create)` with random raw bits in every row (`fill_random_bits`)."""
    return fill_random_bits(connector_pool(kind, **create), np.random.default_rng(seed))


def bits_by_attr(pool) -> dict[str, list[np.ndarray]]:
    """Every layer buffer's raw bits (`jaxkv.testing.buffer_bits`) by SGLang attribute name,
    of a jaxkv pool or an SGLang-shaped object: what `model_load` takes."""
    return {attr: testing.buffer_bits(getattr(pool, attr)) for attr in buffer_attrs(pool)}


def index_positions(slot: int, page_size: int, head_dim: int) -> np.ndarray:
    """Flat byte offsets of one token's record (fp8 keys, then its float32 scale) in SGLang's
    indexer layout `(pages, page_size * (head_dim + 4))`."""
    page, off = divmod(int(slot), page_size)
    base = page * page_size * (head_dim + 4)
    keys = base + off * head_dim + np.arange(head_dim)
    scale = base + page_size * head_dim + off * 4 + np.arange(4)
    return np.concatenate([keys, scale])


def token_rows(attr, buf, slots, page_size) -> np.ndarray:
    """Per-token entries `(T, *row)` of one buffer at `slots`."""
    slots = np.asarray(slots)
    if attr != INDEX_ATTR:
        return buf[slots]
    flat = buf.reshape(-1)
    return np.stack([flat[index_positions(s, page_size, INDEX_HEAD_DIM)] for s in slots])


def model_load(before, src, src_slots, dst_slots, page_size):
    """What `dst` must hold after rows `src_slots` of `src` were loaded into `dst_slots`."""
    out = {}
    for attr, layers in before.items():
        out[attr] = []
        for li, buf in enumerate(layers):
            new = buf.copy()
            rows = token_rows(attr, src[attr][li], src_slots, page_size)
            if attr == INDEX_ATTR:
                flat = new.reshape(-1)
                for s, row in zip(dst_slots, rows, strict=True):
                    flat[index_positions(s, page_size, INDEX_HEAD_DIM)] = row
            else:
                new[np.asarray(dst_slots)] = rows
            out[attr].append(new)
    return out


def scattered_slots(rng, *, size, page_size, n):
    """`n` slots as an allocator hands them out: scattered single slots for token pools,
    whole pages in a shuffled order for paged pools (never page 0)."""
    pages = rng.permutation(np.arange(1, size // page_size + 1))[: -(-n // page_size)]
    return np.concatenate([p * page_size + np.arange(page_size) for p in pages])[:n]


def roundtrip(src, dst, conn, *, rng, size, page_size, n_tokens):
    """Stores `n_tokens` (full blocks plus a partial tail) of `src` and loads them into other
    slots of `dst`; checks every layer and part of `dst` against the numpy model."""
    bs = conn.block_size
    tokens = rng.integers(0, 50_000, n_tokens)
    src_slots = scattered_slots(rng, size=size, page_size=page_size, n=n_tokens)
    dst_slots = scattered_slots(rng, size=size, page_size=page_size, n=n_tokens)
    full = n_tokens // bs * bs
    assert conn.store(src, tokens, src_slots) == n_tokens // bs
    assert conn.lookup(tokens) == full
    src_raw, before = bits_by_attr(src), bits_by_attr(dst)
    dst, n = conn.load(dst, tokens, dst_slots)
    assert n == full
    want = model_load(before, src_raw, src_slots[:n], dst_slots[:n], page_size)
    testing.assert_bits_equal(bits_by_attr(dst), want)
    return dst


# --------------------------------------------------------------------------------------------
# Store tests: sequences of whole 16-token blocks over `random_mha_pool`s

STORE_BLOCK_SIZE = 16


def token_seq(i: int, blocks: int = 1) -> np.ndarray:
    """Token ids of test sequence `i`, `blocks` blocks of `STORE_BLOCK_SIZE` tokens (distinct
    sequences never share a first block)."""
    return np.arange(blocks * STORE_BLOCK_SIZE) + 1000 * i


def assert_rows(pool, slots, want) -> None:
    """The stored rows of `pool` at `slots` are bit for bit `want` (from `raw_rows`)."""
    testing.assert_bits_equal(raw_rows(pool, slots), want)


def block_key(i: int) -> str:
    """Block key number `i`: 64 hex digits, as the connector's keys are."""
    return f"{i:064x}"


def small_record(key: str, value: float, n: int = 4) -> BlockRecord:
    """A record of one float32 part of shape (1, n) filled with `value` (16 bytes at n=4)."""
    return BlockRecord(
        key=key, layout="L", tokens="T", parts={"k": np.full((1, n), value, np.float32)}
    )


def record_path(root, key: str) -> str:
    """Where a `DiskStore` rooted at `root` keeps the record of `key`."""
    return os.path.join(root, key[:2], key + ".kvb")


# --------------------------------------------------------------------------------------------
# Hostile arguments at the public boundary (the allocators' and the connector's fuzzers)

# What a refused call may raise; the message names the argument refused.
BOUNDARY_ERRORS = (ValueError, TypeError, IndexError)
# One argument of any wrong kind: ints past int64 and negative ones, floats (NaN included),
# bools, None, text, lists nested or past int64, numpy ints and uint64 vectors past int64.
HOSTILE_ARG = st.one_of(
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


def names_an_argument(err: BaseException, names) -> bool:
    """Whether the message of `err` names one of `names` (as a whole word)."""
    return any(re.search(rf"\b{n}\b", str(err)) for n in names)
