"""jaxkv's `LRUHostKVPool` (HiCache's host tier) against sglang-jax's own device pools.

Round trips on every kind of pool sglang-jax builds (MHA and MLA, bfloat16 and float32, heads
over a tensor-parallel mesh, pages over two data ranks, DSA's indexer keys), in both kinds of
host memory, and of every buffer family jaxkv's connector stores of a page; the
races of a slot freed and reused while a transfer of its old owner runs, driven through public
methods only; the argument checks; and compilation ahead of serving. sglang-jax's own
HiCache tests run against this class through the `hicache_on_jaxkv` plugin.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
import zlib

import jax
import numpy as np
import pytest
import sgljax_pools as sp
from jax.sharding import PartitionSpec as P
from sgl_jax.srt.mem_cache.host_kv_pool import HostKVPool
from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool
from sgl_jax.srt.utils.mesh_utils import create_device_mesh

from jaxkv import testing
from jaxkv.connector import HostStore, KVConnector, PoolLayout
from jaxkv.errors import UnsupportedKVCacheError
from jaxkv.integrations.sglang_jax import LRUHostKVPool, _host_pool, _pages_on_host
from jaxkv.integrations.sglang_jax._pages_on_device import chunk_sizes

# Pools of every kind, small; `mha-bf16-p4-dp2` spreads its pages over two data ranks (a
# padding page each), the way sglang-jax builds a pool for data-parallel attention.
DP2 = dataclasses.replace(sp.BY_NAME["mha-bf16-p4"], name="mha-bf16-p4-dp2", dp=2, tp=2)
POOLS = [
    *(
        sp.BY_NAME[name]
        for name in (
            "mha-bf16-p1",
            "mha-f32-p4",
            "mha-bf16-p16",
            "mha-bf16-p4-tp2",
            "mla-bf16-p4-lora512",
            "mla-f32-p4-lora512",
            "mla-bf16-p16-lora192",
        )
    ),
    DP2,
]
# DSA (sparse attention) pools: MLA with indexer keys, one buffer per indexer (1 against 2
# layers; 3 in float32).
DSA = sp.BY_NAME["mla-bf16-p4-dsa"]
DSA3 = dataclasses.replace(DSA, name="mla-f32-p4-dsa3", dtype="float32", num_indexer_layers=3)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


KINDS = {"arena": _pages_on_host.ArenaPages, "pinned": _pages_on_host.PinnedPages}


@pytest.fixture(params=list(KINDS))
def memory(request, monkeypatch):
    """Each kind of host memory: the pool picks by platform, so on the CPU the pinned
    segments (an accelerator's kind) are asked for here; CPU devices have pinned memory too."""
    monkeypatch.setattr(_host_pool, "host_pages_for", KINDS[request.param])
    return request.param


def build(cfg):
    """sglang-jax's pool of `cfg`; with data ranks, on the mesh its scheduler makes for
    data-parallel attention (`dp` ranks over `tp` devices, `tp // dp` tensor shards each)."""
    if cfg.dp == 1:
        return sp.build(cfg)
    mesh = create_device_mesh(
        ici_parallelism=[cfg.dp, cfg.tp // cfg.dp],
        dcn_parallelism=[1, 1],
        devices=sp.devices(cfg.tp),
        use_explicit_sharding=True,
    )
    return MHATokenToKVPool(
        size=cfg.size,
        page_size=cfg.page_size,
        dtype=cfg.jnp_dtype,
        head_num=cfg.head_num,
        head_dim=cfg.head_dim,
        layer_num=cfg.layer_num,
        mesh=mesh,
        dp_size=cfg.dp,
    )


def fill(pool, rng, attrs=("kv_buffer", "indexer_key_buffer")) -> None:
    """Every entry of the buffer families `attrs` of `pool` (those it has) random and nonzero,
    put in place in the pool's per-layer lists."""
    for attr in attrs:
        layers = getattr(pool, attr, None) or []
        for layer, buf in enumerate(layers):
            values = sp.random_values(rng, buf.shape, buf.dtype)
            layers[layer] = jax.device_put(values, buf.sharding)


def filled(cfg, rng):
    """sglang-jax's pool of `cfg`, every entry of every buffer random (and nonzero)."""
    pool = build(cfg)
    fill(pool, rng)
    return pool


def filled_with_bits(cfg, rng):
    """sglang-jax's pool of `cfg`, every entry a random bit pattern, NaN payloads (quiet and
    signalling, either sign), infinities and subnormals among them."""
    pool = build(cfg)
    for layer, buf in enumerate(pool.kv_buffer):
        width = np.dtype(buf.dtype).itemsize * 8
        bits = rng.integers(0, 1 << width, buf.shape, dtype=np.uint64).astype(f"u{width // 8}")
        special = SPECIAL_BITS[width]
        bits.reshape(-1)[: len(special)] = special
        values = bits.view(np.dtype(buf.dtype))
        pool.kv_buffer[layer] = jax.device_put(values, buf.sharding)
        np.testing.assert_array_equal(
            testing.raw_bits(pool.kv_buffer[layer]), bits
        )  # put as it was
    return pool


# Per width: quiet NaNs with payloads, signalling NaNs, a negative NaN, infinities, the
# smallest subnormal, negative zero.
SPECIAL_BITS = {
    16: np.array([0x7FC1, 0x7F81, 0xFFC3, 0x7F80, 0xFF80, 0x0001, 0x8000], np.uint16),
    32: np.array(
        [0x7FC00001, 0x7F800001, 0xFFC00003, 0x7F800000, 0xFF800000, 0x00000001, 0x80000000],
        np.uint32,
    ),
}


def host_pool(device_pool, pool_size, **overrides):
    """The host pool as sglang-jax's `init_hicache` makes it."""
    args = dict(
        device_pool=device_pool,
        pool_size=pool_size,
        page_size=device_pool.page_size,
        layer_num=device_pool.layer_num,
        per_layer_shape=tuple(int(d) for d in device_pool.kv_buffer[0].shape[1:]),
        dtype=device_pool.dtype,
        mesh=device_pool.mesh,
        partition_spec=device_pool.kv_sharding.spec,
    )
    args.update(overrides)
    return LRUHostKVPool(**args)


def pages_bits(device_pool, pages):
    """Per layer, the bits of device pages `pages`."""
    return [testing.raw_bits(buf)[list(pages)] for buf in device_pool.kv_buffer]


def assert_pages(device_pool, pages, expected):
    for layer, (got, want) in enumerate(zip(pages_bits(device_pool, pages), expected)):
        np.testing.assert_array_equal(got, want, err_msg=f"layer {layer}")


# ---- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [pytest.param(c, id=c.name) for c in POOLS])
def test_round_trip_moves_whole_pages_bit_exact(cfg, rng, memory):
    kv = filled(cfg, rng)
    n_pages = kv.kv_buffer[0].shape[0]
    sharding = [buf.sharding for buf in kv.kv_buffer]
    count = min(7, n_pages // 2)  # 7 = 4 + 2 + 1: three chunks each way
    order = rng.permutation(n_pages)
    src, dst = order[:count].tolist(), order[count : 2 * count].tolist()
    before = [testing.raw_bits(buf) for buf in kv.kv_buffer]
    pool = host_pool(kv, pool_size=count + 1)
    slots = [int(s) for s in pool.alloc(count)]

    pool.copy_into(src, slots)
    # Back in another order than they went out: slot k's page lands in dst[k].
    back = rng.permutation(count)
    pool.copy_to_device([slots[k] for k in back], [dst[k] for k in back])

    for layer, buf in enumerate(kv.kv_buffer):
        want = before[layer].copy()
        want[dst] = before[layer][src]
        np.testing.assert_array_equal(testing.raw_bits(buf), want, err_msg=f"layer {layer}")
        assert buf.sharding == sharding[layer]
    # The slots keep their pages: a second load gives them again.
    pool.copy_to_device(slots[:1], [src[0]])
    assert_pages(kv, [src[0]], [b[[src[0]]] for b in before])


@pytest.mark.parametrize(
    "cfg", [pytest.param(sp.BY_NAME[c], id=c) for c in ("mha-bf16-p4", "mha-f32-p4")]
)
def test_every_bit_pattern_goes_and_comes_back(cfg, rng, memory):
    # NaN payloads included: pages move as bits, never through float arithmetic, which would
    # quiet or canonicalise them.
    kv = filled_with_bits(cfg, rng)
    before = [testing.raw_bits(buf) for buf in kv.kv_buffer]
    pool = host_pool(kv, pool_size=3)
    slots = [int(s) for s in pool.alloc(3)]
    pool.copy_into([0, 1, 2], slots)
    pool.copy_to_device(slots, [7, 8, 9])
    for layer, buf in enumerate(kv.kv_buffer):
        want = before[layer].copy()
        want[[7, 8, 9]] = before[layer][[0, 1, 2]]
        np.testing.assert_array_equal(testing.raw_bits(buf), want, err_msg=f"layer {layer}")


@pytest.mark.parametrize("cfg", [pytest.param(c, id=c.name) for c in (DSA, DSA3)])
def test_a_dsa_page_comes_back_with_its_indexer_keys(cfg, rng, memory):
    # The indexer keys are part of a DSA pool's pages: a page loaded back into device pages
    # that meanwhile held other tokens keeps none of their indexer keys.
    kv = filled(cfg, rng)
    assert len(kv.indexer_key_buffer) == cfg.num_indexer_layers
    before = sp.pool_bits(kv)
    pool = host_pool(kv, pool_size=3)
    slots = [int(s) for s in pool.alloc(3)]
    pool.copy_into([1, 2, 5], slots)
    # The device pages reused: every entry, KV and indexer keys, overwritten (negated: its
    # sign bit, at least, differs).
    for layers in (kv.kv_buffer, kv.indexer_key_buffer):
        for layer, buf in enumerate(layers):
            layers[layer] = jax.device_put(-np.asarray(buf), buf.sharding)
    reused = sp.pool_bits(kv)
    for attr, layers in reused.items():
        for layer, bits in enumerate(layers):
            assert (bits[[1, 2, 5]] != before[attr][layer][[1, 2, 5]]).all(), f"{attr}[{layer}]"
    pool.copy_to_device(slots[::-1], [5, 2, 1])

    after = sp.pool_bits(kv)
    assert sorted(after) == ["indexer_key_buffer", "kv_buffer"]
    for attr, layers in after.items():
        for layer, got in enumerate(layers):
            want = reused[attr][layer].copy()
            want[[1, 2, 5]] = before[attr][layer][[1, 2, 5]]
            np.testing.assert_array_equal(got, want, err_msg=f"{attr}[{layer}]")


# The sglang-jax pools jaxkv's connector reads: MHA, MLA, MLA with DSA's indexer keys, and
# MHA with heads over two devices.
CONNECTOR_POOLS = ("mha-bf16-p4", "mla-bf16-p4-lora512", "mla-bf16-p4-dsa", "mha-bf16-p4-tp2")


@pytest.mark.parametrize("name", CONNECTOR_POOLS)
def test_a_round_trip_restores_everything_the_connector_stores(name, rng, memory):
    # What the connector stores of a page is what the host pool has to move: every part of
    # its layout, read from the connector rather than listed here, so a buffer family the
    # pools gain fails this until the host pool moves it too.
    cfg = sp.BY_NAME[name]
    kv = sp.build(cfg)
    conn = KVConnector(kv, HostStore(1 << 20), block_size=cfg.page_size)
    parts = conn.layout.parts
    fill(kv, rng, [part.attr for part in parts])
    src, dst = [1, 2], [4, 3]

    def token_slots(pages):
        return [p * cfg.page_size + o for p in pages for o in range(cfg.page_size)]

    stored = conn.export_blocks(kv, token_slots(src))
    assert sorted(stored) == sorted(part.key for part in parts)
    before = {part.attr: [testing.raw_bits(b) for b in getattr(kv, part.attr)] for part in parts}
    pool = host_pool(kv, pool_size=2)
    slots = [int(s) for s in pool.alloc(2)]
    pool.copy_into(src, slots)
    pool.copy_to_device(slots, dst)

    loaded = conn.export_blocks(kv, token_slots(dst))
    for key, blocks in stored.items():
        np.testing.assert_array_equal(loaded[key], blocks, err_msg=key)
    for part in parts:
        layers = getattr(kv, part.attr)
        assert len(layers) == conn.layout.part_layers(part)
        for layer, buf in enumerate(layers):
            want = before[part.attr][layer].copy()
            want[dst] = want[src]
            np.testing.assert_array_equal(
                testing.raw_bits(buf), want, err_msg=f"{part.attr}[{layer}]"
            )


@pytest.mark.parametrize(
    "cfg", [pytest.param(c, id=c.name) for c in (DSA3, DP2, sp.BY_NAME["mha-bf16-p4-tp2"])]
)
def test_host_memory_holds_every_buffer_of_a_page(cfg, rng):
    # A slot's page is every layer of every buffer family: the arena's rows have room for all
    # of it (a tensor-parallel page once, in its devices' shares).
    kv = filled(cfg, rng)
    buffers = [*kv.kv_buffer, *(getattr(kv, "indexer_key_buffer", None) or [])]
    per_page = sum(buf.nbytes // buf.shape[0] for buf in buffers)
    pool = host_pool(kv, pool_size=3)
    assert pool.page_nbytes == per_page
    assert pool.total_size() == 3
    assert pool._host.rows == 3 and pool._host.nbytes == 3 * per_page


def test_sglang_jax_pools_declare_their_families_over_data_ranks_too(rng):
    # The host pool moves the families `PoolLayout.declared_for` lists; a pool over data ranks
    # is described too (pages move by global id), though the connector refuses it (its token
    # slots are rank-local).
    dp2 = filled(DP2, rng)
    with pytest.raises(UnsupportedKVCacheError, match="dp_size=2"):
        KVConnector(dp2, HostStore(1 << 20))
    assert [b.attr for b in PoolLayout.declared_for(dp2).buffers] == ["kv_buffer"]
    dsa = PoolLayout.declared_for(filled(DSA3, rng))
    assert [(b.attr, b.own_layers) for b in dsa.buffers] == [
        ("kv_buffer", False),
        ("indexer_key_buffer", True),
    ]
    assert PoolLayout.declared_for(_Hooked(dp2)) is None  # not sglang-jax's class


def test_a_load_on_cpu_writes_the_device_buffers_in_place(rng):
    # The arena's load writes the pages into the buffers' own memory: the old arrays are
    # deleted, as any donation deletes them, and nothing of the buffers is copied, load after
    # load (the host views a backup reads through hold nothing back).
    kv = filled(sp.BY_NAME["mha-bf16-p4-tp2"], rng)
    before = [testing.raw_bits(buf) for buf in kv.kv_buffer]
    pointers = testing.buffer_pointers(kv.kv_buffer)
    pool = host_pool(kv, pool_size=4)
    assert isinstance(pool._host, _pages_on_host.ArenaPages)
    slots = [int(s) for s in pool.alloc(4)]
    for round_ in range(2):
        old = list(kv.kv_buffer)
        pool.copy_into([1, 2, 3, 4], slots)
        pool.copy_to_device(slots, [9 + round_, 11, 12, 13])
        assert all(buf.is_deleted() for buf in old)
        testing.assert_updated_in_place(pointers, kv.kv_buffer)
    assert_pages(kv, [10, 11, 12, 13], [b[[1, 2, 3, 4]] for b in before])


def test_a_page_moves_with_its_heads_on_their_devices(rng, memory):
    cfg = sp.BY_NAME["mha-bf16-p4-tp2"]
    kv = filled(cfg, rng)
    before = [testing.raw_bits(buf) for buf in kv.kv_buffer]
    pool = host_pool(kv, pool_size=2)
    slots = [int(s) for s in pool.alloc(2)]
    pool.copy_into([1, 2], slots)
    pool.copy_to_device(slots, [5, 6])
    buf = kv.kv_buffer[0]
    for shard in buf.addressable_shards:
        heads = shard.index[2]
        np.testing.assert_array_equal(
            testing.raw_bits(shard.data)[[5, 6]],
            before[0][[1, 2]][:, :, heads],
            err_msg=str(shard.device),
        )


def test_slots_backed_up_apart_load_together(rng, memory):
    # Pages staged by separate backups (separate chunks in host memory) load in one call.
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    before = [testing.raw_bits(buf) for buf in kv.kv_buffer]
    pool = host_pool(kv, pool_size=5)
    slots = [int(s) for s in pool.alloc(5)]
    pool.copy_into([1, 2, 3], slots[:3])
    pool.copy_into([4, 5], slots[3:])
    pool.copy_to_device(slots[::-1], [10, 11, 12, 13, 14])
    assert_pages(kv, [10, 11, 12, 13, 14], [b[[5, 4, 3, 2, 1]] for b in before])


def test_staged_load_flushes_in_parts(rng, memory):
    # One stage_load, flushed in two calls and another order.
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    before = [testing.raw_bits(buf) for buf in kv.kv_buffer]
    pool = host_pool(kv, pool_size=3)
    slots = [int(s) for s in pool.alloc(3)]
    pool.copy_into([1, 2, 3], slots)
    pool.stage_load(slots)
    pool.flush_load([slots[2]], [9])
    pool.flush_load([slots[1], slots[0]], [8, 7])
    assert_pages(kv, [7, 8, 9], [b[[1, 2, 3]] for b in before])
    with pytest.raises(RuntimeError, match="stage_load must run first"):
        pool.flush_load([slots[0]], [7])  # a staged page is flushed once


def test_pages_outside_the_transfer_stay_as_they_were(rng, memory):
    kv = filled(sp.BY_NAME["mha-bf16-p4"], rng)
    before = [testing.raw_bits(buf) for buf in kv.kv_buffer]
    pool = host_pool(kv, pool_size=3)
    slots = [int(s) for s in pool.alloc(3)]
    pool.copy_into([2, 3, 4], slots)
    pool.copy_to_device(slots, [8, 9, 10])
    untouched = [p for p in range(kv.kv_buffer[0].shape[0]) if p not in (8, 9, 10)]
    assert_pages(kv, untouched, [b[untouched] for b in before])


# ---- a slot freed and reused while its old owner's transfer runs ----------------------------


class _Hooked:
    """A device pool whose `kv_buffer` runs `hook` once, the next time it is read: the seam
    a test has into the moment a transfer reads the device buffers."""

    def __init__(self, pool):
        self._pool, self.hook = pool, None

    @property
    def kv_buffer(self):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return self._pool.kv_buffer

    def __getattr__(self, name):
        return getattr(self._pool, name)


def test_slot_reused_during_a_gather_gets_nothing_of_it(rng, memory):
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    hooked = _Hooked(kv)
    pool = host_pool(hooked, pool_size=1)  # one slot: a free and an alloc hand back the same
    [slot] = pool.alloc(1)
    reused = []

    def free_and_reuse():
        pool.free([slot])
        reused.extend(pool.alloc(1))

    hooked.hook = free_and_reuse
    pool.stage_backup([3], [slot])  # the hook runs while the gather reads the buffers

    assert reused == [slot]
    with pytest.raises(RuntimeError, match="nothing staged"):
        pool.flush_backup([slot])
    with pytest.raises(RuntimeError, match="holds no page"):
        pool.stage_load([slot])
    # The new owner's own page goes and comes back intact.
    before = pages_bits(kv, [5])
    pool.copy_into([5], [slot])
    pool.copy_to_device([slot], [9])
    assert_pages(kv, [9], before)


def test_backup_staged_before_a_free_is_never_published(rng, memory):
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    pool = host_pool(kv, pool_size=1)
    [slot] = pool.alloc(1)
    pool.stage_backup([3], [slot])
    pool.free([slot])
    assert list(pool.alloc(1)) == [slot]
    with pytest.raises(RuntimeError, match="nothing staged"):
        pool.flush_backup([slot])
    with pytest.raises(RuntimeError, match="holds no page"):
        pool.stage_load([slot])


def test_load_staged_before_a_free_is_never_scattered(rng, memory):
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    pool = host_pool(kv, pool_size=1)
    [slot] = pool.alloc(1)
    pool.copy_into([3], [slot])
    pool.stage_load([slot])
    pool.free([slot])
    assert list(pool.alloc(1)) == [slot]
    pool.copy_into([4], [slot])  # the new owner's page
    before = pages_bits(kv, [9])
    with pytest.raises(RuntimeError, match="stage_load must run first"):
        pool.flush_load([slot], [9])
    assert_pages(kv, [9], before)


class _Gated:
    """Host memory whose copies into and out of slots (`keep`, `fetch`) wait at a gate the
    test opens: the seam into the moment a worker's transfer is halfway."""

    def __init__(self, inner):
        self._inner = inner
        self.copying = threading.Event()  # a copy reached the gate
        self.gate = threading.Event()

    def _wait(self):
        self.copying.set()
        assert self.gate.wait(30), "the test never opened the gate"

    def keep(self, slots, landed, rows):
        self._wait()
        self._inner.keep(slots, landed, rows)

    def fetch(self, slots):
        self._wait()
        return self._inner.fetch(slots)

    def __getattr__(self, name):  # gather, scatter, drop, precompile
        return getattr(self._inner, name)


@pytest.fixture
def gated(memory, monkeypatch):
    made: list[_Gated] = []

    def make(slots, mover):
        made.append(_Gated(KINDS[memory](slots, mover)))
        return made[-1]

    monkeypatch.setattr(_host_pool, "host_pages_for", make)
    yield made
    for g in made:
        g.gate.set()


def _halfway(host, transfer, *args):
    """Runs `transfer(*args)` on a worker thread until its copy waits at the gate."""
    errors: list[BaseException] = []

    def run():
        try:
            transfer(*args)
        except BaseException as err:  # reported by the test through `errors`
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    assert host.copying.wait(30), "the transfer never reached its copy"
    return thread, errors


@pytest.mark.parametrize("phase", ["flush_backup", "stage_load"])
def test_a_slot_freed_during_its_copy_is_handed_out_only_after_it(rng, gated, phase):
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    pool = host_pool(kv, pool_size=2)
    [host] = gated
    slots = [int(s) for s in pool.alloc(2)]
    if phase == "flush_backup":
        pool.stage_backup([1, 2], slots)
    else:
        host.gate.set()
        pool.copy_into([1, 2], slots)
        host.gate.clear()
        host.copying.clear()
    thread, errors = _halfway(host, getattr(pool, phase), slots)

    pool.free(slots)  # the scheduler frees while the worker copies
    assert pool.available_size() == 0
    assert pool.alloc(1) is None  # not while the copy runs
    host.gate.set()
    thread.join()
    assert errors == []  # the copy finished; it published nothing for the freed slots
    assert pool.available_size() == 2
    again = [int(s) for s in pool.alloc(2)]
    assert sorted(again) == sorted(slots)
    with pytest.raises(RuntimeError, match="holds no page"):
        pool.stage_load(again)
    with pytest.raises(RuntimeError, match="nothing staged"):
        pool.flush_load(again, [9, 10])


@pytest.mark.parametrize("phase", ["flush_backup", "stage_load"])
def test_a_copy_in_and_a_copy_out_of_one_slot_never_overlap(rng, gated, phase):
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    pool = host_pool(kv, pool_size=1)
    [host] = gated
    [slot] = [int(s) for s in pool.alloc(1)]
    host.gate.set()
    pool.copy_into([1], [slot])
    pool.stage_backup([2], [slot])
    host.gate.clear()
    host.copying.clear()
    old, new = pages_bits(kv, [1]), pages_bits(kv, [2])
    if phase == "flush_backup":
        thread, errors = _halfway(host, pool.flush_backup, [slot])
        with pytest.raises(RuntimeError, match="being written by flush_backup"):
            pool.stage_load([slot])
    else:
        thread, errors = _halfway(host, pool.stage_load, [slot])
        with pytest.raises(RuntimeError, match="being read by stage_load"):
            pool.flush_backup([slot])
    host.gate.set()
    thread.join()
    assert errors == []
    if phase == "stage_load":  # the refused backup is still staged; the load read the old page
        pool.flush_load([slot], [9])
        assert_pages(kv, [9], old)
        pool.flush_backup([slot])
    pool.copy_to_device([slot], [10])
    assert_pages(kv, [10], new)


def test_two_backups_into_one_slot_never_overlap(rng, gated):
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    pool = host_pool(kv, pool_size=1)
    [host] = gated
    [slot] = [int(s) for s in pool.alloc(1)]
    first = pages_bits(kv, [1])
    pool.stage_backup([1], [slot])
    thread, errors = _halfway(host, pool.flush_backup, [slot])
    pool.stage_backup([2], [slot])
    with pytest.raises(RuntimeError, match="being written by flush_backup"):
        pool.flush_backup([slot])
    host.gate.set()
    thread.join()
    assert errors == []
    pool.copy_to_device([slot], [9])
    assert_pages(kv, [9], first)
    pool.flush_backup([slot])  # the refused one is still staged
    pool.copy_to_device([slot], [10])
    assert_pages(kv, [10], pages_bits(kv, [2]))


@pytest.mark.parametrize("phase", ["flush_backup", "stage_load"])
def test_free_during_a_transfer_on_another_thread_never_mixes_owners(rng, memory, phase):
    # The controller runs flush_backup and stage_load on its worker while the radix cache
    # frees slots on the scheduler thread. Whatever the interleaving, the slot's next owner
    # reads back its own page, and the worker's transfer either completes for the old owner
    # or finds nothing to do.
    kv = filled(sp.BY_NAME["mha-f32-p16"], rng)
    before = [testing.raw_bits(buf) for buf in kv.kv_buffer]
    pool = host_pool(kv, pool_size=8)
    old, new, dst = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18], list(range(30, 38))
    for _ in range(8):
        slots = [int(s) for s in pool.alloc(8)]
        if phase == "flush_backup":
            pool.stage_backup(old, slots)
            transfer = pool.flush_backup
        else:
            pool.copy_into(old, slots)
            transfer = pool.stage_load
        errors: list[RuntimeError] = []

        def worker(transfer=transfer, slots=slots, errors=errors):
            try:
                transfer(slots)
            except RuntimeError as err:  # the free came first: nothing left to transfer
                errors.append(err)

        thread = threading.Thread(target=worker)
        thread.start()
        pool.free(slots)
        again, deadline = None, time.monotonic() + 30
        while again is None:  # a slot under a running copy is not handed out again
            assert time.monotonic() < deadline, "freed slots never came back"
            time.sleep(0.0002)
            again = pool.alloc(8)
        thread.join()
        assert sorted(int(s) for s in again) == sorted(slots)
        pool.copy_into(new, [int(s) for s in again])
        pool.copy_to_device([int(s) for s in again], dst)
        assert_pages(kv, dst, [b[new] for b in before])
        pool.free([int(s) for s in again])
        assert pool.available_size() == 8


def test_a_staged_load_keeps_the_page_it_read(rng, memory):
    # A backup flushed into a slot after its load was staged replaces the slot's page; the
    # staged load still scatters the page it read.
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    pool = host_pool(kv, pool_size=1)
    [slot] = pool.alloc(1)
    old, new = pages_bits(kv, [3]), pages_bits(kv, [4])
    pool.copy_into([3], [slot])
    pool.stage_load([slot])
    pool.copy_into([4], [slot])
    pool.flush_load([slot], [9])
    assert_pages(kv, [9], old)
    pool.copy_to_device([slot], [10])
    assert_pages(kv, [10], new)


# Frees are rarer than the rest: each drops whatever its slots had staged.
OPS = ["alloc", "stage_backup", "flush_backup", "stage_load", "flush_load", "free"]
OP_WEIGHTS = [0.15, 0.2, 0.17, 0.17, 0.23, 0.08]


@pytest.mark.parametrize(
    "cfg", [pytest.param(c, id=c.name) for c in (sp.BY_NAME["mha-f32-p4"], DP2)]
)
def test_random_moves_match_a_model_of_the_pool(cfg, rng, memory):
    # Backups and loads staged and flushed in parts and out of order, slots backed up into
    # again while loads from them are staged, frees between phases: every flushed load writes
    # the page its stage_load read, and the pool's other device pages stay as they were.
    kv = filled(cfg, rng)
    n_pages = kv.kv_buffer[0].shape[0]
    device = [testing.raw_bits(buf) for buf in kv.kv_buffer]  # the model of the device pool
    pool = host_pool(kv, pool_size=6)
    held: dict[int, list] = {}  # slot -> the page it holds (per layer bits), once flushed
    allocated: set[int] = set()
    backups: dict[int, list] = {}  # staged, per slot
    loads: dict[int, list] = {}

    def some(items, at_most):
        items = sorted(items)
        k = int(rng.integers(1, min(at_most, len(items)) + 1))
        return [items[i] for i in rng.permutation(len(items))[:k]]

    done: collections.Counter[str] = collections.Counter()
    for _ in range(200):
        op = OPS[rng.choice(len(OPS), p=OP_WEIGHTS)]
        if op == "alloc" and pool.available_size():
            got = pool.alloc(int(rng.integers(1, pool.available_size() + 1)))
            allocated.update(int(s) for s in got)
        elif op == "stage_backup" and allocated:
            slots = some(allocated, 4)
            pages = rng.choice(n_pages, len(slots), replace=False).tolist()
            pool.stage_backup(pages, slots)
            done[op] += 1
            for slot, page in zip(slots, pages):
                backups[slot] = [d[page].copy() for d in device]
        elif op == "flush_backup" and backups:
            slots = some(backups, 4)
            pool.flush_backup(slots)
            done[op] += 1
            for slot in slots:
                held[slot] = backups.pop(slot)
        elif op == "stage_load" and held:
            slots = some(held, 4)
            pool.stage_load(slots)
            done[op] += 1
            for slot in slots:
                loads[slot] = held[slot]
        elif op == "flush_load" and loads:
            slots = some(loads, 4)
            pages = rng.choice(n_pages, len(slots), replace=False).tolist()
            pool.flush_load(slots, pages)
            done[op] += 1
            for slot, page in zip(slots, pages):
                page_bits = loads.pop(slot)
                for layer, d in enumerate(device):
                    d[page] = page_bits[layer]
            for layer, buf in enumerate(kv.kv_buffer):
                np.testing.assert_array_equal(
                    testing.raw_bits(buf), device[layer], err_msg=f"layer {layer}"
                )
        elif op == "free" and allocated:
            slots = some(allocated, 3)
            pool.free(slots)
            for slot in slots:
                allocated.discard(slot)
                for staged in (held, backups, loads):
                    staged.pop(slot, None)
    assert min(done[op] for op in ("stage_backup", "flush_backup", "stage_load", "flush_load")) >= 5
    pool.free(sorted(allocated))
    assert pool.available_size() == 6
    if memory == "arena":
        assert pool._host.rows_held() == 0  # every row came back


def test_the_arena_keeps_one_row_a_slot_in_hicaches_flow(rng):
    # Back up into fresh slots, load back, free: the arena never needs more rows than slots.
    # A slot backed up into again while a load from it is staged holds two pages until the
    # load's flush; then a row is added, and every row comes back once its holders are gone.
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    pool = host_pool(kv, pool_size=4)
    arena = pool._host
    for _ in range(3):
        slots = [int(s) for s in pool.alloc(4)]
        pool.stage_backup([1, 2, 3, 4], slots)
        pool.free(slots[:1])  # a slot freed between the phases
        pool.flush_backup(slots[1:])
        pool.copy_to_device(slots[1:], [5, 6, 7])
        pool.free(slots[1:])
        assert arena.rows == 4 and arena.rows_held() == 0
    slots = [int(s) for s in pool.alloc(4)]
    pool.copy_into([1, 2, 3, 4], slots)
    pool.stage_load(slots[:1])
    pool.copy_into([5], slots[:1])  # the staged load still holds the slot's old page
    assert arena.rows > 4 and arena.rows_held() == 5
    pool.flush_load(slots[:1], [9])
    assert arena.rows_held() == 4
    pool.free(slots)
    assert arena.rows_held() == 0


# ---- slots ---------------------------------------------------------------------------------


def test_alloc_and_free_are_all_or_nothing(rng):
    pool = host_pool(filled(sp.BY_NAME["mha-f32-p4"], rng), pool_size=4)
    a = [int(s) for s in pool.alloc(3)]
    assert pool.alloc(2) is None
    assert pool.available_size() == 1
    pool.inc_lock_ref(a[1])
    with pytest.raises(RuntimeError, match="locked"):
        pool.free(a)
    assert pool.available_size() == 1  # nothing freed
    pool.dec_lock_ref(a[1])
    pool.free([a[0], a[0], a[2]])  # repeats count once
    assert pool.available_size() == 3
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[1], a[0]])
    assert pool.available_size() == 3
    with pytest.raises(ValueError, match="need_pages"):
        pool.alloc(0)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p, s: p.stage_backup([1, 2], [s]), "as many device pages as host ids, got 2 and 1"),
        (lambda p, s: p.stage_backup([1], [s, s]), "distinct"),
        (lambda p, s: p.stage_backup([99], [s]), r"device page ids in \[0, 21\)"),
        (lambda p, s: p.flush_load([s], [-1]), r"device page ids in \[0, 21\)"),
        (lambda p, s: p.copy_into([1], [7]), r"host page ids in \[0, 2\)"),
        (lambda p, s: p.release(2), r"host page id in \[0, 2\)"),
        (lambda p, s: p.inc_lock_ref(-1), r"host page id in \[0, 2\)"),
    ],
)
def test_bad_ids_raise_naming_the_argument(rng, call, match):
    pool = host_pool(filled(sp.BY_NAME["mha-f32-p4"], rng), pool_size=2)
    [slot] = pool.alloc(1)
    with pytest.raises(ValueError, match=match):
        call(pool, int(slot))


