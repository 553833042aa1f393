"""Pools over a mesh of 8 virtual CPU devices, and the two-process store/load worker.

Run by tests/pools/test_mesh.py in fresh interpreters (the device count is fixed when jax starts):

    python tests/mesh_checks.py single DUMP_DIR       # one process, 8 devices, every check
    python tests/mesh_checks.py worker PID PORT DIR PHASE   # one of two processes, 4 devices each

`single` compares every pool kind, on a 1-D and a 2-D mesh, against the same pool on one device
(eager and jitted updates, then a connector round trip), checks shardings, retraces, the
compiled updates' collectives, and that blocks stored at one tensor-parallel degree miss at
another. XLA dumps every module it compiles to DUMP_DIR; the test then scans those for
pool-sized collectives (the eager paths too). `worker` phase "store" writes a head-sharded pool
and stores a prefix into a DiskStore in DIR; phase "load" starts from an empty pool, agrees on
the prefix length with the other process and loads it, then checks every bit.
"""

from __future__ import annotations

import os
import re
import sys

if __name__ == "__main__":  # imported by the test only for `pool_sized_collectives`
    MODE = sys.argv[1]
    os.environ["JAX_PLATFORMS"] = "cpu"
    _FLAGS = [f"--xla_force_host_platform_device_count={8 if MODE == 'single' else 4}"]
    if MODE == "single":
        _FLAGS += [f"--xla_dump_to={sys.argv[2]}", "--xla_dump_hlo_as_text"]
        # Every module must be compiled here to be dumped: no executables from a cache.
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    # Added to the flags the suite runs with (tests/conftest.py).
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FLAGS]).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import testing  # noqa: E402
from jaxkv.connector import DiskStore, HostStore, KVConnector, min_block_count  # noqa: E402

HEADS = P(None, "tp", None)
SIZES = {
    "mha": (jaxkv.MHAPool, dict(head_num=8, head_dim=16, v_head_dim=8)),
    "konly": (jaxkv.KOnlyPool, dict(head_num=8, head_dim=16)),
    "mla": (jaxkv.MLAPool, dict(kv_lora_rank=32, qk_rope_head_dim=8)),
    "nsa": (jaxkv.NSAPool, dict(kv_lora_rank=32, qk_rope_head_dim=8, index_head_dim=16)),
}
SETTERS = {
    "mha": ("set_kv",),
    "konly": ("set_k",),
    "mla": ("set_kv", "set_mla_kv"),
    "nsa": ("set_kv", "set_index_k"),
}
# A collective whose result has at least as many elements as a pool buffer has rows moves a
# pool-sized operand: the pools have 2048 + page rows, one update's values 16 tokens (at most
# 16 x 8 x 16 = 2048 elements).
POOL_ELEMENTS = 2049
_COLLECTIVE = re.compile(
    r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
    r"(?:-start)?\("
)


def pool_sized_collectives(hlo: str) -> list[str]:
    """Lines of `hlo` holding a collective whose result has `POOL_ELEMENTS` or more."""
    hits = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m and int(np.prod([int(d) for d in m.group(1).split(",") if d])) >= POOL_ELEMENTS:
            hits.append(line.strip()[:200])
    return hits


def make(kind: str, sharding, size: int = 2048):
    cls, sizes = SIZES[kind]
    page = 16 if kind == "nsa" else 1
    return cls.create(size=size, page_size=page, layer_num=2, sharding=sharding, **sizes)


def values(pool, name: str, t: int, rng, sharding=None):
    """Random arguments of setter `name` for `t` tokens, placed with `sharding` if given."""
    if name == "set_index_k":
        args = [rng.standard_normal((t, pool.index_head_dim))]
    elif name == "set_mla_kv":
        args = [
            rng.standard_normal((t, 1, pool.kv_lora_rank)),
            rng.standard_normal((t, 1, pool.qk_rope_head_dim)),
        ]
    elif hasattr(pool, "kv_buffer"):
        args = [rng.standard_normal((t, 1, pool.kv_lora_rank + pool.qk_rope_head_dim)), None]
    else:
        args = [rng.standard_normal((t, pool.head_num, pool.head_dim))]
        if name == "set_kv":
            args.append(rng.standard_normal((t, pool.head_num, pool.v_head_dim)))
    out = []
    for a in args:
        if a is not None:
            a = jnp.asarray(a, jnp.float32)
            if sharding is not None and a.ndim == 3:
                a = jax.device_put(a, sharding)
        out.append(a)
    return out


