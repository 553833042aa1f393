"""sglang-jax's KV pools as sglang-jax builds them, what their layouts are, and its write paths.

Every configuration is a real `MHATokenToKVPool` or `MLATokenToKVPool` of sglang-jax, made with
the arguments its model runner passes and on a mesh made the way its scheduler makes one
(`create_device_mesh([dp, tp // dp], [1, 1], ...)`, whose axes are `AxisType.Explicit`).

The layout facts (`buffer_shape`, `token_index`, `kv_index`, ...) are written here from the
layouts sglang-jax documents and its kernels read, independently of its code; the tests check
each against the built pools and against where sglang-jax's own writers put a token. Those are
the facts a jaxkv layout description has to reproduce.

Writers, all sglang-jax's own and all runnable on the CPU:

* MHA: `MHATokenToKVPool.set_kv_buffer` (`merge_kv`, then the fused scatter its CPU test shim
  stands in for the TPU kernel with; conftest.py applies the shim).
* MLA: the pool has no writer of its own (its `set_kv_buffer` raises: the TPU kernel writes the
  cache in place). sglang-jax's reference MLA attention (`kernels/mla/v1/ref.py`) writes new
  latent tokens with `update_kv_cache`, the same token placement its kernel uses; the result
  goes back into the pool through its `replace_buffer`.
* DSA indexer keys: the sparse backend's paged scatter (`_scatter_paged`, what its indexer
  kernel path runs), on the pool's indexer buffer viewed as `(pages, page_size, dim)` the way
  that backend views it.

Sizes: few layers and heads, and just enough pages that the round trips of
test_layouts.py use token slots below the page count (see `ROUND_TRIP_PAGES`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sgl_jax.srt.utils.mesh_utils import create_device_mesh

from jaxkv import testing

# Pages a round trip uses: a prefix in pages 1-2 (page 0 is the padding page), loaded into
# pages 3-4. Pools are sized so that every slot of those pages is below the page count, where
# a reader that takes the page axis for token rows accepts the slots.
ROUND_TRIP_PAGES = ((1, 2), (3, 4))


@dataclasses.dataclass(frozen=True)
class Config:
    """One sglang-jax pool configuration.

    `head_dim` is the size the pool is built with; `model_head_dim` the model's, which
    sglang-jax's model runner rounds up to a multiple of 128 for the pool (`merge_kv` pads the
    writes). `size` is the pool's token capacity (`size`), a multiple of `page_size`.
    """

    name: str
    kind: str  # "mha" or "mla"
    dtype: str
    page_size: int
    size: int
    layer_num: int = 2
    head_num: int = 2
    head_dim: int = 128
    model_head_dim: int = 128
    tp: int = 1
    dp: int = 1
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    indexer_key_dim: int = 0
    num_indexer_layers: int = 0

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def writable(self) -> bool:
        """Whether sglang-jax's own write path can write this pool: its MHA writes pad K and V
        to a multiple of 128, so a pool built at a smaller head_dim takes none."""
        return self.kind == "mla" or self.head_dim == align(self.model_head_dim, 128)


def _sized(page_size: int) -> int:
    """Token capacity whose page count exceeds every slot of the round trip's pages."""
    last_slot = (max(ROUND_TRIP_PAGES[1]) + 1) * page_size - 1
    return (last_slot // page_size + 1) * page_size * max(1, page_size)


def _mha(dtype: str, page: int, **kw) -> Config:
    name = kw.pop("name", f"mha-{_short(dtype)}-p{page}")
    return Config(name, "mha", dtype, page, kw.pop("size", _sized(page)), **kw)


def _mla(dtype: str, page: int, lora: int, rope: int, **kw) -> Config:
    name = kw.pop("name", f"mla-{_short(dtype)}-p{page}-lora{lora}")
    size = kw.pop("size", _sized(page))
    return Config(name, "mla", dtype, page, size, kv_lora_rank=lora, qk_rope_head_dim=rope, **kw)


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "f32"}[dtype]


CONFIGS = (
    *(_mha(dt, page) for dt in ("bfloat16", "float32") for page in (1, 4, 16)),
    # Few tokens: two pages besides the padding page, so every usable slot is at or past the
    # page count.
    _mha("float32", 4, name="mha-f32-p4-few", size=8),
    # A 64-dim model: sglang-jax's runner builds the pool at 128 and pads every write.
    _mha("bfloat16", 4, name="mha-bf16-p4-model64", model_head_dim=64),
    # A pool built directly at head_dim 64 (the pool keeps what it is given).
    _mha("bfloat16", 4, name="mha-bf16-p4-hd64", head_dim=64, model_head_dim=64),
    # Heads split over a tensor-parallel mesh of two devices, two heads on each.
    _mha("bfloat16", 4, name="mha-bf16-p4-tp2", head_num=4, tp=2),
    _mla("bfloat16", 4, 512, 64),
    _mla("float32", 4, 512, 64),
    _mla("bfloat16", 16, 192, 64),
    # DSA (sparse attention): the MLA pool with its paged indexer-key buffers.
    _mla("bfloat16", 4, 512, 64, name="mla-bf16-p4-dsa", indexer_key_dim=64, num_indexer_layers=1),
)
BY_NAME = {c.name: c for c in CONFIGS}