def test_flush_load_refuses_one_device_page_twice(rng):
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    pool = host_pool(kv, pool_size=2)
    slots = [int(s) for s in pool.alloc(2)]
    pool.copy_into([1, 2], slots)
    pool.stage_load(slots)
    before = [testing.raw_bits(buf) for buf in kv.kv_buffer]
    with pytest.raises(ValueError, match="device_indices: expected distinct"):
        pool.flush_load(slots, [5, 5])
    for got, want in zip(kv.kv_buffer, before):
        np.testing.assert_array_equal(testing.raw_bits(got), want)
    pool.flush_load(slots, [5, 6])  # still staged: the refusal took nothing


# ---- construction --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"pool_size": 0}, "pool_size: expected a positive int, got 0"),
        ({"layer_num": 3}, r"layer_num: expected the device pool's layer count \(2"),
        ({"page_size": 8}, r"page_size: expected the device pool's page_size \(4"),
        # Heads replicated, where the pool splits them over the tensor axis.
        ({"partition_spec": P("data", None, None, None, None)}, "mesh, partition_spec"),
    ],
)
def test_arguments_that_contradict_the_device_pool_raise(rng, overrides, match):
    kv = filled(sp.BY_NAME["mha-bf16-p4-tp2"], rng)
    with pytest.raises(ValueError, match=match):
        host_pool(kv, **{"pool_size": 2, **overrides})