def buffers(pool) -> dict[str, list]:
    """`pool`'s buffers by name: compared across placements, which its pytree structure (its
    sharding is static) tells apart."""
    return {name: list(getattr(pool, name)) for name in type(pool).BUFFERS}


def check_kind(kind: str, mesh, spec, rng) -> None:
    sharding = NamedSharding(mesh, spec)
    pool, ref = make(kind, sharding), make(kind, None)
    placed = testing.shardings(pool)

    def step(p, loc, *args):
        return getattr(p, name)(1, loc, *args)

    for name in SETTERS[kind]:
        jitted = jax.jit(testing.traced_once(step), donate_argnums=0)  # one trace per setter
        for start in (1, 33):  # eager writes layer 0; two jitted calls write layer 1
            loc = np.arange(start, start + 16)
            args = values(pool, name, 16, rng)
            pool = getattr(pool, name)(0, loc, *args)
            ref = getattr(ref, name)(0, loc, *args)
            pool = jitted(pool, jnp.asarray(loc), *args)
            ref = getattr(ref, name)(1, loc, *args)
        testing.assert_shardings_kept(placed, pool)
    testing.assert_bits_equal(buffers(pool), buffers(ref))  # the one-device pool's bits

    # Connector: store rows 1..48, reload them at 1025.., compare with the one-device pool.
    tokens, slots, dest = np.arange(48), np.arange(1, 49), np.arange(1025, 1073)
    conn = KVConnector(pool, HostStore(1 << 24), block_size=16)
    one = KVConnector(ref, HostStore(1 << 24), block_size=16)
    assert conn.store(pool, tokens, slots) == one.store(ref, tokens, slots) == 3  # blocks
    assert conn.lookup(tokens) == 48
    pool, n = conn.load(pool, tokens, dest)
    ref, m = one.load(ref, tokens, dest)
    assert n == m == 48, (kind, n, m)
    testing.assert_shardings_kept(placed, pool)
    testing.assert_bits_equal(buffers(pool), buffers(ref))
    # Each shard is stored once, whatever its replicas (the 2-D mesh holds two of each): the
    # bytes stored are the one-device pool's. export_blocks still returns full rows.
    split = spec == HEADS
    stored, want = conn.stats()["bytes_stored"], one.stats()["bytes_stored"]
    assert stored == want, (kind, stored, want)
    full, whole = conn.export_blocks(pool, slots), one.export_blocks(ref, slots)
    testing.assert_bits_equal(full, whole)
    # A replicated pool's shard is the whole buffer: its keys are the one-device pool's.
    if not split:
        assert one.lookup(tokens) == 48 and conn.block_hashes(tokens) == one.block_hashes(tokens)
        shared = KVConnector(pool, one.backend, block_size=16)
        assert shared.lookup(tokens) == 48, (kind, "replicated keys differ from one device")

    # The compiled jitted updates never move a pool-sized operand, with the values placed
    # on one device, replicated, or split along heads like the pool (on the 1-D mesh; every
    # module run on either mesh is scanned from XLA's dump by the test).
    for name in SETTERS[kind] if len(mesh.shape) == 1 else ():
        for value_sharding in (None, NamedSharding(mesh, P()), NamedSharding(mesh, spec)):
            args = values(pool, name, 16, rng, value_sharding)
            if value_sharding is not None and value_sharding.spec == spec and not split:
                continue
            hlo = (
                jax.jit(
                    lambda p, loc, *a, name=name: getattr(p, name)(1, loc, *a), donate_argnums=0
                )
                .lower(pool, jnp.arange(16), *args)
                .compile()
                .as_text()
            )
            assert not pool_sized_collectives(hlo), (kind, name, pool_sized_collectives(hlo))


