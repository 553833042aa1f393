"""pytest plugin (`-p hicache_on_jaxkv`): sglang-jax's own HiCache tests on jaxkv's host pool.

Run with sglang-jax's `test_host_kv_pool.py`, `test_hicache_controller.py` and
`test_hicache_e2e.py` (and this folder on `PYTHONPATH`). `pytest_configure` replaces
`sgl_jax.srt.mem_cache.host_kv_pool.LRUHostKVPool` with `jaxkv.integrations.sglang_jax`'s, before
pytest imports the test modules: they import the class at module level, and sglang-jax's
`init_hicache` imports it when called, so both get jaxkv's.

The tests in `WHITE_BOX` are deselected: each patches or reads private state of sglang-jax's
own implementation, which jaxkv's class does not have (jaxkv's `test_host_pool.py` covers the
same behaviours through public methods). The run fails, rather than passing quietly, when:

- one of them is missing from a file collected whole (renamed upstream: the list is stale);
- a collected test module holds an `LRUHostKVPool` other than jaxkv's (imported before the
  swap, so it would test sglang-jax's class).
"""

from __future__ import annotations

import pytest

# Node ids (file name, class, test) and the private state each one patches or reads.
WHITE_BOX = {
    "test_host_kv_pool.py::TestLRUHostKVPoolBoundaryInvariants::"
    "test_lru_copy_from_device_not_implemented": "reads _device_pool (its kv_buffer)",
    "test_host_kv_pool.py::TestLRUHostKVPoolBoundaryInvariants::"
    "test_stage_backup_rejects_out_of_range_device_page": "reads _device_pool (its kv_buffer)",
    "test_host_kv_pool.py::TestLRUHostKVPoolBucketPadding::"
    "test_three_page_roundtrip_bit_exact": "reads _pad_to_page_bucket",
    "test_host_kv_pool.py::TestLRUHostKVPoolABA::"
    "test_stage_backup_drops_gather_when_slot_reused_midflight": "patches _jit_gather_one_layer, "
    "reads _pending_gather",
    "test_host_kv_pool.py::TestLRUHostKVPoolABA::test_flush_backup_rejects_stale_epoch": (
        "patches _pending_gather, reads _slots"
    ),
    "test_host_kv_pool.py::TestLRUHostKVPoolABA::test_flush_load_skips_stale_epoch": (
        "patches _pending_load"
    ),
}

_deselected: list[str] = []


def _pools():
    from sgl_jax.srt.mem_cache import host_kv_pool

    from jaxkv.integrations.sglang_jax import LRUHostKVPool

    return host_kv_pool, LRUHostKVPool


def pytest_configure(config):
    host_kv_pool, ours = _pools()
    host_kv_pool.LRUHostKVPool = ours


def _short_id(item) -> str:
    return "::".join([item.path.name, *item.nodeid.split("::")[1:]])


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect: the check sees whole files
def pytest_collection_modifyitems(config, items):
    host_kv_pool, ours = _pools()
    if host_kv_pool.LRUHostKVPool is not ours:
        raise pytest.UsageError("hicache_on_jaxkv: sglang-jax's LRUHostKVPool is not jaxkv's")
    for module in {item.module for item in items if getattr(item, "module", None)}:
        held = getattr(module, "LRUHostKVPool", ours)
        if held is not ours:
            raise pytest.UsageError(
                f"hicache_on_jaxkv: {module.__name__} imported sglang-jax's LRUHostKVPool "
                f"before the plugin replaced it (load the plugin with -p)"
            )
    by_id = {_short_id(item): item for item in items}
    whole_files = not any("::" in arg for arg in config.args)
    collected = {item.path.name for item in items}
    missing = [node for node in WHITE_BOX if node not in by_id and node.split("::")[0] in collected]
    if whole_files and missing:
        raise pytest.UsageError(
            f"hicache_on_jaxkv: white-box tests to deselect are not there (renamed upstream? "
            f"update WHITE_BOX): {missing}"
        )
    chosen = [by_id[node] for node in WHITE_BOX if node in by_id]
    if chosen:
        config.hook.pytest_deselected(items=chosen)
        items[:] = [item for item in items if item not in chosen]
        _deselected.extend(item.nodeid for item in chosen)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"hicache_on_jaxkv: sglang-jax's LRUHostKVPool is jaxkv's; {len(_deselected)} white-box "
        f"test(s) of its own implementation deselected"
    )
