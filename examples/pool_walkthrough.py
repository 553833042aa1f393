"""A walk through the pools and the paged allocator, without a model.

    python examples/pool_walkthrough.py

Four requests get slots from a `PagedAllocator` (prefill with `alloc_extend`, then decode steps
with `alloc_decode`); their K/V go into an MHA, an MLA and a K-only pool through one jitted step
per pool that donates the pool, so every write is in place. Everything written is read back and
compared bit for bit with a host copy, and the buffer pointers are checked to be unchanged.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import KOnlyPool, MHAPool, MLAPool, PagedAllocator

PAGE = 16
SIZE = 4096
LAYERS = 4
PROMPTS = (37, 64, 5, 100)
DECODE_STEPS = 8


def _pools():
    common = dict(size=SIZE, page_size=PAGE, layer_num=LAYERS, dtype=jnp.bfloat16)
    return {
        "MHA 8x64": MHAPool.create(head_num=8, head_dim=64, **common),
        "MLA 512+64": MLAPool.create(kv_lora_rank=512, qk_rope_head_dim=64, **common),
        "K-only 4x128": KOnlyPool.create(head_num=4, head_dim=128, **common),
    }


def _writer(pool):
    """A jitted step writing one (T, *row) array per layer into every layer of `pool`."""
    if isinstance(pool, MHAPool):

        def write(p, layer, loc, rows):
            return p.set_kv(layer, loc, rows, rows[..., : p.v_head_dim])
    else:

        def write(p, layer, loc, rows):
            return p.set_k(layer, loc, rows)

    def step(p, loc, rows):
        for i in range(p.layer_num):
            p = write(p, p.start_layer + i, loc, rows[i])
        return p

    return jax.jit(step, donate_argnums=0)


def _row_shape(pool):
    return pool.buffer_specs()[0].row_shape


def run() -> int:
    print(
        f"jaxkv demo on {jax.devices()[0].platform}: {len(PROMPTS)} requests, prompts "
        f"{list(PROMPTS)}, {DECODE_STEPS} decode steps, page size {PAGE}, {LAYERS} layers\n"
    )
    alloc = PagedAllocator(SIZE, PAGE)
    seq = np.array(PROMPTS)
    prefill = alloc.alloc_extend(np.zeros_like(seq), seq, np.full_like(seq, -1))
    assert prefill is not None, "pool too small for the prompts"
    last = np.cumsum(seq) - 1
    batches = [prefill]
    for _ in range(DECODE_STEPS):
        seq = seq + 1
        loc = alloc.alloc_decode(seq, prefill[last] if len(batches) == 1 else batches[-1])
        batches.append(loc)
    print(
        f"allocator: {sum(b.size for b in batches)} slots in use, "
        f"{alloc.available_size()} of {SIZE} tokens free, prefill slots "
        f"{prefill[:4].tolist()}..., first decode slots {batches[1].tolist()}\n"
    )

    rng = np.random.default_rng(0)
    header = (
        f"{'pool':<14}{'bytes':>12}{'tokens':>8}{'prefill ms':>12}{'decode us/step':>16}  check"
    )
    print(header)
    print("-" * len(header))
    ok = True
    for name, pool in _pools().items():
        step = _writer(pool)
        row = _row_shape(pool)
        pointer = pool.buffers(pool.buffer_specs()[0].name)[0].unsafe_buffer_pointer()
        expected = np.zeros((LAYERS, pool.rows, *row), np.float32)
        times = []
        for i, loc in enumerate(batches):
            vals = rng.standard_normal((LAYERS, loc.size, *row)).astype(np.float32)
            vals = np.asarray(jnp.asarray(vals, jnp.bfloat16).astype(jnp.float32))
            expected[:, loc] = vals
            rows = jnp.asarray(vals, jnp.bfloat16)
            loc_dev = jnp.asarray(loc, jnp.int32)
            if i == 1:  # compile the decode shape outside the timing
                jax.block_until_ready(step(jax.tree_util.tree_map(jnp.copy, pool), loc_dev, rows))
            start = time.perf_counter()
            pool = step(pool, loc_dev, rows)
            jax.block_until_ready(pool)
            times.append(time.perf_counter() - start)
        readers = [pool.get_key_buffer] + (
            [pool.get_value_buffer] if isinstance(pool, MHAPool) else []
        )
        same = all(
            np.array_equal(np.asarray(read(pool.start_layer + i), np.float32), expected[i])
            for read in readers
            for i in range(LAYERS)
        )
        kept = pool.buffers(pool.buffer_specs()[0].name)[0].unsafe_buffer_pointer() == pointer
        ok &= same and kept
        size = pool.get_kv_size_bytes()
        size = sum(size) if isinstance(size, tuple) else size
        verdict = "bit-exact, in place" if same and kept else "MISMATCH"
        print(
            f"{name:<14}{size:>12,}{sum(b.size for b in batches):>8}{times[0] * 1e3:>12.2f}"
            f"{np.median(times[1:]) * 1e6:>16.0f}  {verdict}"
        )
    print("\nprefill includes compilation; decode steps are timed after it.")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(run())