def params(keep=lambda cfg: True) -> list:
    """The configurations `keep` accepts, as pytest parameters named after them."""
    return [pytest.param(c, id=c.name) for c in CONFIGS if keep(c)]


def devices(n: int) -> list:
    """`n` devices of one platform: the default backend's, else the CPU's forced ones."""
    devs = jax.devices()
    if len(devs) < n:
        devs = jax.devices("cpu")
    if len(devs) < n:
        raise RuntimeError(
            f"XLA_FLAGS: expected --xla_force_host_platform_device_count={n} or more before jax "
            f"started, got {len(devs)} CPU device(s)"
        )
    return devs[:n]


def mesh(cfg: Config):
    """The mesh sglang-jax's scheduler makes for `dp` x `tp // dp` (explicit axes)."""
    n = cfg.dp * cfg.tp
    return create_device_mesh(
        ici_parallelism=[cfg.dp, cfg.tp // cfg.dp],
        dcn_parallelism=[1, 1],
        devices=devices(n),
        use_explicit_sharding=True,
    )


def build(cfg: Config):
    """The sglang-jax pool of `cfg`, with the arguments its model runner passes."""
    common = dict(
        size=cfg.size,
        page_size=cfg.page_size,
        dtype=cfg.jnp_dtype,
        layer_num=cfg.layer_num,
        mesh=mesh(cfg),
        dp_size=cfg.dp,
    )
    if cfg.kind == "mha":
        return MHATokenToKVPool(head_num=cfg.head_num, head_dim=cfg.head_dim, **common)
    extra = {}
    if cfg.indexer_key_dim:
        extra = dict(indexer_key_dim=cfg.indexer_key_dim, num_indexer_layers=cfg.num_indexer_layers)
    return MLATokenToKVPool(
        kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim, **common, **extra
    )


# ---- layout facts ---------------------------------------------------------------------------


def align(x: int, a: int) -> int:
    return -(-x // a) * a


def packing(cfg: Config) -> int:
    """Entries per 32-bit word: bf16 2, float32 1. sglang-jax packs that many K/V heads (MHA)
    or tokens (MLA) side by side on one axis."""
    return 32 // (8 * cfg.jnp_dtype.itemsize)


def pages(cfg: Config) -> int:
    """The page axis: the usable pages plus one padding page per data-parallel rank."""
    return cfg.size // cfg.page_size + cfg.dp


def page_rows(cfg: Config) -> int:
    """Token rows per page in the buffer: MHA holds `page_size`; MLA packs `packing` tokens
    per row and pads the page to a multiple of it."""
    if cfg.kind == "mha":
        return cfg.page_size
    return align(cfg.page_size, packing(cfg))


def latent_dims(cfg: Config) -> tuple[int, int]:
    """MLA's two segments, each padded to 128 on its own: (c_kv width, k_pe width)."""
    return align(cfg.kv_lora_rank, 128), align(cfg.qk_rope_head_dim, 128)


def buffer_shape(cfg: Config) -> tuple[int, ...]:
    p = packing(cfg)
    if cfg.kind == "mha":
        return (pages(cfg), cfg.page_size, 2 * cfg.head_num // p, p, cfg.head_dim)
    return (pages(cfg), page_rows(cfg) // p, p, sum(latent_dims(cfg)))


def indexer_shape(cfg: Config) -> tuple[int, ...]:
    p = packing(cfg)
    return (pages(cfg), page_rows(cfg) // p, p, align(cfg.indexer_key_dim, 128))


def spec(cfg: Config) -> P:
    """Pages over the data axis; MHA's packed head axis over the tensor axis, MLA replicated
    over it (one latent head)."""
    if cfg.kind == "mha":
        return P("data", None, "tensor", None, None)
    return P("data", None, None, None)


def token_index(cfg: Config, slot: int) -> tuple[int, ...]:
    """The leading buffer indices of token slot `slot` (slot = page * page_size + offset)."""
    page, offset = divmod(slot, cfg.page_size)
    if cfg.kind == "mha":
        return (page, offset)
    return (page, *divmod(offset, packing(cfg)))


def token_row(cfg: Config, slot: int) -> int:
    """The row of `slot` once the leading axes are flattened into token rows (MHA: the first
    two; MLA: the first three, `page_rows` rows a page)."""
    page, offset = divmod(slot, cfg.page_size)
    return page * page_rows(cfg) + offset


def kv_index(cfg: Config, head: int, which: int) -> tuple[int, int]:
    """MHA: where K (`which` 0) or V (1) of `head` lives on the (packed heads, packing) axes:
    K and V alternate per head, K0 V0 K1 V1 ..., `packing` of them per word."""
    return divmod(2 * head + which, packing(cfg))


def head_device(cfg: Config, head: int) -> int:
    """The tensor-axis shard holding `head`'s K and V (contiguous heads per shard)."""
    per_shard = (2 * cfg.head_num // packing(cfg)) // cfg.tp
    return kv_index(cfg, head, 0)[0] // per_shard


def usable_slots(cfg: Config) -> range:
    """Token slots the allocator hands out (page 0 is padding; dp = 1)."""
    return range(cfg.page_size, pages(cfg) * cfg.page_size)


# ---- sglang-jax's write paths ---------------------------------------------------------------


def random_values(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random values, none zero, exactly representable in `dtype` (so bits compare)."""
    x = rng.standard_normal(shape).astype(np.float32)
    x = np.where(x == 0, np.float32(1), x)
    return np.asarray(jnp.asarray(x, dtype))


def write_mha(pool, layer: int, slots, k: np.ndarray, v: np.ndarray) -> None:
    """sglang-jax's own MHA write: `k`, `v` `(tokens, heads, model_head_dim)` at `slots`
    (-1 marks a padding token, which nothing receives)."""
    loc = jnp.asarray(np.asarray(slots, np.int32))
    pool.set_kv_buffer(layer, loc, jnp.asarray(k), jnp.asarray(v))


def write_mla(pool, layer: int, page_ids, kv_c: np.ndarray, k_pe: np.ndarray) -> list[int]:
    """sglang-jax's reference MLA write: one sequence of `len(kv_c)` tokens laid over pages
    `page_ids` in order; returns the token slots it wrote (page * page_size + offset)."""
    from sgl_jax.srt.kernels.mla.v1.ref import update_kv_cache

    n = len(kv_c)
    # The reference scatters without output shardings, which an Explicit mesh refuses: it
    # writes an unsharded copy that goes back in the pool's sharding, as sglang-jax's MLA
    # attention test hands the pool a cache it built.
    new = update_kv_cache(
        jnp.asarray(kv_c),
        jnp.asarray(k_pe),
        jnp.asarray(np.asarray(pool.kv_buffer[layer])),
        jnp.asarray([n], jnp.int32),
        jnp.asarray(page_ids, jnp.int32),
        jnp.asarray([0, n], jnp.int32),
        jnp.asarray([0, 0, 1], jnp.int32),
    )
    layers = list(pool.kv_buffer)
    layers[layer] = jax.device_put(new, pool.kv_sharding)
    pool.replace_buffer(layers)
    return [page_ids[t // pool.page_size] * pool.page_size + t % pool.page_size for t in range(n)]


def write_indexer(pool, slot_id: int, page_ids, keys: np.ndarray) -> list[int]:
    """The DSA backend's indexer-key write: one sequence of `len(keys)` tokens over pages
    `page_ids`; returns the token slots it wrote."""
    from sgl_jax.srt.layers.attention.dsa_sparse_backend import _scatter_paged

    buf = pool.indexer_key_buffer[slot_id]
    n = len(keys)
    page_tokens = buf.shape[1] * buf.shape[2]  # the backend's view: (pages, page_size, dim)
    flat = jnp.asarray(np.asarray(buf)).reshape(buf.shape[0], page_tokens, buf.shape[3])
    width = buf.shape[3]
    padded = np.zeros((n, width), keys.dtype)
    padded[:, : keys.shape[1]] = keys
    out = _scatter_paged(
        flat,
        jnp.asarray(padded),
        jnp.asarray([n], jnp.int32),
        jnp.asarray(page_ids, jnp.int32),
        jnp.asarray([0, n], jnp.int32),
        jnp.asarray([0, 0], jnp.int32),
        len(page_ids),
    )
    idx = list(pool.indexer_key_buffer)
    idx[slot_id] = jax.device_put(out.reshape(buf.shape), buf.sharding)
    pool.replace_buffer((list(pool.kv_buffer), idx))
    return [page_ids[t // pool.page_size] * pool.page_size + t % pool.page_size for t in range(n)]


def buffers(pool) -> dict[str, list]:
    """Every buffer of `pool` per attribute (the indexer's when it has one): a pytree that
    `jaxkv.testing` reads."""
    out = {"kv_buffer": list(pool.kv_buffer)}
    if getattr(pool, "indexer_key_buffer", None):
        out["indexer_key_buffer"] = list(pool.indexer_key_buffer)
    return out


def pool_bits(pool) -> dict[str, list[np.ndarray]]:
    """Every buffer of `pool`, as raw bits (`jaxkv.testing.buffer_bits`), per attribute."""
    return {attr: testing.buffer_bits(layers) for attr, layers in buffers(pool).items()}
