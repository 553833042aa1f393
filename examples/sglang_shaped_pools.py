"""The connector on pools it did not create: SGLang-shaped objects, K-only included.

    python examples/sglang_shaped_pools.py

SGLang's FlexKV connector reads a pool's buffers by attribute name and crashes on
`MHATokenToKOnlyPool` (it has `k_buffer` but no `v_buffer`). jaxkv's connector accepts every
SGLang layout: `kv_buffer` (MLA, plus `index_k_with_scale_buffer` for NSA), `k_buffer` +
`v_buffer` (MHA) and `k_buffer` alone (K-only), with numpy, jax or any DLPack arrays, and
tells you clearly when an object has none of them.

1. A host-side K-only pool (lists of numpy arrays, as a MiniMax sparse index pool keeps them):
   store a prefix, reload it into other slots of a second object, check it bit-exact.
2. An MLA pool whose latent rows are jax arrays: same round trip.
3. An object with neither layout: `UnsupportedKVCacheError`, an `AttributeError`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv import UnsupportedKVCacheError
from jaxkv.connector import HostStore, KVConnector

ROWS, LAYERS, TOKENS = 129, 3, 48  # 128 slots + the padding page


class KOnlyIndexPool:
    """Looks like SGLang's MHATokenToKOnlyPool: per-layer `k_buffer`, no `v_buffer`."""

    def __init__(self, rng=None):
        shape = (ROWS, 4, 64)
        fill = (
            (lambda: rng.integers(0, 2**16, shape, dtype=np.uint16))
            if rng
            else (lambda: np.zeros(shape, np.uint16))
        )
        self.k_buffer = [fill() for _ in range(LAYERS)]


class LatentPool:
    """Looks like SGLang's MLATokenToKVPool: per-layer `kv_buffer` of 512 + 64 latent rows."""

    def __init__(self, rng=None):
        rows = (ROWS, 1, 576)
        self.kv_buffer = [
            jnp.asarray(rng.standard_normal(rows) if rng else np.zeros(rows), jnp.bfloat16)
            for _ in range(LAYERS)
        ]


def round_trip(name: str, src, dst, read) -> bool:
    tokens = np.arange(TOKENS) * 7 % 1000
    conn = KVConnector(src, HostStore(64 << 20))
    written = conn.store(src, tokens, np.arange(1, TOKENS + 1))
    dst, n = conn.load(dst, tokens, np.arange(70, 70 + TOKENS))
    same = all(
        np.array_equal(read(dst, layer)[70 : 70 + n], read(src, layer)[1 : 1 + n])
        for layer in range(LAYERS)
    )
    print(
        f"{name}: stored {written} blocks of {conn.block_size} tokens, loaded {n} tokens, "
        f"bit-exact: {same}"
    )
    return same and n == TOKENS


def main() -> int:
    rng = np.random.default_rng(0)
    ok = round_trip(
        "K-only numpy pool",
        KOnlyIndexPool(rng),
        KOnlyIndexPool(),
        lambda pool, layer: pool.k_buffer[layer],
    )
    ok &= round_trip(
        "MLA jax pool",
        LatentPool(rng),
        LatentPool(),
        lambda pool, layer: np.asarray(pool.kv_buffer[layer]).view(np.uint16),
    )

    class HybridCache:  # a linear-attention state, say: no per-layer KV buffers
        ssm_state = [np.zeros((4, 4))]

    try:
        KVConnector(HybridCache(), HostStore(1 << 20))
        ok = False
    except UnsupportedKVCacheError as err:
        print(
            f"HybridCache: {type(err).__name__} (an AttributeError: "
            f"{isinstance(err, AttributeError)}): {err}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
