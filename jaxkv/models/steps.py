"""Compiled steps and shape buckets: a decoder step compiled ahead of time per padded shape.

Padding shapes to buckets keeps the number of programs small as requests come and go; compiling
explicitly keeps compilation out of every timed region and makes it countable.
"""

from __future__ import annotations

import collections
import time

import jax
import numpy as np

from jaxkv.connector.transfer import CompileCache
from jaxkv.models.decoder import Decoder

__all__ = ["CompiledSteps", "bucket", "steps_for"]


def bucket(n: int, *, minimum: int = 16, step: int = 256) -> int:
    """The padded size for `n`: a power of two up to `step`, then a multiple of `step`.

    Powers of two keep short shapes few; past `step` they would waste up to half the work, so
    long shapes grow in steps instead.
    """
    if n <= step:
        return max(minimum, 1 << max(0, n - 1).bit_length())
    return -(-n // step) * step


class CompiledSteps:
    """`Decoder.step` compiled ahead of time per shape, with the pool donated.

    Compiling explicitly (rather than on first call) keeps compilation out of every timed
    region and makes it countable: `traces` counts how often the step was traced, per kind
    ("prefill" or "decode"), and `compile_seconds` sums the time spent compiling each shape
    and running it once on padding.
    """

    def __init__(self, model: Decoder):
        self.model = model
        self.traces: collections.Counter[str] = collections.Counter()
        self.compile_seconds = 0.0
        self._compiled: dict = {}

        def step(params, pool, table, rows, tokens, start, n_new, loc, *, ctx):
            self.traces["decode" if tokens.shape[1] == 1 else "prefill"] += 1
            return model.step(params, pool, table, rows, tokens, start, n_new, loc, ctx=ctx)

        self._jit = jax.jit(step, donate_argnums=1, static_argnames="ctx")

    def __call__(self, params, pool, table, rows, tokens, start, n_new, loc, *, ctx: int):
        args = (params, pool, table, rows, tokens, start, n_new, loc)
        key = (jax.tree_util.tree_structure(pool), table.shape, tokens.shape, ctx)
        exe = self._compiled.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe = self._jit.lower(*args, ctx=ctx).compile()
            # XLA:CPU finishes setting an executable up on its first run, which would land in
            # the first request's time. Run it once on an all-padding batch: every write goes
            # to slot -1 and is dropped, so the donated pool comes back unchanged.
            idle = [np.zeros_like(a) for a in (rows, tokens, start, n_new)]
            _, pool = exe(params, pool, table, *idle, np.full_like(loc, -1))
            jax.block_until_ready(pool)
            self.compile_seconds += time.perf_counter() - t0
            self._compiled[key] = exe
        return exe(params, pool, table, rows, tokens, start, n_new, loc)

    def __len__(self) -> int:
        return len(self._compiled)

    def shapes(self) -> list[tuple]:
        """`(tokens shape (B, T), context)` of every compiled step; T == 1 is decode."""
        return [(key[2], key[3]) for key in self._compiled]


# The steps of the configs used most recently, shared by every engine of the process (a bounded
# cache: a test run or a sweep meets many configs).
_STEPS = CompileCache(max_entries=16)


def steps_for(model: Decoder) -> CompiledSteps:
    """The process-wide `CompiledSteps` of models with `model`'s config (engines share it)."""
    return _STEPS.get(model.cfg, lambda: CompiledSteps(model))


def _batch_bucket(n: int, max_batch: int) -> int:
    return min(1 << max(0, n - 1).bit_length(), max_batch)
