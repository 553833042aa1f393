"""Pools placed on a 4-device mesh (XLA's host-platform device count), run in a subprocess
because the device count is fixed when jax starts."""

import textwrap

import pytest
from helpers import run_python

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
    assert conn.store(pool, np.arange(16), slots) == 1             # blocks, not records
    assert conn.stats()["records_stored"] == 4                     # one record per shard
    assert conn.store(pool, np.arange(16), slots) == 0             # stored already
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


RULES = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, jaxkv
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()), ("tp",))

    def refused(make, *words):
        try:
            make()
        except ValueError as err:
            assert str(err).startswith("sharding: expected"), err
            assert all(w in str(err) for w in words), (words, err)
        else:
            raise AssertionError(f"accepted: {words}")

    heads = NamedSharding(mesh, P(None, "tp", None))
    latent = dict(size=64, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=1)
    # Heads must divide over the mesh axis; the error names head_num, expected and got.
    refused(lambda: jaxkv.MHAPool.create(size=64, head_num=6, head_dim=16, layer_num=1,
                                         sharding=heads),
            "head_num divisible by the 4", "got head_num=6")
    # The token axis is never split, whatever the kind; the error says what to do instead.
    for kind, sizes in ((jaxkv.KOnlyPool, dict(size=64, head_num=8, head_dim=16, layer_num=1)),
                        (jaxkv.MLAPool, latent)):
        refused(lambda: kind.create(**sizes, sharding=NamedSharding(mesh, P("tp"))),
                "token axis", "shard heads instead")
    # Latent rows are replicated: splitting any of their axes is refused.
    refused(lambda: jaxkv.MLAPool.create(**latent, sharding=heads), "replicated")
    refused(lambda: jaxkv.NSAPool.create(**latent, page_size=16, index_head_dim=16,
                                         sharding=NamedSharding(mesh, P(None, None, "tp"))),
            "replicated")
    refused(lambda: jaxkv.MHAPool.create(size=64, head_num=8, head_dim=16, layer_num=1,
                                         sharding=NamedSharding(mesh, P(None, None, "tp"))),
            "only its heads axis")
    # Replicated latent pools work, and NSA's 2-d indexer buffer follows a 3-entry spec.
    for spec in (P(), P(None, None, None)):
        rep = NamedSharding(mesh, spec)
        nsa = jaxkv.NSAPool.create(**latent, page_size=16, index_head_dim=16, sharding=rep)
        for b in nsa.kv_buffer + nsa.index_k_with_scale_buffer:
            assert b.sharding.is_fully_replicated and len(b.sharding.device_set) == 4
        idx = np.arange(1, 17)
        nsa = nsa.set_index_k(0, idx, jnp.ones((16, 16)))
        assert np.allclose(np.asarray(nsa.get_index_k(0, idx)), 1.0, rtol=1e-2)
    # A mesh axis of one device splits nothing, so it is no split of the token axis.
    one = Mesh(np.array(jax.devices()[:1]), ("dp",))
    jaxkv.MLAPool.create(**latent, sharding=NamedSharding(one, P("dp")))
    print("ok")
    """
)


# Both scripts run in one child (a fresh interpreter that imports jax costs seconds): each in
# its own namespace, reporting "<name>: ok" or its traceback, so one failing spares the other.
RUNNER = textwrap.dedent(
    """
    import sys, traceback
    for name, code in SCRIPTS.items():
        try:
            exec(compile(code, name, "exec"), {"__name__": name})
        except BaseException:
            print(f"{name}: failed")
            traceback.print_exc(file=sys.stdout)
        else:
            print(f"{name}: ok")
    """
)


@pytest.fixture(scope="module")
def child_output() -> str:
    scripts = {"SCRIPT": SCRIPT, "RULES": RULES}
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = run_python("-c", f"SCRIPTS = {scripts!r}\n{RUNNER}", env=env, timeout=300)
    return proc.stdout


def _check(output: str, name: str) -> None:
    assert f"{name}: ok" in output.splitlines(), output[-3000:]


def test_head_sharded_pool_updates_and_round_trips_on_a_mesh(child_output):
    _check(child_output, "SCRIPT")


def test_create_checks_each_buffer_against_its_sharding_rule(child_output):
    _check(child_output, "RULES")
