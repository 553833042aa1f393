"""`python -m jaxkv bench`: jaxkv against numpy, memcpy and naive JAX, side by side in one run.

Every comparison runs its contenders alternately (one call of each per round) and reports
medians, so a slow moment of the machine hits all of them alike. The sections (`SECTIONS`, in
the order they run and print): pool updates, connector transfers, store tiers (host, disk,
Redis, Redis Cluster, Mooncake, beside memcpy), a head-sharded pool on 8 devices, block
hashing, the allocators, the prefix cache against SGLang's, sglang-jax's HiCache host pool
against jaxkv's, `store_async`, and the reference decoder's serving steps. Then every
performance target, with its value and limit (`_targets.TARGETS`); `--check` makes a missed
target the exit status. `--json` writes every figure and target; `--plot` draws update time
against pool size.

Sizes: `FULL` (the default run), `QUICK` (`--quick`, a laptop's first run), `TINY` (every
section and target in seconds, for tests of the bench: its figures say nothing about
performance).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import jax

from jaxkv.bench import (
    _allocators,
    _connector,
    _hashing,
    _radix,
    _remote,
    _serving,
    _sglang_jax,
    _sharded,
    _updates,
)
from jaxkv.bench._harness import machine
from jaxkv.bench._plot import plot
from jaxkv.bench._report import print_misses, print_targets
from jaxkv.bench._section import Section, Setting
from jaxkv.bench._sizes import FULL, QUICK, TINY, Sizes
from jaxkv.bench._targets import TARGETS, evaluate

__all__ = ["FULL", "QUICK", "SECTIONS", "TARGETS", "TINY", "Section", "Setting", "Sizes", "run"]

SECTIONS: list[Section] = [
    _updates.SECTION,
    _connector.SECTION,
    _remote.SECTION,
    _sharded.SECTION,
    _hashing.SECTION,
    _allocators.SECTION,
    _radix.SECTION,
    _sglang_jax.SECTION,
    _connector.ASYNC,
    _serving.SECTION,
]


def run(
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    sizes: Sizes | None = None,
    *,
    check: bool = False,
    redis_url: str | None = None,
    redis_cluster_url: str | None = None,
    mooncake: str | None = None,
) -> int:
    """Runs every section of `SECTIONS`, prints their tables and the targets; returns the
    exit status.

    Args:
        quick: run at `QUICK` sizes (`--quick`) rather than `FULL`.
        json_path: where to write every figure and target as JSON, or None.
        plot_path: where to draw update time against pool size (needs matplotlib), or None.
        sizes: the problem sizes, overriding `quick` (`TINY` for tests of the bench itself).
        check: return 1 when a target is missed (`--check`), after naming each miss.
        redis_url: a Redis or Valkey server for the store tiers' Redis rows (`--redis-url`);
            without it those rows are skipped, and the output says how to run them.
        redis_cluster_url: a Redis Cluster (`redis+cluster://HOST:PORT`) for the store
            tiers' Redis Cluster rows (`--redis-cluster-url`), or None.
        mooncake: a Mooncake cluster (`mooncake://HOST:PORT?metadata=URL`) for the store
            tiers' Mooncake rows and its store against its own client (`--mooncake`), or
            None.

    Returns:
        0 when it ran (and, with `check`, every target held); 1 when `check` found a missed
        target; 2 when `--plot` lacks matplotlib or the server at `redis_url` cannot be used
        (checked before anything runs).
    """
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install 'jaxkv[bench]'", file=sys.stderr)
            return 2
    servers = (
        ("--redis-url", redis_url, _remote.redis_problem),
        ("--redis-cluster-url", redis_cluster_url, _remote.redis_problem),
        ("--mooncake", mooncake, _remote.mooncake_problem),
    )
    for flag, where, problem_of in servers:
        problem = problem_of(where) if where else None
        if problem:
            print(f"{flag} {where}: {problem}", file=sys.stderr)
            return 2
    sizes = sizes or (QUICK if quick else FULL)
    setting = Setting(sizes, jax.default_backend(), redis_url, redis_cluster_url, mooncake)
    info = machine()
    print(f"jaxkv bench{' --quick' if sizes == QUICK else ''} ({sizes.name} sizes)")
    print("  " + ", ".join(f"{k} {v}" for k, v in info.items()))
    start = time.perf_counter()
    res: dict = {"machine": info, "quick": sizes.quick, "sizes": dataclasses.asdict(sizes)}
    measured = []
    for section in SECTIONS:
        res[section.key] = section.measure(setting)
        measured += section.targets(res[section.key], setting)
    res["targets"] = evaluate(measured, sizes)
    res["seconds"] = time.perf_counter() - start
    for section in SECTIONS:
        section.report(res[section.key], setting)
    print_targets(res["targets"])
    print(f"\n{res['seconds']:.0f} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {json_path}")
    if plot_path:
        plot(res, plot_path)
        print(f"wrote {plot_path}")
    if check and not all(t["ok"] for t in res["targets"]):
        print_misses(res["targets"])
        return 1
    return 0
