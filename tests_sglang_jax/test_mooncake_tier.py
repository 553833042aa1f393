"""jaxkv's store tier under sglang-jax's HiCache on Mooncake
(`JAXKV_SGLANG_JAX_STORE=mooncake://HOST:PORT?metadata=URL`), against a real `mooncake_master`
and a standalone segment holder (`mooncake_client`) on loopback ports.

A prefix stored through sglang-jax's tree by this process is served bit-exact to a fresh
process, after this process's store closed: the blocks live in the holder's segment, which
outlives the serving process (this one lends no memory: `segment_bytes` is 0 by default). The
spec names `MooncakeStore`'s keywords in its query, and a tiered spec puts host memory before
it. Without Mooncake installed the tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sgl_jax
import sgljax_trees as st

from jaxkv.connector import HostStore, MooncakeStore, TieredStore
from jaxkv.integrations.sglang_jax import storage
from jaxkv.integrations.sglang_jax._store_settings import open_store

HERE = Path(__file__).resolve().parent


def _mooncake_server():
    """jaxkv's test helper for a throwaway Mooncake cluster (tests/mooncake_server.py), loaded
    from its file: `tests/` is not on this folder's path."""
    path = HERE.parent / "tests" / "mooncake_server.py"
    spec = importlib.util.spec_from_file_location("mooncake_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cluster():
    server = _mooncake_server()
    if not server.LocalMooncake.available():
        if os.environ.get("CI"):
            pytest.fail(f"CI needs the Mooncake tier tests: {server.MISSING}")
        pytest.skip(server.MISSING)
    with server.LocalMooncake() as mc:
        mc.holder(64 << 20)
        yield mc


@pytest.fixture
def hook():
    trees: list[st.Tree] = []

    def install(store: str) -> None:
        storage.install(storage.StoreSettings(store=store, wait_s=30.0))

    yield install, trees
    for t in trees:
        t.tree.jaxkv.close()
    storage.uninstall()


def _env() -> dict[str, str]:
    source = str(Path(sgl_jax.__file__).resolve().parent.parent)
    paths = [source, str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def test_a_prefix_stored_on_mooncake_is_served_to_another_process_bit_exact(
    cluster, hook, tmp_path, rng
):
    install, trees = hook
    install(cluster.spec)
    t = st.build(st.CONFIGS["mha-bf16-p4"], rng)
    trees.append(t)
    tokens = rng.integers(0, 50_000, size=40)
    want = st.rows(t, st.insert(t, tokens))
    st.settle(t)
    assert t.tree.jaxkv.stats()["errors"] == 0
    t.tree.jaxkv.close()  # this process's client is gone: the holder keeps the blocks

    np.save(tmp_path / "tokens.npy", tokens)
    out = tmp_path / "served.npz"
    run = subprocess.run(
        [sys.executable, "-m", "sgljax_trees", "load", "mha-bf16-p4", cluster.spec]
        + [str(tmp_path / "tokens.npy"), str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    with np.load(out) as served:
        assert served["hit"] == served["loaded"] == len(tokens)
        np.testing.assert_array_equal(served["rows"], want)


def test_the_spec_names_the_stores_keywords_and_tiers_host_memory_before_it(cluster):
    spec = f"{cluster.spec}&protocol=tcp&buffer_bytes={2 << 20}&segment_bytes=0"
    store = open_store(spec)
    try:
        assert isinstance(store, MooncakeStore)
        assert (store.master, store.metadata, store.protocol) == (
            cluster.master,
            cluster.metadata,
            "tcp",
        )
        assert (store.buffer_bytes, store.segment_bytes) == (2 << 20, 0)
    finally:
        store.close()
    stack = open_store(f"host:{1 << 20}, {cluster.spec}")
    try:
        assert isinstance(stack, TieredStore)
        assert [type(s) for s in stack.tiers] == [HostStore, MooncakeStore]
    finally:
        stack.tiers[1].close()


@pytest.mark.parametrize(
    "spec,message",
    [
        ("mooncake://127.0.0.1:50051", "got no metadata"),
        ("mooncake://127.0.0.1:50051?metadata=http://m/x&color=red", "got color='red'"),
        ("mooncake://127.0.0.1:50051?metadata=http://m/x&segment_bytes=1e9", "segment_bytes"),
        ("mooncake://127.0.0.1?metadata=http://m/x", "got .mooncake://127.0.0.1.metadata"),
    ],
)
def test_a_malformed_mooncake_spec_names_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=f"JAXKV_SGLANG_JAX_STORE: expected.*{message}"):
        storage.StoreSettings.from_env({storage.ENV_STORE: f"host:1,{spec}"})


def test_a_redis_cluster_spec_is_a_redis_store():
    spec = "redis+cluster://127.0.0.1:7000?nodes=127.0.0.1:7001;127.0.0.1:7002"
    assert storage.StoreSettings.from_env({storage.ENV_STORE: spec}).store == spec