def test_a_page_shape_unlike_the_device_pools_is_logged_and_not_used(rng, caplog):
    # sglang-jax's pool only records per_layer_shape and dtype (its own tests pass one that
    # is not the device pool's); the device pool's buffers are what a transfer moves.
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    with caplog.at_level(logging.WARNING):
        pool = host_pool(kv, pool_size=1, per_layer_shape=(8,))
    assert "per_layer_shape, dtype: the device pool's pages are float32[4, 4, 1, 128]" in (
        caplog.text
    )
    before = pages_bits(kv, [2])
    [slot] = pool.alloc(1)
    pool.copy_into([2], [slot])
    pool.copy_to_device([slot], [3])
    assert_pages(kv, [3], before)


def test_buffers_off_a_named_sharding_are_refused(rng):
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    single = jax.sharding.SingleDeviceSharding(sp.devices(1)[0])

    class Unsharded:
        page_size, layer_num, dtype, mesh, kv_sharding = (
            kv.page_size,
            kv.layer_num,
            kv.dtype,
            kv.mesh,
            kv.kv_sharding,
        )
        kv_buffer = [jax.device_put(np.asarray(b), single) for b in kv.kv_buffer]

    with pytest.raises(TypeError, match=r"kv_buffer\[0\]: expected an array on a NamedSharding"):
        host_pool(Unsharded(), pool_size=1)