def check_degrees(rng) -> None:
    """Blocks stored at TP 8 are misses at TP 4 (and on one device), never wrong data."""
    store = HostStore(1 << 24)
    tokens, slots = np.arange(32), np.arange(1, 33)
    tp8 = make("mha", NamedSharding(jax.make_mesh((8,), ("tp",)), HEADS))
    tp8 = tp8.set_kv(0, slots, *values(tp8, "set_kv", 32, rng))
    with KVConnector(tp8, store) as conn:  # the background writer takes shard records too
        assert conn.store_async(tp8, tokens, slots).result() == 2  # blocks, not records
        assert conn.stats()["records_stored"] == 16  # 2 blocks x 8 shards
        keys = conn.block_keys(tokens)  # the keys stored: 8 per block
        assert [len(k) for k in keys] == [8, 8] and len(store) == 16
        assert all(store.contains(k) for block in keys for k in block)
        tp8_fingerprint = conn.fingerprint
    devices = np.array(jax.devices()[:4])
    tp4 = make("mha", NamedSharding(jax.sharding.Mesh(devices, ("tp",)), HEADS))
    for other in (tp4, make("mha", None)):
        conn = KVConnector(other, store)
        assert conn.fingerprint != tp8_fingerprint  # no blocks shared
        assert conn.lookup(tokens) == 0
        before = testing.buffer_bits(other)
        other, n = conn.load(other, tokens, slots)
        assert n == 0
        testing.assert_unchanged(before, other)
    # A connector refuses a pool placed otherwise than the one it was made for.
    conn = KVConnector(tp8, store)
    try:
        conn.load(tp4, tokens, slots)
    except ValueError as err:
        assert "placed as the pool this connector was made for" in str(err), err
    else:
        raise AssertionError("a TP-4 pool was accepted by a TP-8 connector")


def single() -> None:
    assert len(jax.devices()) == 8
    rng = np.random.default_rng(0)
    meshes = [jax.make_mesh((8,), ("tp",)), jax.make_mesh((2, 4), ("dp", "tp"))]
    for mesh in meshes:
        for kind in SIZES:
            spec = HEADS if kind in ("mha", "konly") else P()
            check_kind(kind, mesh, spec, rng)
    check_degrees(rng)
    print("ok")


def worker() -> None:
    pid, port, folder, phase = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=120
    )
    from jax.experimental import multihost_utils

    try:
        assert jax.device_count() == 8 and jax.local_device_count() == 4
        sharding = NamedSharding(jax.make_mesh((8,), ("tp",)), HEADS)
        # Every process computes the same full values; each keeps its own heads.
        rng = np.random.default_rng(7)
        k = rng.standard_normal((64, 8, 16)).astype(np.float32)
        v = rng.standard_normal((64, 8, 8)).astype(np.float32)
        tokens, slots = np.arange(64), np.arange(1, 65)
        # Bytes of this process's shards of 4 blocks: 2 layers x 16 tokens x its 4 of the 8
        # heads x (16 + 8) K and V entries x 2 bytes, half of the pool's blocks.
        local_bytes = 4 * 2 * 16 * 4 * (16 + 8) * 2
        pool = make("mha", sharding, size=256)
        assert len(pool.k_buffer[0].addressable_shards) == 4
        conn = KVConnector(pool, DiskStore(folder))
        if phase == "store":
            replicated = NamedSharding(sharding.mesh, P())

            def whole(x):
                return jax.make_array_from_callback(x.shape, replicated, lambda i: x[i])

            put = jax.jit(lambda p, loc, k, v: p.set_kv(0, loc, k, v), donate_argnums=0)
            pool = put(pool, whole(slots.astype(np.int32)), whole(k), whole(v))
            stored = conn.store(pool, tokens, slots)
            assert stored == 4, stored  # blocks, whatever the shards
            assert conn.stats()["records_stored"] == 4 * 4  # this process's 4 shards of each
            assert conn.stats()["bytes_stored"] == local_bytes, conn.stats()
        else:
            counts = multihost_utils.process_allgather(np.int64(conn.lookup(tokens)))
            n = min_block_count(counts // conn.block_size) * conn.block_size
            assert n == 64, counts
            dest = np.arange(101, 165)
            pool, got = conn.load(pool, tokens[:n], dest[:n])
            assert got == n
            assert pool.k_buffer[0].sharding == sharding
            ref = make("mha", jax.local_devices()[0], size=256).set_kv(0, dest, k, v)
            for name in ("k_buffer", "v_buffer"):
                want = np.asarray(getattr(ref, name)[0])
                for shard in getattr(pool, name)[0].addressable_shards:
                    assert np.array_equal(np.asarray(shard.data), want[shard.index]), name
            assert conn.stats()["bytes_loaded"] == local_bytes, conn.stats()
        multihost_utils.sync_global_devices(f"jaxkv mesh test {phase}")
        print(f"ok {pid}", flush=True)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    single() if MODE == "single" else worker()
