"""Declared layouts (`KVConnector(pool, store, layout=PoolLayout(...))`): paged and fused
buffers of pools jaxkv does not know, moved as token rows, bit-exact, and refused when they do
not match their declaration.

The reference for where a slot lives is written here from the layouts' definitions, not from
jaxkv's code: slot `s` is token `s % page_size` of page `s // page_size`, held at row
`s % page_size` of that page's `page_rows` rows, those rows laid out over the lead axes in
C order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import MHAPool, UnsupportedKVCacheError, testing
from jaxkv.connector import BufferLayout, HostStore, KVConnector, PoolLayout

PAGE = 4


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _index(shape_lead: tuple[int, ...], page: int, slot: int) -> tuple[int, ...]:
    """The leading indices of `slot` in a buffer whose pages have lead axes `shape_lead`."""
    p, offset = divmod(slot, page)
    return (p, *np.unravel_index(offset, shape_lead))


def _fused(rng, pages=6, heads=2, packing=2, head_dim=8, layers=2, dtype=jnp.bfloat16):
    """tpu-inference's caches: a plain list of `(blocks, block_size, 2H // packing, packing,
    head_dim)` jax arrays, random bits in every entry."""
    shape = (pages, PAGE, 2 * heads // packing, packing, head_dim)
    out = []
    for _ in range(layers):
        raw = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
        out.append(jax.lax.bitcast_convert_type(jnp.array(raw), dtype))
    return out


FUSED = PoolLayout(
    kind="tpu-inference-fused", page_size=PAGE, buffers=(BufferLayout("", "kv", token_axes=2),)
)


def _check_moved(before, after, lead, src, dst):
    for li, (old, got) in enumerate(zip(before, after)):
        want = old.copy()
        for s, d in zip(src, dst):
            want[_index(lead, PAGE, d)] = old[_index(lead, PAGE, s)]
        np.testing.assert_array_equal(got, want, err_msg=f"layer {li}")


def test_a_plain_list_of_fused_arrays_round_trips_in_place(rng):
    caches = _fused(rng)
    before = testing.buffer_bits(caches)
    src, dst = list(range(4, 12)), list(range(16, 24))  # pages 1-2 into pages 4-5
    tokens = rng.integers(0, 1000, len(src))
    conn = KVConnector(caches, HostStore(1 << 24), layout=FUSED)
    assert conn.block_size == PAGE
    assert conn.store(caches, tokens, src) == 2
    pointers = testing.buffer_pointers(caches)
    new, loaded = conn.load(caches, tokens, dst)
    assert new is caches and loaded == 8
    testing.assert_updated_in_place(pointers, caches)
    _check_moved(before, testing.buffer_bits(caches), (PAGE,), src, dst)


def test_padded_pages_of_host_buffers_round_trip(rng):
    """MLA-style pages of numpy buffers: 3 tokens a page packed 2 to a row in 2 rows (the 4th
    row pads the page), written in place with numpy."""

    class Pool:
        def __init__(self):
            self.latent = [rng.standard_normal((5, 2, 2, 6)).astype(np.float32) for _ in range(2)]

    layout = PoolLayout(
        kind="paged-latent",
        page_size=3,
        buffers=(BufferLayout("latent", "kv", token_axes=3, page_rows=4),),
    )
    pool = Pool()
    before = [b.copy() for b in pool.latent]
    src, dst = [3, 4, 5], [12, 13, 14]
    conn = KVConnector(pool, HostStore(1 << 20), layout=layout, block_size=3)
    assert conn.store(pool, [7, 8, 9], src) == 1
    assert conn.load(pool, [7, 8, 9], dst)[1] == 3
    for old, got in zip(before, pool.latent):
        want = old.copy()
        for s, d in zip(src, dst):
            want[_index((2, 2), 3, d)] = old[_index((2, 2), 3, s)]
        np.testing.assert_array_equal(got, want)
    blocks = conn.export_blocks(pool, src)
    assert blocks["kv"].shape == (1, 2, 3, 6)
    want = np.stack([pool.latent[0][_index((2, 2), 3, s)] for s in src])
    np.testing.assert_array_equal(blocks["kv"][0, 0], want)


def test_a_family_with_its_own_layer_count_travels_with_the_blocks(rng):
    class Pool:
        def __init__(self):
            self.kv = _fused(rng, layers=3)
            self.extra = [jnp.array(rng.standard_normal((6, PAGE, 16)).astype(np.float32))]

    layout = PoolLayout(
        kind="with-extra",
        page_size=PAGE,
        buffers=(
            BufferLayout("kv", "kv", token_axes=2),
            BufferLayout("extra", "extra", token_axes=2, own_layers=True),
        ),
    )
    pool = Pool()
    extra_before = testing.raw_bits(pool.extra[0])
    conn = KVConnector(pool, HostStore(1 << 24), layout=layout)
    blocks = conn.export_blocks(pool, range(4, 8))
    assert blocks["kv"].shape[:3] == (1, 3, PAGE) and blocks["extra"].shape == (1, 1, PAGE, 16)
    tokens = rng.integers(0, 1000, 4)
    assert conn.store(pool, tokens, range(4, 8)) == 1
    assert conn.load(pool, tokens, range(20, 24))[1] == 4
    want = extra_before.copy()
    want[5] = extra_before[1]
    np.testing.assert_array_equal(testing.raw_bits(pool.extra[0]), want)


def test_declared_blocks_are_never_another_layouts(rng):
    """The same bits under another kind's name are other keys: a fused layout never serves an
    MHA pool of the same sizes (its rows interleave K and V)."""
    store = HostStore(1 << 24)
    caches = _fused(rng)
    tokens = rng.integers(0, 1000, 8)
    KVConnector(caches, store, layout=FUSED).store(caches, tokens, range(4, 12))
    mha = MHAPool.create(size=24, page_size=PAGE, head_num=2, head_dim=8, layer_num=2)
    assert KVConnector(mha, store).lookup(tokens) == 0


def test_slots_past_the_pages_are_refused_before_any_write(rng):
    caches = _fused(rng)
    before = testing.buffer_bits(caches)
    conn = KVConnector(caches, HostStore(1 << 24), layout=FUSED)
    tokens = rng.integers(0, 1000, 4)
    conn.store(caches, tokens, range(4, 8))
    with pytest.raises(ValueError, match=r"slots\[3\] = 24 is outside the pool's rows \[0, 24\)"):
        conn.load(caches, tokens, [20, 21, 22, 24])
    testing.assert_unchanged(before, caches)


def test_a_tuple_of_jax_buffers_cannot_be_loaded_into(rng):
    caches = tuple(_fused(rng))
    conn = KVConnector(caches, HostStore(1 << 24), layout=FUSED)
    tokens = rng.integers(0, 1000, 4)
    conn.store(caches, tokens, range(4, 8))
    before = testing.buffer_bits(caches)
    with pytest.raises(TypeError, match="expected a list of jax buffers"):
        conn.load(caches, tokens, range(8, 12))
    testing.assert_unchanged(before, caches)  # none donated


@pytest.mark.parametrize(
    "layout, match",
    [
        (
            PoolLayout("x", 2, (BufferLayout("", token_axes=2),)),
            r"pages hold 4 token rows \(4,\), expected 2 for page_size 2 \(declare page_rows",
        ),
        (PoolLayout("x", PAGE, (BufferLayout("", token_axes=5),)), "expected 5 token axes"),
        (PoolLayout("x", PAGE, (BufferLayout("kv_buffer", token_axes=2),)), "kv_buffer: expected"),
    ],
)
def test_buffers_unlike_their_declaration_are_refused(rng, layout, match):
    with pytest.raises(UnsupportedKVCacheError, match=match):
        KVConnector(_fused(rng), HostStore(1 << 20), layout=layout)


def test_declarations_are_checked_when_made():
    with pytest.raises(ValueError, match="token_axes: expected an int >= 1, got 0"):
        BufferLayout("kv", token_axes=0)
    with pytest.raises(TypeError, match="buffers: expected a non-empty sequence"):
        PoolLayout("x", PAGE, ())
    with pytest.raises(ValueError, match="distinct key"):
        PoolLayout("x", PAGE, (BufferLayout("a"), BufferLayout("b")))
    with pytest.raises(ValueError, match="page_size: expected an int >= 1"):
        PoolLayout("x", 0, (BufferLayout("a"),))


def test_the_connector_checks_its_layout_argument(rng):
    mha = MHAPool.create(size=16, head_num=2, head_dim=8, layer_num=1)
    with pytest.raises(ValueError, match="describes its own buffers"):
        KVConnector(mha, HostStore(1 << 20), layout=FUSED)
    with pytest.raises(TypeError, match="layout: expected a PoolLayout or None, got dict"):
        KVConnector(_fused(rng), HostStore(1 << 20), layout={})


def test_paged_buffers_without_a_declaration_are_refused(rng):
    class Lookalike:
        kv_buffer = _fused(rng)
        page_size = PAGE

    with pytest.raises(UnsupportedKVCacheError, match="does not guess") as err:
        KVConnector(Lookalike(), HostStore(1 << 20))
    assert "layout=PoolLayout" in str(err.value)


def test_a_refused_load_on_an_explicit_mesh_donates_nothing(rng):
    """Pools on explicit meshes move shard by shard; a pool that cannot take new buffers (a
    tuple) is refused before any shard is donated."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    caches = tuple(jax.device_put(b, placed) for b in _fused(rng))
    before = testing.buffer_bits(caches)
    conn = KVConnector(caches, HostStore(1 << 24), layout=FUSED)
    tokens = rng.integers(0, 1000, 4)
    assert conn.store(caches, tokens, range(4, 8)) == 1
    with pytest.raises(TypeError, match="expected a list of jax buffers"):
        conn.load(caches, tokens, range(8, 12))
    testing.assert_unchanged(before, caches)  # none deleted (donated), none changed


class _FusedCaches:
    """Another framework's pool class: fused paged buffers under `caches`."""

    def __init__(self, caches):
        self.caches = caches


def _fused_caches_layout(pool) -> PoolLayout:
    return PoolLayout(
        kind="fused-caches", page_size=PAGE, buffers=(BufferLayout("caches", "kv", 2),)
    )


def test_a_declared_class_is_described_by_its_declaration_and_its_subclasses_too(rng):
    """One `declare_layout` call makes a class (and its subclasses) known to every connector:
    no `layout=` argument, blocks keyed by the declared kind; a class it refuses is refused."""
    from jaxkv.connector.layout import declare_layout

    refused = []

    def check(pool):
        if getattr(pool, "refuse", False):
            refused.append(pool)
            raise UnsupportedKVCacheError("Unsupported KV cache type _FusedCaches: refused")

    declare_layout(
        _FusedCaches.__module__, _FusedCaches.__qualname__, _fused_caches_layout, check=check
    )

    class Sub(_FusedCaches):
        pass

    pool = Sub(_fused(rng))
    src, dst = list(range(4, 12)), list(range(16, 24))
    tokens = rng.integers(0, 1000, len(src))
    conn = KVConnector(pool, HostStore(1 << 24))
    assert conn.layout.kind == "fused-caches" and conn.block_size == PAGE
    assert conn.store(pool, tokens, src) == 2
    before = testing.buffer_bits(pool.caches)
    assert conn.load(pool, tokens, dst)[1] == 8
    _check_moved(before, testing.buffer_bits(pool.caches), (PAGE,), src, dst)
    pool.refuse = True
    with pytest.raises(UnsupportedKVCacheError, match="refused"):
        KVConnector(pool, HostStore(1 << 20))
    assert refused == [pool]
