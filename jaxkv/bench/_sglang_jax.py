"""sglang-jax's HiCache host tier: its own `LRUHostKVPool` and jaxkv's, side by side.

Both pools run the same stream on the same sglang-jax device pool (an `MHATokenToKVPool`, bf16,
as its model runner builds one): back `pages` pages up to host memory (`alloc`, `stage_backup`,
`flush_backup`) and load them back into other device pages (`stage_load`, `flush_load`), then
free the host pages. The figures are GB/s of KV moved each way, beside a numpy copy of the same
bytes between two host buffers (the host's memcpy floor).

Runs only where sglang-jax imports: its source (commit cddbf6f) on `PYTHONPATH` and the
packages its memory-cache modules import (`.ci/sglang-jax-requirements.txt`). Off a TPU, the
pool's fused write kernel is TPU-only, so its own tests' CPU shim (a pure-JAX scatter in
`sgl_jax/test/mem_cache/conftest.py`) is imported first, as its CPU tests do.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxkv.bench._harness import interleaved
from jaxkv.bench._report import print_table
from jaxkv.bench._section import Section, Setting
from jaxkv.bench._targets import Measured

LAYERS, HEADS, HEAD_DIM = 4, 8, 128


def _shape(setting: Setting) -> tuple[int, int, int]:
    """(page size, pages per transfer, timing rounds)."""
    if setting.sizes.name == "tiny":
        return 4, 4, 3
    if setting.sizes.quick:
        return 16, 64, 7
    return 16, 256, 15


def _sglang_jax():
    """(memory_pool module, sglang-jax's LRUHostKVPool, mesh maker) or (None, why)."""
    try:
        if jax.default_backend() != "tpu":
            import sgl_jax.test.mem_cache.conftest  # noqa: F401  (installs the CPU write shim)
        from sgl_jax.srt.mem_cache import memory_pool
        from sgl_jax.srt.mem_cache.host_kv_pool import LRUHostKVPool
        from sgl_jax.srt.utils.mesh_utils import create_device_mesh
    except Exception as err:  # not on the path, or a dependency missing
        return None, f"sglang-jax does not import here ({type(err).__name__}: {err})"
    return (memory_pool, LRUHostKVPool, create_device_mesh), None


def _stream(pool_cls, device_pool, mesh, page: int, n: int):
    """One round: back up device pages 1..n, load them into pages n+1..2n, free."""
    shape = tuple(int(d) for d in device_pool.kv_buffer[0].shape[1:])
    host = pool_cls(
        device_pool=device_pool,
        pool_size=n,
        page_size=page,
        layer_num=LAYERS,
        per_layer_shape=shape,
        dtype=device_pool.dtype,
        mesh=mesh,
        partition_spec=device_pool.kv_sharding.spec,
    )
    src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))

    def backup():
        ids = [int(i) for i in host.alloc(n)]
        host.stage_backup(src, ids)
        host.flush_backup(ids)
        return ids

    def load(ids):
        host.stage_load(ids)
        host.flush_load(ids, dst)
        jax.block_until_ready(device_pool.kv_buffer)
        host.free(ids)

    return backup, load


def measure(setting: Setting) -> dict:
    mods, why = _sglang_jax()
    if mods is None:
        return {"skipped": why, "rows": []}
    memory_pool, theirs, create_device_mesh = mods
    from jaxkv.integrations.sglang_jax import LRUHostKVPool as ours

    page, n, rounds = _shape(setting)
    mesh = create_device_mesh(
        ici_parallelism=[1, 1],
        dcn_parallelism=[1, 1],
        devices=jax.devices()[:1],
        use_explicit_sharding=True,
    )
    device_pool = memory_pool.MHATokenToKVPool(
        size=(2 * n + 1) * page,
        page_size=page,
        dtype=jax.numpy.bfloat16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        mesh=mesh,
    )
    nbytes = LAYERS * n * int(np.prod(device_pool.kv_buffer[0].shape[1:])) * 2
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    streams = {
        name: _stream(cls, device_pool, mesh, page, n)
        for name, cls in (("sglang-jax", theirs), ("jaxkv", ours))
    }
    held: dict[str, Any] = {}

    def case(name, which):
        backup, load = streams[name]
        if which == "backup":
            return lambda: held.__setitem__(name, backup())
        return lambda: load(held.pop(name))

    # Backups and loads alternate per contender, so every load has its backup's pages.
    cases = {}
    for name in streams:
        cases[f"{name} backup"] = case(name, "backup")
        cases[f"{name} load"] = case(name, "load")
    cases["memcpy"] = lambda: np.copyto(dst, src)
    times = interleaved(cases, rounds=rounds, budget_s=30.0 if setting.sizes.quick else 120.0)
    row: dict[str, Any] = {"pages": n, "page_size": page, "MiB": nbytes / 2**20}
    for key, s in times.items():
        row[f"{key} GB/s"] = nbytes / s / 1e9
    for way in ("backup", "load"):
        row[f"jaxkv/sglang-jax {way}"] = times[f"sglang-jax {way}"] / times[f"jaxkv {way}"]
        row[f"jaxkv/memcpy {way}"] = times["memcpy"] / times[f"jaxkv {way}"]
    return {"skipped": None, "rows": [row]}


def targets(res: dict, setting: Setting) -> list[Measured]:
    if res["skipped"]:
        return []
    row = res["rows"][0]
    out = []
    for way in ("backup", "load"):
        out.append(
            Measured(
                f"sglang_jax.host.{way}",
                f"HiCache host pool {way}, {row['pages']} pages of {row['page_size']}: "
                "sglang-jax's time / jaxkv's",
                row[f"jaxkv/sglang-jax {way}"],
            )
        )
        if not setting.accel:
            out.append(
                Measured(
                    f"sglang_jax.host.{way}.memcpy",
                    f"HiCache host pool {way} on CPU: jaxkv's rate / a memcpy of the same bytes",
                    row[f"jaxkv/memcpy {way}"],
                )
            )
    return out


def report(res: dict, setting: Setting) -> None:
    if res["skipped"]:
        print(
            f"\nsglang-jax host pool rows skipped: {res['skipped']}; put sglang-jax's python/ "
            "folder on PYTHONPATH with the packages of .ci/sglang-jax-requirements.txt to compare"
        )
        return
    cols = [("pages", "pages", "d"), ("page_size", "page", "d"), ("MiB", "MiB", ".1f")]
    for key in ("sglang-jax backup", "jaxkv backup", "sglang-jax load", "jaxkv load", "memcpy"):
        cols.append((f"{key} GB/s", f"{key} GB/s", ".2f"))
    cols += [(k, k, ".2f") for k in ("jaxkv/sglang-jax backup", "jaxkv/sglang-jax load")]
    print_table(
        f"sglang-jax HiCache host pool (MHA bf16, {LAYERS} layers, {HEADS}x{HEAD_DIM}): back up "
        "and load back the same pages, GB/s",
        res["rows"],
        cols,
    )


SECTION = Section("sglang_jax", measure, report, targets)
