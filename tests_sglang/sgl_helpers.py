"""Shared helpers of the SGLang comparison tests: pool factories, random fills, raw bits.

Importing this module sets TRITON_INTERPRET=1 (as conftest.py does first): SGLang's Triton
kernels then run on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before SGLang's modules decorate their Triton kernels

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    DSATokenToKVPool,
    MHATokenToKOnlyPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)

import jaxkv  # noqa: E402
from jaxkv import testing  # noqa: E402

# (torch dtype, jnp dtype) of every pool dtype both sides support.
DTYPES = {
    "float32": (torch.float32, jnp.dtype(jnp.float32)),
    "bfloat16": (torch.bfloat16, jnp.dtype(jnp.bfloat16)),
    "float16": (torch.float16, jnp.dtype(jnp.float16)),
    "float8_e4m3fn": (torch.float8_e4m3fn, jnp.dtype(jnp.float8_e4m3fn)),
    "float8_e5m2": (torch.float8_e5m2, jnp.dtype(jnp.float8_e5m2)),
}
FP8 = ("float8_e4m3fn", "float8_e5m2")

# Small shapes; v_head_dim != head_dim and kv_lora_rank != qk_rope_head_dim so a swapped axis
# shows. SGLang's DSA pool requires 64-token pages, index_head_dim 128, and (for fp8) the
# DeepSeek latent 512 + 64.
MHA = dict(head_num=2, head_dim=8, v_head_dim=4)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8)
NSA = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)
NSA_PAGE = 64
NSA_ROW = {"bfloat16": 576, "float8_e4m3fn": 656}  # fp8: 512 fp8 + 4 fp32 scales + 64 bf16


def sglang_pool(kind: str, dtype: str, *, size: int, page_size: int, layer_num: int = 2, **kw):
    """A real SGLang pool on the CPU: kind "mha", "k_only", "mla" or "nsa"."""
    common = dict(
        size=size,
        page_size=page_size,
        dtype=DTYPES[dtype][0],
        layer_num=layer_num,
        device="cpu",
        enable_memory_saver=False,
        **kw,
    )
    if kind == "mha":
        return MHATokenToKVPool(**{**MHA, **common})
    if kind == "k_only":
        return MHATokenToKOnlyPool(head_num=MHA["head_num"], head_dim=MHA["head_dim"], **common)
    if kind == "mla":
        return MLATokenToKVPool(**{**MLA, **common})
    return DSATokenToKVPool(**NSA, **common, kv_cache_dim=NSA_ROW[dtype], index_buf_size=size)


def jaxkv_pool(kind: str, dtype: str, *, size: int, page_size: int, layer_num: int = 2, **kw):
    """The jaxkv pool of the same shape as `sglang_pool(kind, dtype, ...)`."""
    common = dict(size=size, page_size=page_size, dtype=DTYPES[dtype][1], layer_num=layer_num)
    if kind == "mha":
        return jaxkv.MHAPool.create(**MHA, **common, **kw)
    if kind == "k_only":
        return jaxkv.KOnlyPool.create(
            head_num=MHA["head_num"], head_dim=MHA["head_dim"], **common, **kw
        )
    if kind == "mla":
        return jaxkv.MLAPool.create(**MLA, **common, **kw)
    return jaxkv.NSAPool.create(**NSA, **common, **kw)


BUFFERS = {
    "mha": ("k_buffer", "v_buffer"),
    "k_only": ("k_buffer",),
    "mla": ("kv_buffer",),
    "nsa": ("kv_buffer", "index_k_with_scale_buffer"),
}


def fill_random(pool, kind: str, seed: int) -> None:
    """Random bytes into every buffer of every layer, through torch (NaN payloads included)."""
    gen = torch.Generator().manual_seed(seed)
    for attr in BUFFERS[kind]:
        for buf in getattr(pool, attr):
            raw = buf.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def buffers(pool, kind: str) -> dict[str, list]:
    """Every buffer of an SGLang or jaxkv pool by attribute name, per layer: a pytree that
    `jaxkv.testing` reads (torch tensors and jax arrays alike)."""
    return {a: list(getattr(pool, a)) for a in BUFFERS[kind]}


def raw(pool, kind: str) -> dict[str, list[np.ndarray]]:
    """Every buffer's raw bits (`jaxkv.testing.buffer_bits`), per attribute and layer."""
    return {a: testing.buffer_bits(layers) for a, layers in buffers(pool, kind).items()}


def expected_load(before, src, src_slots, dst_slots, page_size: int):
    """The bits a bit-exact load of rows `src_slots` into rows `dst_slots` leaves, per
    buffer (from `raw`): token rows, and for NSA each token's index key bytes and scale in
    its page (index buffers are bytes)."""
    out = {a: [b.copy() for b in layers] for a, layers in before.items()}
    for attr, layers in out.items():
        for li, dst in enumerate(layers):
            s = src[attr][li]
            if attr != "index_k_with_scale_buffer":
                dst[dst_slots] = s[src_slots]
                continue
            width = dst.shape[1] // page_size - 4  # key bytes per token
            for a, b in zip(src_slots, dst_slots):
                (ps, os_), (pd, od) = divmod(int(a), page_size), divmod(int(b), page_size)
                dst[pd, od * width : (od + 1) * width] = s[ps, os_ * width : (os_ + 1) * width]
                keys = page_size * width
                dst[pd, keys + 4 * od : keys + 4 * od + 4] = s[
                    ps, keys + 4 * os_ : keys + 4 * os_ + 4
                ]
    return out