# ---- compilation ---------------------------------------------------------------------------


def test_chunk_sizes_are_the_powers_of_two_of_the_count():
    for n in range(130):
        sizes = chunk_sizes(n)
        assert sum(sizes) == n
        assert sizes == sorted(set(sizes), reverse=True)
        assert all(s & (s - 1) == 0 for s in sizes)


@pytest.mark.parametrize(
    "cfg", [pytest.param(c, id=c.name) for c in (sp.BY_NAME["mha-f32-p4"], DSA)]
)
def test_precompiled_transfers_compile_nothing_while_serving(cfg, rng, memory, caplog):
    # A DSA pool's indexer keys too: every family's calls are compiled ahead.
    kv = filled(cfg, rng)
    pool = host_pool(kv, pool_size=7)
    pool.precompile_transfers()
    assert pool.available_size() == 7  # it moves no page and holds no slot
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        caplog.clear()
        for count in range(1, 8):
            slots = [int(s) for s in pool.alloc(count)]
            pool.copy_into(list(range(1, count + 1)), slots)
            pool.copy_to_device(slots, list(range(10, 10 + count)))
            pool.free(slots)
    compiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert compiles == []


def test_it_is_sglang_jaxs_host_pool(rng):
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    pool = host_pool(kv, pool_size=1)
    assert isinstance(pool, HostKVPool)
    [slot] = pool.alloc(1)
    # Prefill-decode handoff is the other host pool's job, as in sglang-jax's own.
    with pytest.raises(NotImplementedError):
        pool.copy_from_device(list(kv.kv_buffer), int(slot))


def test_the_last_page_of_the_buffers_is_a_device_page(rng):
    # The page axis holds the padding pages too: its last page is valid, one past is not.
    kv = filled(sp.BY_NAME["mha-f32-p4"], rng)
    top = kv.kv_buffer[0].shape[0] - 1
    pool = host_pool(kv, pool_size=1)
    [slot] = pool.alloc(1)
    before = pages_bits(kv, [top])
    pool.copy_into([top], [slot])
    pool.copy_to_device([slot], [1])
    assert_pages(kv, [1], before)
    with pytest.raises(ValueError, match=rf"device page ids in \[0, {top + 1}\) .*, got {top + 1}"):
        pool.stage_backup([top + 1], [slot])


# ---- packaging -----------------------------------------------------------------------------


def test_jaxkv_imports_no_sglang_jax():
    # Without sglang-jax on the path: `import jaxkv` and the integration package work, and
    # reaching the class says what is missing.
    code = (
        "import sys, jaxkv, jaxkv.integrations.sglang_jax as m\n"
        "assert 'sgl_jax' not in sys.modules, 'imported sglang-jax'\n"
        "try:\n"
        "    m.LRUHostKVPool\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "subclasses sglang-jax's HostKVPool" in out.stdout
