"""The layouts of sglang-jax's device pools, declared for the connector.

sglang-jax's buffers (see docs/sglang_jax.md):

* MHA: `kv_buffer[l]` `(pages, page_size, 2 * heads // packing, packing, head_dim)`, K and V
  interleaved per head; the first two axes are token rows (slot = page * page_size + offset).
* MLA: `kv_buffer[l]` `(pages, align(page_size, packing) // packing, packing, width)`, tokens
  packed `packing` to a row; the first three axes are token rows, `align(page_size, packing)`
  of them a page. DSA pools add `indexer_key_buffer`, one buffer per indexer (not per layer),
  in the same paged layout.

Blocks carry whole stored rows, padding included (the zero columns past a model's head_dim,
each MLA segment's padding to 128), so a round trip restores every bit of a token's row.

Importing this module declares `MHATokenToKVPool` and `MLATokenToKVPool` (and their
subclasses) with `declare_layout`; the connector imports it when it first meets a pool of
sglang-jax's memory-pool module, so `KVConnector(sglang_jax_pool, store)` works without the
caller importing it. sglang-jax itself is never imported here: its pool is already in the
caller's hands.
"""

from __future__ import annotations

from typing import cast

from jaxkv._checks import is_int
from jaxkv.connector import BufferLayout, PoolLayout
from jaxkv.connector.layout import buffer_dtype, declare_layout, layers_of, unsupported

# The module sglang-jax's pools live in.
POOLS_MODULE = "sgl_jax.srt.mem_cache.memory_pool"


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def _attrs(pool, *names: str) -> dict[str, int]:
    name = type(pool).__name__
    out = {}
    for attr in names:
        value = getattr(pool, attr, None)
        if not is_int(value):
            raise unsupported(name, f"{attr}: expected an int attribute, got {value!r}")
        out[attr] = int(cast(int, value))
    return out


def _packing(pool) -> int:
    """sglang-jax's entries per 32-bit word for the pool's dtype (bf16 2, float32 1)."""
    try:
        bits = 8 * buffer_dtype(pool).itemsize
    except TypeError as err:
        raise unsupported(type(pool).__name__, f"dtype: {err}") from None
    return max(1, 32 // bits)


def _check_shapes(pool, attr: str, want: tuple[int, ...], facts: str) -> None:
    """Every layer buffer of `attr` has shape `want`, which the pool's attributes give."""
    layers = layers_of(pool, attr) or []
    for li, buf in enumerate(layers):
        if tuple(buf.shape) != want:
            raise unsupported(
                type(pool).__name__,
                f"{attr}[{li}] has shape {tuple(buf.shape)}, expected {want} from its "
                f"attributes ({facts}); jaxkv reads sglang-jax's pools only as sglang-jax "
                "lays them out",
            )


def _refuse_data_parallel(pool, dp: int) -> None:
    if dp != 1:
        raise unsupported(
            type(pool).__name__,
            f"dp_size={dp}: data-parallel attention pools are not supported (each data rank "
            "hands out slots local to its own pages, so a slot does not name one row of the "
            "buffer); use dp_size=1",
        )


def _sglang_jax_mha(pool) -> PoolLayout:
    a = _attrs(pool, "size", "page_size", "head_num", "head_dim", "dp_size", "start_layer")
    p, page = _packing(pool), a["page_size"]
    want = (a["size"] // page + a["dp_size"], page, 2 * a["head_num"] // p, p, a["head_dim"])
    _check_shapes(pool, "kv_buffer", want, f"{a}, packing {p}")
    return PoolLayout(
        kind="sglang-jax-mha",
        page_size=page,
        buffers=(BufferLayout("kv_buffer", "kv", token_axes=2),),
        start_layer=a["start_layer"],
        sizes=(("head_num", a["head_num"]), ("head_dim", a["head_dim"])),
    )


def _sglang_jax_mla(pool) -> PoolLayout:
    a = _attrs(
        pool, "size", "page_size", "kv_lora_rank", "qk_rope_head_dim", "dp_size", "start_layer"
    )
    p, page = _packing(pool), a["page_size"]
    rows = _align(page, p)
    pages = a["size"] // page + a["dp_size"]
    width = _align(a["kv_lora_rank"], 128) + _align(a["qk_rope_head_dim"], 128)
    facts = f"{a}, packing {p}"
    _check_shapes(pool, "kv_buffer", (pages, rows // p, p, width), facts)
    buffers = [BufferLayout("kv_buffer", "kv", token_axes=3, page_rows=rows)]
    if layers_of(pool, "indexer_key_buffer"):
        dim = _attrs(pool, "indexer_key_dim")["indexer_key_dim"]
        want = (pages, rows // p, p, _align(dim, 128))
        _check_shapes(pool, "indexer_key_buffer", want, f"{facts}, indexer_key_dim {dim}")
        buffers.append(
            BufferLayout("indexer_key_buffer", "index_k", 3, page_rows=rows, own_layers=True)
        )
    return PoolLayout(
        kind="sglang-jax-mla",
        page_size=page,
        buffers=tuple(buffers),
        start_layer=a["start_layer"],
        sizes=(("kv_lora_rank", a["kv_lora_rank"]), ("qk_rope_head_dim", a["qk_rope_head_dim"])),
    )


def _check_served(pool) -> None:
    _refuse_data_parallel(pool, _attrs(pool, "dp_size")["dp_size"])


declare_layout(POOLS_MODULE, "MHATokenToKVPool", _sglang_jax_mha, check=_check_served)
declare_layout(POOLS_MODULE, "MLATokenToKVPool", _sglang_jax_mla, check=_check_served)
