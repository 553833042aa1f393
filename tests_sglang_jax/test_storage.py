"""jaxkv's store under sglang-jax's HiCache (`jaxkv.integrations.sglang_jax.storage`).

Through sglang-jax's own tree, built as its scheduler builds one (`sgljax_trees`): a prefix
evicted from the device and from host memory is served from the store bit-exact, alone or
after a device or host hit; after a restart, a fresh process serves what the first stored; two
processes share blocks through a real Redis server; the hook reaches a process spawned the way
sglang-jax starts its scheduler. A failing, slow or lying store never raises into the
scheduler: its requests are recomputed, with no device slot leaked.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sgl_jax
import sgljax_trees as st
from sgl_jax.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from jaxkv.connector import BlockStore, DiskStore, HostStore
from jaxkv.integrations.sglang_jax import storage

HERE = Path(__file__).resolve().parent
# Long enough for any store read here: a match returns as soon as its prefetch ends.
PATIENT = 30.0


@pytest.fixture
def hook():
    """`install(settings)`, undone after the test; trees it built are closed."""
    trees = []

    def install(store: str, **settings):
        storage.install(storage.StoreSettings(store=store, **{"wait_s": PATIENT, **settings}))

    yield install, trees
    for t in trees:
        t.tree.jaxkv.close()
    storage.uninstall()


def _tree(trees, cfg, rng, **kw) -> st.Tree:
    t = st.build(cfg, rng, **kw)
    trees.append(t)
    return t


def _prompt(rng, n: int = 40) -> np.ndarray:
    return rng.integers(0, 50_000, size=n)


def _whole_blocks(t: st.Tree, n: int) -> int:
    bs = t.tree.jaxkv.block_size
    return n // bs * bs


@pytest.mark.parametrize(
    ("config", "store"),
    [
        ("mha-bf16-p4", "disk"),
        ("mha-f32-p1", "disk"),
        ("mla-bf16-p4", "disk"),
        ("mha-bf16-p4-tp2", "disk"),
        ("mha-bf16-p4", "host+disk"),
    ],
)
def test_evicted_prefix_is_served_from_the_store(hook, tmp_path, rng, config, store):
    install, trees = hook
    spec = {"disk": f"disk:{tmp_path}", "host+disk": f"host:{1 << 24},disk:{tmp_path}"}[store]
    install(spec)
    t = _tree(trees, st.CONFIGS[config], rng)
    assert isinstance(t.tree, storage.radix_cache_class())
    assert isinstance(t.tree, UnifiedRadixCache) and t.tree.hicache_enabled
    sharding = t.pool.kv_buffer[0].sharding
    tokens = _prompt(rng)
    want = st.rows(t, st.insert(t, tokens))
    st.evict_everything(t)

    prefix, match = st.serve(t, tokens)

    n = _whole_blocks(t, len(tokens))
    assert match.host_hit_length == n and len(match.device_indices) == 0
    assert len(prefix) == n
    np.testing.assert_array_equal(st.rows(t, prefix), want[:, :n])
    assert all(b.sharding == sharding for b in t.pool.kv_buffer)
    # The prefix is the tree's again, on the device: the next request hits it there.
    again, rematch = st.serve(t, tokens)
    np.testing.assert_array_equal(again, prefix)
    assert rematch.host_hit_length == 0
    stats = t.tree.jaxkv.stats()
    assert stats["loaded_tokens"] == n and stats["errors"] == 0
    assert st.balanced(t)


@pytest.mark.parametrize("first", ["device", "host"])
def test_store_blocks_extend_a_device_or_host_hit(hook, tmp_path, rng, first):
    # Page 1, blocks of 16: the first 20 tokens are held on the device (recomputed) or in host
    # memory, the rest only by the store; the store's block 16-32 overlaps them by 4 tokens.
    install, trees = hook
    install(f"disk:{tmp_path}")
    t = _tree(trees, st.CONFIGS["mha-f32-p1"], rng)
    tokens = _prompt(rng)
    head = tokens[:20]
    st.insert(t, head)
    want = st.rows(t, st.insert(t, tokens))  # reuses head's slots for its first 20 tokens
    st.settle(t)
    if first == "host":
        # From the device to host memory, then the tail's host copy out: head stays on host.
        t.tree.evict(st.EvictParams(num_tokens=t.cfg.size, dp_rank=0))
        t.tree.evict_host(len(tokens) - len(head))
    else:
        st.evict_everything(t)
        slots = st.insert(t, head)  # head recomputed: the device holds other slots for it
        want[:, :20] = st.rows(t, slots)

    prefix, match = st.serve(t, tokens)

    assert len(match.device_indices) == (20 if first == "device" else 0)
    assert match.host_hit_length == 32 - len(match.device_indices)
    assert len(prefix) == 32
    np.testing.assert_array_equal(st.rows(t, prefix), want[:, :32])
    assert t.tree.jaxkv.stats()["loaded_tokens"] == 12
    assert st.balanced(t)


def test_namespace_keeps_other_weights_apart(hook, tmp_path, rng):
    install, trees = hook
    install(f"disk:{tmp_path}")
    t = _tree(trees, st.CONFIGS["mha-bf16-p4"], rng)
    tokens = _prompt(rng)
    st.insert(t, tokens)
    st.evict_everything(t)
    other = _tree(trees, st.CONFIGS["mha-bf16-p4"], rng, model_path="test/other-weights")

    prefix, match = st.serve(other, tokens)

    assert len(prefix) == 0 and match.host_hit_length == 0
    assert other.tree.jaxkv.stats()["lookups"] == 1


def _env() -> dict[str, str]:
    source = str(Path(sgl_jax.__file__).resolve().parent.parent)
    paths = [source, str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _load_elsewhere(tmp_path, config: str, store: str, tokens) -> dict:
    """`sgljax_trees load` in a fresh interpreter: what it served from `store`."""
    np.save(tmp_path / "tokens.npy", tokens)
    out = tmp_path / "served.npz"
    run = subprocess.run(
        [sys.executable, "-m", "sgljax_trees", "load", config, store]
        + [str(tmp_path / "tokens.npy"), str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    with np.load(out) as served:
        return dict(served)


def test_restart_serves_what_the_last_process_stored(hook, tmp_path, rng):
    install, trees = hook
    store = f"disk:{tmp_path / 'blocks'}"
    install(store)
    t = _tree(trees, st.CONFIGS["mha-bf16-p4"], rng)
    tokens = _prompt(rng)
    want = st.rows(t, st.insert(t, tokens))
    st.settle(t)
    t.tree.jaxkv.close()

    served = _load_elsewhere(tmp_path, "mha-bf16-p4", store, tokens)

    assert served["hit"] == served["loaded"] == len(tokens)
    np.testing.assert_array_equal(served["rows"], want)


def test_two_processes_share_through_redis(hook, tmp_path, rng):
    install, trees = hook
    redis = st.local_redis().start()
    try:
        install(redis.url)
        t = _tree(trees, st.CONFIGS["mla-bf16-p4"], rng)
        tokens = _prompt(rng)
        want = st.rows(t, st.insert(t, tokens))
        st.settle(t)
        assert t.tree.jaxkv.stats()["writer"]["store"]["blocks"] == len(tokens) // 4

        served = _load_elsewhere(tmp_path, "mla-bf16-p4", redis.url, tokens)
    finally:
        redis.stop()

    assert served["hit"] == served["loaded"] == len(tokens)
    np.testing.assert_array_equal(served["rows"], want)


def test_hook_reaches_a_spawned_process(tmp_path):
    # The launcher, run as the program; its check spawns a process the way sglang-jax starts
    # its scheduler (multiprocessing's spawn) and reports from inside it.
    env = {**_env(), storage.ENV_STORE: f"disk:{tmp_path}"}
    run = subprocess.run(
        [sys.executable, "-m", "jaxkv.integrations.sglang_jax.serve", "--jaxkv-check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    line = run.stdout.strip().splitlines()[-1]
    assert "the hook is installed in process" in line and "DiskStore" in line, line
    child, parent = (int(w.rstrip(",")) for w in line.split() if w.rstrip(",").isdigit())
    assert child != parent


def test_install_wraps_and_uninstall_restores_the_factory(tmp_path):
    from sgl_jax.srt.mem_cache import registry

    own = registry.default_radix_cache_factory
    settings = storage.StoreSettings(store=f"disk:{tmp_path}")
    try:
        storage.install(settings)
        storage.install(settings)  # again: still one wrapper, over sglang-jax's own factory
        assert storage.installed() == settings
        assert registry.default_radix_cache_factory.original is own
    finally:
        storage.uninstall()
    assert registry.default_radix_cache_factory is own and storage.installed() is None


def test_install_can_put_hicaches_host_tier_on_jaxkv(tmp_path):
    from sgl_jax.srt.mem_cache import host_kv_pool

    import jaxkv.integrations.sglang_jax as integration

    own = host_kv_pool.LRUHostKVPool
    env = {storage.ENV_STORE: f"disk:{tmp_path}", storage.ENV_HOST_POOL: "jaxkv"}
    settings = storage.StoreSettings.from_env(env)
    assert settings.host_pool
    try:
        storage.install(settings)
        storage.install(settings)
        assert host_kv_pool.LRUHostKVPool is integration.LRUHostKVPool
    finally:
        storage.uninstall()
    assert host_kv_pool.LRUHostKVPool is own
    with pytest.raises(ValueError, match="JAXKV_SGLANG_JAX_HOST_POOL: expected 'jaxkv'"):
        storage.StoreSettings.from_env({**env, storage.ENV_HOST_POOL: "yes"})
    # The switch back to sglang-jax's own host pool.
    theirs = storage.StoreSettings.from_env({**env, storage.ENV_HOST_POOL: "sglang-jax"})
    assert not theirs.host_pool
    try:
        storage.install(theirs)
        assert host_kv_pool.LRUHostKVPool is own
    finally:
        storage.uninstall()


def test_the_hook_needs_hicache(hook, tmp_path, rng):
    install, trees = hook
    install(f"disk:{tmp_path}")
    with pytest.raises(ValueError, match="--hicache-storage: expected none"):
        st.build(st.CONFIGS["mha-bf16-p4"], rng, hicache_storage="disable")


# ---- failures -----------------------------------------------------------------------------


class BrokenStore(BlockStore):
    """Every call raises, as a store whose backend is gone may."""

    def __init__(self, error: type[Exception]):
        super().__init__()
        self.error = error

    def _raise(self, *args, **kwargs):
        raise self.error("store unavailable")

    contains = get = put = contains_many = get_many = put_many = _raise

    def __len__(self) -> int:
        return 0


class SlowStore(BlockStore):
    """`inner`, whose reads take `delay_s` each."""

    def __init__(self, inner: BlockStore, delay_s: float):
        super().__init__()
        self.inner, self.delay_s = inner, delay_s

    def contains(self, key):
        return self.inner.contains(key)

    def get(self, key):
        time.sleep(self.delay_s)
        return self.inner.get(key)

    def get_many(self, keys, *, stop_at_miss=False, strict=None):
        time.sleep(self.delay_s)
        return self.inner.get_many(keys, stop_at_miss=stop_at_miss, strict=strict)

    def put(self, record):
        return self.inner.put(record)

    def __len__(self) -> int:
        return len(self.inner)


class LyingStore(SlowStore):
    """`inner`, answering every read with its record's token digest damaged: a record that
    names its key but holds another block."""

    def __init__(self, inner: BlockStore):
        super().__init__(inner, 0.0)

    def get_many(self, keys, *, stop_at_miss=False, strict=None):
        got = self.inner.get_many(keys, stop_at_miss=stop_at_miss, strict=strict)
        lies = [r and dataclasses.replace(r, tokens=bytes(len(r.tokens))) for r in got.values]
        return dataclasses.replace(got, values=lies)


def _recomputed(t: st.Tree, tokens) -> None:
    """The request is served nothing from the store, and its recomputed KV is cached."""
    prefix, _ = st.serve(t, tokens)
    assert len(prefix) == 0
    assert st.balanced(t)
    st.insert(t, tokens)
    again, _ = st.serve(t, tokens)
    assert len(again) == _whole_blocks(t, len(tokens))


@pytest.mark.parametrize("error", [OSError, RuntimeError])
def test_a_failing_store_never_raises_into_the_scheduler(hook, rng, error):
    _, trees = hook
    tier = {"wait_s": PATIENT}
    t = _tree(trees, st.CONFIGS["mha-bf16-p4"], rng, store=BrokenStore(error), tier=tier)
    tokens = _prompt(rng)
    st.insert(t, tokens)  # HiCache's backup writes to the store, which fails
    st.evict_everything(t)

    _, match = st.serve(t, tokens)
    assert match.host_hit_length == 0
    _recomputed(t, tokens)

    assert t.tree.jaxkv.stats()["errors"] > 0


def test_a_slow_store_is_waited_for_at_most_wait_s(hook, tmp_path, rng):
    _, trees = hook
    store = SlowStore(DiskStore(tmp_path), delay_s=1.0)
    t = _tree(trees, st.CONFIGS["mha-bf16-p4"], rng, store=store, tier={"wait_s": 0.05})
    tokens = _prompt(rng)
    want = st.rows(t, st.insert(t, tokens))
    st.evict_everything(t)

    began = time.monotonic()
    prefix, match = st.serve(t, tokens)
    took = time.monotonic() - began

    assert took < 0.5, f"the match waited {took:.2f} s for a store read of 1 s"
    assert len(prefix) == 0 and match.host_hit_length == 0  # recomputed
    assert st.balanced(t)
    # The read went on in the background: once it is done, a later round loads its blocks.
    time.sleep(1.5)
    prefix, _ = st.serve(t, tokens)
    assert len(prefix) == len(tokens)
    np.testing.assert_array_equal(st.rows(t, prefix), want)
    assert 0 < t.tree.jaxkv.stats()["waited_s"] < 0.2


def test_a_damaged_record_is_recomputed_not_loaded(hook, rng):
    _, trees = hook
    store = LyingStore(HostStore(1 << 24))
    t = _tree(trees, st.CONFIGS["mha-bf16-p4"], rng, store=store, tier={"wait_s": PATIENT})
    tokens = _prompt(rng)
    st.insert(t, tokens)
    st.evict_everything(t)

    _recomputed(t, tokens)

    stats = t.tree.jaxkv.stats()
    assert stats["hits"] >= 1 and stats["loads"] == 0
    assert stats["reader"]["verification_failures"] >= 1


# ---- settings -----------------------------------------------------------------------------


def test_settings_from_the_environment(tmp_path):
    env = {
        storage.ENV_STORE: f"host:{1 << 20},disk:{tmp_path}",
        storage.ENV_NAMESPACE: "my-model@abc123",
        storage.ENV_WAIT_MS: "5",
        storage.ENV_PREFETCH_MB: "64",
    }
    settings = storage.StoreSettings.from_env(env)
    assert settings == storage.StoreSettings(
        store=env[storage.ENV_STORE],
        namespace="my-model@abc123",
        wait_s=0.005,
        prefetch_bytes=64 << 20,
    )
    defaults = storage.StoreSettings.from_env({storage.ENV_STORE: f"disk:{tmp_path}"})
    assert defaults.namespace is None and defaults.wait_s == 1.0
    assert defaults.prefetch_bytes == 256 << 20
    assert defaults.host_pool and storage.StoreSettings(store=f"disk:{tmp_path}").host_pool


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "JAXKV_SGLANG_JAX_STORE: expected a store spec.*got nothing"),
        ({storage.ENV_STORE: "ftp://x"}, "JAXKV_SGLANG_JAX_STORE: expected.*got 'ftp://x'"),
        ({storage.ENV_STORE: "host:0"}, "got 'host:0'"),
        ({storage.ENV_STORE: "disk:/x,host:"}, "got 'host:' in 'disk:/x,host:'"),
        ({storage.ENV_STORE: "disk:/x", storage.ENV_WAIT_MS: "-1"}, "WAIT_MS: expected a num"),
        ({storage.ENV_STORE: "disk:/x", storage.ENV_PREFETCH_MB: "0"}, "PREFETCH_MB: expected"),
        ({storage.ENV_STORE: "disk:/x", storage.ENV_WAIT_MS: "soon"}, "got 'soon'"),
    ],
)
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        storage.StoreSettings.from_env(env)


def test_the_tier_refuses_trees_it_cannot_store(hook, rng):
    _, trees = hook
    t = _tree(trees, st.CONFIGS["mha-bf16-p4"], rng, store=HostStore(1 << 20))
    cls = type(t.tree)
    with pytest.raises(ValueError, match="wait_s: expected a number of seconds"):
        cls.from_tree(t.tree, store=HostStore(1 << 20), wait_s=-1)
    t.tree.is_eagle = True  # from_tree reads the constructor's arguments back from the tree
    with pytest.raises(ValueError, match="is_eagle: expected False"):
        cls.from_tree(t.tree, store=HostStore(1 << 20))
    with pytest.raises(TypeError, match="store: expected a BlockStore, got str"):
        cls.from_tree(t.tree, store="disk:/x")
