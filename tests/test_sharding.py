"""Pools placed on a 4-device mesh (XLA's host-platform device count), run in a subprocess
because the device count is fixed when jax starts."""

import textwrap

from conftest import run_python

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, jaxkv
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxkv.connector import KVConnector, HostStore
    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    heads = NamedSharding(mesh, P(None, "tp", None))
    pool = jaxkv.MHAPool.create(size=64, head_num=8, head_dim=16, layer_num=2, sharding=heads)
    assert all(b.sharding == heads for b in pool.k_buffer + pool.v_buffer)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((16, 8, 16)), jnp.bfloat16)
    slots = np.arange(1, 17)
    pool = pool.set_kv(0, slots, k, k)                       # eager
    step = jax.jit(lambda p, l, k: p.set_kv(1, l, k, k), donate_argnums=0)
    pool = step(pool, jnp.asarray(slots), k)                  # jitted, donated
    assert all(b.sharding == heads for b in pool.k_buffer + pool.v_buffer)
    conn = KVConnector(pool, HostStore(1 << 20))
    exported = conn.export_blocks(pool, slots)
    assert exported["k"].shape == (1, 2, 16, 8, 16)           # full rows, whatever the sharding
    assert conn.store(pool, np.arange(16), slots) == 1
    pool, n = conn.load(pool, np.arange(16), np.arange(30, 46))
    assert n == 16
    assert all(b.sharding == heads for b in pool.k_buffer + pool.v_buffer)
    for layer in range(2):
        got = np.asarray(pool.k_buffer[layer])
        assert np.array_equal(got[30:46], got[1:17]), layer
        assert np.array_equal(got[1:17], np.asarray(k).view(np.uint16))
    print("ok")
    """
)


def test_head_sharded_pool_updates_and_round_trips_on_a_mesh():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = run_python("-c", SCRIPT, env=env, timeout=300)
    assert proc.stdout.strip().endswith("ok"), proc.stdout[-3000:]
