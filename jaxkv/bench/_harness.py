"""The timing harness every section uses: interleaved medians, readiness, the machine."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np

from jaxkv import __version__

_LOAD = hasattr(os, "getloadavg")  # not on Windows


def interleaved(
    cases: Mapping[str, Callable[[], object]], *, rounds: int, budget_s: float
) -> dict[str, float]:
    """Median seconds per case. The cases run alternately, one call each per round, so a slow
    moment of the machine hits all of them alike; `rounds` rounds, or fewer (at least 3) once
    `budget_s` has passed. Each case is called once before timing (compilation, first touch).
    """
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    start = time.perf_counter()
    for r in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return {name: float(np.median(ts)) for name, ts in times.items()}


def ready(x):
    """`x` once every array in it is computed (JAX dispatches asynchronously)."""
    jax.block_until_ready(x)
    return x


def ready_call(fn: Callable, *args) -> object:
    """`fn(*args)`, computed."""
    return ready(fn(*args))


def burst(call: Callable[[], object], reps: int) -> Callable[[], None]:
    """`call` made `reps` times back to back, then waited for once."""

    def run():
        out = None
        for _ in range(reps):
            out = call()
        ready(out)

    return run


def machine() -> dict:
    """What the figures were measured on, the load average at the start included (other jobs
    on the machine slow every contender, and memory-bound ones most)."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if _LOAD else None,
        "jax": jax.__version__,
        "numpy": np.__version__,
        "jaxkv": __version__,
        "devices": [str(d) for d in jax.devices()],
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
    }
