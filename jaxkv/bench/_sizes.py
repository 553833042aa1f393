"""The problem sizes of a bench run: `FULL` (the default), `QUICK` (`--quick`), `TINY` (tests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The attention shape of every pool the update, connector, store and sharded sections use:
# 8 KV heads of 128 dims, bf16 (2 KiB per token for K, 4 KiB for K and V).
HEADS, HEAD_DIM = 8, 128


def kv_bytes(tokens: int, layers: int) -> int:
    """Bytes of K and V for `tokens` tokens of `layers` layers of that shape."""
    return 2 * tokens * layers * HEADS * HEAD_DIM * 2


@dataclass(frozen=True)
class Sizes:
    """The problem sizes of one run, in tokens unless stated, and how much it repeats.

    Attributes:
        name: `"full"`, `"quick"` or `"tiny"`; selects each target's limit
            (`jaxkv.bench._targets.TARGETS`; a set without its own limit uses QUICK's).
        quick: fewer update configurations, fewer timing rounds and shorter time budgets.
        pools: CPU update pools (small, mid, big); the growth targets compare big with small.
        tokens: tokens written per CPU update call (T): small, mid, big.
        naive_pool: the biggest CPU pool naive JAX runs on: a call copies the pool, and
            XLA:CPU scatters bf16 through a float32 copy, so it holds about 4x the pool
            (4 GiB for a 256K-token pool, 16 GiB for 1M).
        accel_pools: accelerator update pools (small, mid, big).
        accel_tokens: tokens written per accelerator update call.
        connector_tokens: tokens per connector call on CPU (32 MiB at 1024 tokens, 8 layers);
            4x as many on an accelerator, at 32 layers.
        connector_layers: layer counts of the CPU connector rows.
        hash_tokens: tokens hashed per `block_hashes` call.
        decoder_pool: the reference decoder's pool (the naive cache copies it every step).
        cached: decode steps: cached tokens, short and long.
        prefix: time to first token: the reused prefix.
        new_tokens: time to first token: the new tail of each prompt.
        remote_blocks: store tiers: blocks of 16 tokens per call.
        sharded: the 8-device section: pool, tokens per update, tokens per store.
    """

    name: str
    quick: bool
    pools: tuple[int, int, int]
    tokens: tuple[int, int, int]
    naive_pool: int
    accel_pools: tuple[int, int, int]
    accel_tokens: tuple[int, int, int]
    connector_tokens: int
    connector_layers: tuple[int, ...]
    hash_tokens: int
    decoder_pool: int
    cached: tuple[int, int]
    prefix: int
    new_tokens: int
    remote_blocks: tuple[int, ...]
    sharded: tuple[int, int, int]


# Pools up to 1M tokens on CPU (4 GiB per layer, K and V) and 4M on an accelerator (16 GiB);
# naive JAX holds two more copies of a pool while it runs.
FULL = Sizes(
    name="full",
    quick=False,
    pools=(1 << 14, 1 << 18, 1 << 20),
    tokens=(16, 256, 4096),
    naive_pool=1 << 20,
    accel_pools=(1 << 14, 1 << 20, 1 << 22),
    accel_tokens=(256, 4096, 65536),
    connector_tokens=1024,
    connector_layers=(8, 32),
    hash_tokens=1 << 16,
    decoder_pool=1 << 16,
    cached=(1 << 10, 1 << 14),
    prefix=2048,
    new_tokens=64,
    remote_blocks=(1, 16, 64),
    sharded=(65536, 1024, 1024),
)

# A laptop's first run, in under 4 GB: CPU pools of 16K to 256K tokens (64 MiB to 1 GiB per
# layer), still a 16x span for the growth targets and all above a CPU's last-level cache;
# naive JAX up to 64K tokens (its growth shows from 16K to 64K). A reused prefix of 1K tokens
# (the same 97% of the prompt as FULL's 2K). Every other size (the connector's bytes, the
# hashed tokens, the decoder's pool) is FULL's, so those targets compare the same work. The
# accelerator sizes are FULL's: a GPU holds them.
QUICK = dataclasses.replace(
    FULL,
    name="quick",
    quick=True,
    pools=(1 << 14, 1 << 16, 1 << 18),
    naive_pool=1 << 16,
    prefix=1024,
    new_tokens=32,
    connector_layers=(8,),
    remote_blocks=(1, 64),
    sharded=(16384, 256, 1024),
)

# Every section and target at toy sizes, in seconds, for tests of the bench itself: its
# figures say nothing about performance.
TINY = Sizes(
    name="tiny",
    quick=True,
    pools=(256, 1024, 4096),
    tokens=(4, 16, 64),
    naive_pool=4096,
    accel_pools=(256, 1024, 4096),
    accel_tokens=(16, 64, 128),
    connector_tokens=256,
    connector_layers=(8,),
    hash_tokens=1 << 10,
    decoder_pool=1 << 10,
    cached=(32, 128),
    prefix=64,
    new_tokens=16,
    remote_blocks=(1, 4),
    sharded=(1024, 64, 256),
)


def label(n: int) -> str:
    """16384 -> "16K", 1048576 -> "1M", 256 -> "256"."""
    for shift, unit in ((20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)
