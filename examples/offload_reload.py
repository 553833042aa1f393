"""Offload a prompt prefix's KV to disk, "restart", and reload it bit-exact into fresh slots.

    python examples/offload_reload.py

1. Make a bfloat16 MHA pool and write K/V for the 40 tokens of a prompt (as a prefill would).
2. Store its full blocks with a `KVConnector` into a `DiskStore` in a temporary folder.
3. Restart: a new, empty pool and a new `DiskStore` on the same folder (nothing kept in memory).
4. `lookup` the prompt, `load` the stored prefix into other slots and check it bit-exact.
"""

from __future__ import annotations

import tempfile

import jax.numpy as jnp
import numpy as np

from jaxkv import MHAPool, TokenAllocator
from jaxkv.connector import DiskStore, KVConnector

POOL = dict(size=256, head_num=4, head_dim=32, layer_num=4, dtype=jnp.bfloat16)


def prefill(pool: MHAPool, slots: np.ndarray, rng: np.random.Generator) -> MHAPool:
    """Writes made-up K/V for every layer at `slots`, standing in for a model's prefill."""
    shape = (len(slots), pool.head_num, pool.head_dim)
    for layer in range(pool.layer_num):
        k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        pool = pool.set_kv(layer, slots, k, v)
    return pool


def main() -> int:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32_000, 40)  # 2 full blocks of 16, plus an 8-token tail

    with tempfile.TemporaryDirectory(prefix="jaxkv-offload-") as path:
        # ---- before the restart --------------------------------------------------------------
        pool = MHAPool.create(**POOL)
        slots = TokenAllocator(POOL["size"]).alloc(len(tokens))
        pool = prefill(pool, slots, rng)
        conn = KVConnector(pool, DiskStore(path))
        written = conn.store(pool, tokens, slots)
        stored = conn.export_blocks(pool, slots[: written * conn.block_size])
        print(
            f"stored {written} blocks of {conn.block_size} tokens "
            f"({len(tokens)} tokens, the partial tail is not stored) into {path}"
        )
        del pool, conn  # the process "restarts": only the files remain

        # ---- after the restart ---------------------------------------------------------------
        pool = MHAPool.create(**POOL)
        allocator = TokenAllocator(POOL["size"])
        allocator.alloc(100)  # the new process has other requests: the prefix lands elsewhere
        new_slots = allocator.alloc(len(tokens))
        store = DiskStore(path)
        conn = KVConnector(pool, store)
        hit = conn.lookup(tokens)
        print(f"restarted: the new DiskStore found {len(store)} blocks; lookup -> {hit} tokens")
        pool, loaded = conn.load(pool, tokens, new_slots)
        print(
            f"loaded {loaded} tokens into slots {new_slots[0]}..{new_slots[loaded - 1]} "
            f"(they were in {slots[0]}..{slots[loaded - 1]})"
        )

        reloaded = conn.export_blocks(pool, new_slots[:loaded])
        exact = loaded == hit == 32 and all(
            np.array_equal(stored[key], reloaded[key]) for key in stored
        )
        print(f"K and V of {POOL['layer_num']} layers bit-exact: {exact}")
        print(f"disk store stats: {conn.stats()['store']}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
