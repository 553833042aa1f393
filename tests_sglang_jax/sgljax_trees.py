"""sglang-jax's radix tree with HiCache as its scheduler builds it, for the L3 tests.

`build` makes a pool (`sgljax_pools.build`), its allocator and request pool, then the tree
through sglang-jax's own `build_kv_cache`, the scheduler's call: `create_tree_cache` (whose
factory jaxkv's `install` wraps) and `init_hicache` (the host pool and controller). Server and
model arguments are stand-ins holding what those functions read.

`serve` drives the tree the way the scheduler serves one request: a prefill round begins
(`check_hicache_events`), the prompt is matched, a host hit is loaded back (`init_load_back`,
then `finish_load_back`), and the request's prefix slots come out.

Run as a program it is the other process of the restart and shared-Redis tests:

    python -m sgljax_trees load CONFIG STORE TOKENS.npy OUT.npz

builds a fresh tree over the store `STORE`, serves the tokens and writes the bits of the
served prefix's rows (`rows`) and how many tokens came from the store (`loaded`) to OUT.npz.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import sgljax_pools as sp
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sgl_jax.srt.mem_cache.kv_cache_builder import build_kv_cache, init_hicache
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool
from sgl_jax.srt.mem_cache.radix_cache import RadixKey

from jaxkv import testing
from jaxkv.integrations.sglang_jax import storage

# Pools for the tree tests: enough pages for a prompt of several blocks plus room to load it
# again. Page 4 keeps the connector's block at the page; page 1 makes it 16 tokens, so a tree
# node boundary can fall inside a block; tp2 splits the heads over two devices, whose shards
# the connector keys apart.
CONFIGS = {
    "mha-bf16-p4": sp.Config("mha-bf16-p4", "mha", "bfloat16", 4, 128),
    "mha-bf16-p4-tp2": sp.Config("mha-bf16-p4-tp2", "mha", "bfloat16", 4, 128, head_num=4, tp=2),
    "mha-f32-p1": sp.Config("mha-f32-p1", "mha", "float32", 1, 128),
    "mla-bf16-p4": sp.Config(
        "mla-bf16-p4", "mla", "bfloat16", 4, 128, kv_lora_rank=512, qk_rope_head_dim=64
    ),
}


def server_args(**overrides) -> SimpleNamespace:
    """What build_kv_cache, create_tree_cache and init_hicache read of sglang-jax's ServerArgs,
    with HiCache on (`--hicache-storage none`) as jaxkv's tier needs."""
    args = dict(
        hicache_storage="none",
        hicache_ratio=2.0,
        hicache_write_through_threshold=1,
        hicache_write_policy="write_through",
        enable_unified_radix_tree=True,
        disable_radix_cache=False,
        chunked_prefill_size=None,
        enable_recurrent_extra_buffer=False,
        recurrent_track_interval=None,
        max_seq_len=512,
        model_path="test/tiny-model",
        revision=None,
        dtype="auto",
        quantization=None,
        kv_cache_dtype="auto",
    )
    args.update(overrides)
    return SimpleNamespace(**args)


@dataclasses.dataclass
class Tree:
    cfg: sp.Config
    pool: object
    allocator: object
    tree: object


def build(cfg: sp.Config, rng: np.random.Generator, *, store=None, tier=None, **args) -> Tree:
    """A pool of `cfg` filled with distinct random values, and sglang-jax's tree over it as
    its scheduler builds one (`args` override `server_args`): through the installed hook, or,
    given a `store` object, a `StoreRadixCache` made directly over it (with the `tier`
    arguments) and equipped by sglang-jax's `init_hicache`."""
    pool = sp.build(cfg)
    fill = [sp.random_values(rng, sp.buffer_shape(cfg), cfg.jnp_dtype) for _ in pool.kv_buffer]
    # jnp.array copies into memory XLA owns, which later in-place updates may donate.
    pool.replace_buffer([jax.device_put(jnp.array(b), pool.kv_sharding) for b in fill])
    if cfg.page_size == 1:
        allocator = TokenToKVPoolAllocator(size=cfg.size, kvcache=pool, dp_size=1)
    else:
        allocator = PagedTokenToKVPoolAllocator(
            size=cfg.size, page_size=cfg.page_size, kvcache=pool, dp_size=1
        )
    model = SimpleNamespace(
        get_num_kv_heads=lambda tp: cfg.head_num,
        head_dim=cfg.head_dim,
        num_hidden_layers=cfg.layer_num,
    )
    requests = ReqToTokenPool(size=8, max_context_len=512)
    if store is not None:
        tree = storage.radix_cache_class()(
            req_to_token_pool=requests,
            token_to_kv_pool_allocator=allocator,
            page_size=cfg.page_size,
            kv_head_num=cfg.head_num,
            head_dim=cfg.head_dim,
            layer_num=cfg.layer_num,
            max_seq_len=512,
            store=store,
            **(tier or {}),
        )
        init_hicache(tree, server_args(**args), pool.mesh, allocator)
        return Tree(cfg, pool, allocator, tree)
    tree = build_kv_cache(
        server_args=server_args(**args),
        model_config=model,
        req_to_token_pool=requests,
        token_to_kv_pool_allocator=allocator,
        page_size=cfg.page_size,
        is_hybrid=False,
        sliding_window_size=None,
        tp_size=cfg.tp,
        spec_algorithm=None,
        mesh=pool.mesh,
    )
    return Tree(cfg, pool, allocator, tree)


