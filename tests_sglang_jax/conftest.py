"""jaxkv against sglang-jax's own pools (sgl-project/sglang-jax at commit cddbf6f, on the CPU).

sglang-jax is not installed: its source is put on `sys.path` from `SGLANG_JAX_SRC` (default:
`../shared/peers/sglang-jax/python` next to the repository root), and the packages its
modules import come from `.ci/sglang-jax-requirements.txt`; `.ci/sglang_jax_step.sh` builds
that environment and runs this folder. A missing source or package fails the run; nothing
here skips.

Two settings have to be made before jax creates its CPU client, so they are made here, first:

* two CPU devices (`--xla_force_host_platform_device_count=2`, added to `XLA_FLAGS` unless a
  device count is already there), for the pool whose heads are split over a tensor-parallel
  mesh of two devices;
* sglang-jax's own CPU test shim: its mem_cache tests' conftest replaces the TPU-only fused
  write kernel with a pure-JAX scatter when the backend is not a TPU, at import time. It is
  imported from sglang-jax's source (never copied), so the pools here are written by the code
  sglang-jax's own tests write them with.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_COUNT_FLAG}=2").strip()

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO_ROOT / ".." / "shared" / "peers" / "sglang-jax" / "python"
SOURCE = Path(os.environ.get("SGLANG_JAX_SRC") or DEFAULT_SOURCE).resolve()
if not (SOURCE / "sgl_jax" / "srt" / "mem_cache" / "memory_pool.py").is_file():
    raise RuntimeError(
        f"SGLANG_JAX_SRC: expected the python/ folder of sglang-jax at commit cddbf6f (holding "
        f"sgl_jax/srt/mem_cache/memory_pool.py), got {SOURCE}; set SGLANG_JAX_SRC to it"
    )
if str(SOURCE) not in sys.path:
    sys.path.insert(0, str(SOURCE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# sglang-jax's CPU shim, applied by importing its mem_cache tests' conftest as a module.
import sgl_jax.test.mem_cache.conftest as sglang_jax_cpu_shim  # noqa: E402, F401
import sgljax_pools  # noqa: E402
from sgl_jax.srt.mem_cache import memory_pool  # noqa: E402


def pytest_configure(config):
    # Checked once the session starts: a backend set up before this file ran (a plugin that
    # created jax's devices) fails the run rather than leaving a pool unbuilt.
    if jax.default_backend() != "tpu" and (
        memory_pool.update_fused_kv_cache_vectorized
        is not sglang_jax_cpu_shim._cpu_fused_kv_scatter
    ):
        raise pytest.UsageError("sglang-jax's CPU write shim is not in place")
    sgljax_pools.devices(2)  # raises, naming XLA_FLAGS, when the two CPU devices are missing


@pytest.fixture
def rng(request):
    # One stream per test (named by the test), so a test's data does not depend on which
    # others ran; crc32, not `hash`, which Python salts per process.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
