"""Fixtures and pytest hooks of the suite, and the compilation settings every test runs with.

The helpers the tests share (pool factories, dtype tables, numpy references, the runner of fresh
Python processes) are in `helpers.py`, imported as `from helpers import ...`.
"""

from __future__ import annotations

import gc
import os

# Nothing in the suite is timed, and LLVM's optimisation passes took over a third of its CPU
# time (tests/test_models.py and pools/test_packed_fp8.py: 80 s of CPU with them, 51 s without): the
# suite compiles without them, here and in the Python processes it starts. XLA:CPU keeps IEEE
# semantics at every level (it does not enable fast math), so the bits tested are the bits
# served; XLA's own graph rewrites (the ones that change arithmetic) still run. The suite also
# emits fused kernels with XLA:CPU's classic LLVM IR emitters instead of its newer MLIR fusion
# emitters, which took a third more CPU (tests/test_serving, test_models, test_docs, test_cli
# and pools/test_dtypes: 63 s of CPU with them, 48 s without). Both lower the same optimised HLO,
# and both give IEEE results for the casts, divisions and integer work behind the bits the
# pool tests check; transcendental functions (the models' exp and rsqrt) may differ in their
# last bits, which the model tests' bounds cover. Set JAXKV_TEST_OPTIMIZE=1 to compile as
# users do (CI runs the bit-exact pool, division and fp8 tests that way too).
if os.environ.get("JAXKV_TEST_OPTIMIZE") != "1":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    ).strip()

# One compilation cache for the whole run, shared by the xdist workers and the Python
# processes the tests start (they inherit the environment): the same small decoder, pools and
# kernels are compiled in several files and subprocesses, and XLA keys each executable by its
# program and options, so a cached one is the one a fresh compile would give.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _CACHE = tempfile.mkdtemp(prefix="jaxkv-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

import jax  # noqa: E402
import numpy as np
import pytest
from helpers import ALL_DTYPES, POOL_KINDS, SETTERS  # noqa: E402
from hypothesis import settings

# Hypothesis examples per property test: "lean" (the default) keeps the whole suite within a
# few minutes on 2 cores, the properties' explicit edge cases being tested on their own;
# `--hypothesis-profile=thorough` runs twenty times as many (fuzzers that set their own
# counts scale with the profile). Fewer than the 20 first used keep the default run within its
# 3 minutes on the 2-core machine (it took 203 s at 20, 195 s at 12).
settings.register_profile("lean", max_examples=10)
settings.register_profile("thorough", max_examples=200)
settings.load_profile("lean")


@pytest.fixture(scope="session", params=ALL_DTYPES, ids=lambda d: d.name)
def pool_dtype(request) -> np.dtype:
    """Every supported logical pool dtype."""
    return request.param


@pytest.fixture(scope="session", params=POOL_KINDS)
def pool_kind(request) -> str:
    """Every pool kind."""
    return request.param


def pytest_generate_tests(metafunc):
    """`pool_setter`: every (pool kind, setter name) pair, e.g. ("nsa", "set_index_k")."""
    if "pool_setter" in metafunc.fixturenames:
        pairs = [(kind, name) for kind, setters in SETTERS.items() for name in setters]
        metafunc.parametrize("pool_setter", pairs, ids=[f"{k}-{n}" for k, n in pairs])


@pytest.fixture(scope="session")
def device_sharding():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops the programs a test file compiled once it is done: each worker otherwise holds
    every executable of every file it ran (2.5 GB by the end). Files that compile the same
    programs get them back from the run's shared compilation cache."""
    yield
    jax.clear_caches()
    gc.collect()