def key(tokens) -> RadixKey:
    return RadixKey([int(t) for t in tokens], None, 0)


def insert(t: Tree, tokens) -> np.ndarray:
    """Caches `tokens` as a finished request does: the device prefix it hit, the rest at
    fresh slots (its KV: the random rows there). Then a second request reuses it all, which
    makes HiCache's write-through (threshold 1) back it up. Returns the prompt's slots."""
    hit = t.tree.match_prefix(MatchPrefixParams(key=key(tokens), full_only=True))
    fresh = t.allocator.alloc(len(tokens) - len(hit.device_indices), dp_rank=0)
    assert fresh is not None, "the pool is too small for the prompt"
    slots = np.concatenate([hit.device_indices, fresh]).astype(np.int32)
    for _ in range(2):
        t.tree.insert(InsertParams(key=key(tokens), value=slots))
    return slots


def settle(t: Tree, timeout_s: float = 10.0) -> None:
    """Waits for HiCache's device-to-host backups, and the store's writes, to finish."""
    t.tree.hicache_controller.drain_pending()
    deadline = time.monotonic() + timeout_s
    while t.tree.ongoing_write and time.monotonic() < deadline:
        t.tree.check_hicache_events()
        time.sleep(0.005)
    assert not t.tree.ongoing_write, "HiCache's backups did not finish"
    t.tree.jaxkv.flush()


def evict_everything(t: Tree) -> None:
    """Evicts every page from the device, then from host memory: the tree is left empty."""
    settle(t)
    t.tree.evict(EvictParams(num_tokens=t.cfg.size, dp_rank=0))
    t.tree.evict_host(t.cfg.size)
    assert not t.tree.root_node.children, "pages are left in the tree"
    assert t.allocator.available_size(0) == t.cfg.size


def serve(t: Tree, tokens) -> tuple[np.ndarray, object]:
    """The scheduler's steps for one request: a new prefill round, the match, the load-back
    of a host hit. Returns the request's prefix slots and the match result."""
    t.tree.check_hicache_events()
    match = t.tree.match_prefix(MatchPrefixParams(key=key(tokens)))
    prefix = np.asarray(match.device_indices)
    if match.host_hit_length > 0:
        new, _, plan = t.tree.init_load_back(
            match.last_host_node, match.host_hit_length, mem_quota=t.allocator.available_size(0)
        )
        t.tree.finish_load_back(plan)
        prefix = np.concatenate([prefix, np.asarray(new)])
    return prefix, match


def rows(t: Tree, slots) -> np.ndarray:
    """The bits of every layer's entries at token `slots`: `(layers, tokens, *entry)`."""
    index = tuple(np.array([sp.token_index(t.cfg, int(s)) for s in slots]).T)
    return np.stack([testing.raw_bits(b)[index] for b in t.pool.kv_buffer])


def balanced(t: Tree) -> bool:
    """Whether every device token is free, or held by the tree (no slot leaked)."""
    tree = t.tree
    return (
        t.allocator.available_size(0) + tree.evictable_size(0) + tree.protected_size(0)
        == t.cfg.size
    )


def local_redis():
    """jaxkv's test helper for a throwaway redis-server (tests/redis_server.py), loaded from
    its file: `tests/` is not on this folder's path."""
    path = Path(__file__).resolve().parent.parent / "tests" / "redis_server.py"
    spec = importlib.util.spec_from_file_location("redis_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LocalRedis()


def _load(config: str, store: str, tokens_file: str, out_file: str) -> None:
    storage.install(storage.StoreSettings(store=store, wait_s=30.0))
    t = build(CONFIGS[config], np.random.default_rng(0))  # other random rows than the writer's
    prefix, match = serve(t, np.load(tokens_file))
    loaded = t.tree.jaxkv.stats()["loaded_tokens"]
    np.savez(out_file, rows=rows(t, prefix), loaded=loaded, hit=match.host_hit_length)
    t.tree.jaxkv.close()


if __name__ == "__main__":
    import sgl_jax.test.mem_cache.conftest  # noqa: F401  sglang-jax's CPU write shim

    if sys.argv[1] == "load":
        _load(*sys.argv[2:6])
