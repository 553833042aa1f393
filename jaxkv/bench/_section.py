"""What a bench section is: a measurement, its targets and its report, and what it is given.

A new section is a module with three functions and one `Section` naming them, added to
`jaxkv.bench.SECTIONS`; its target limits go into `jaxkv.bench._targets.TARGETS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxkv.bench._sizes import Sizes
from jaxkv.bench._targets import Measured


@dataclass(frozen=True)
class Setting:
    """What every section is given.

    Attributes:
        sizes: the problem sizes of the run.
        backend: JAX's default backend (`"cpu"`, `"gpu"`, `"tpu"`): each has its own floors.
        redis_url: the user's Redis server for the store tiers' Redis rows, or None.
        redis_cluster_url: the user's Redis Cluster (`redis+cluster://...`) for their Redis
            Cluster rows, or None.
        mooncake: the user's Mooncake cluster (`mooncake://HOST:PORT?metadata=URL`) for their
            Mooncake rows, or None.
    """

    sizes: Sizes
    backend: str
    redis_url: str | None = None
    redis_cluster_url: str | None = None
    mooncake: str | None = None

    @property
    def accel(self) -> bool:
        """Whether the backend is an accelerator (its floors are on the device)."""
        return self.backend != "cpu"


def no_targets(result: Any, setting: Setting) -> list[Measured]:
    """The targets of a section that only reports figures."""
    return []


@dataclass(frozen=True)
class Section:
    """One part of the bench.

    Attributes:
        key: its key in the JSON.
        measure: `measure(setting) -> result`: the section's rows (JSON-ready lists and dicts).
        report: `report(result, setting)`: prints its tables.
        targets: `targets(result, setting) -> [Measured]`: the value of each of its targets,
            whose limits `_targets.TARGETS` holds.
    """

    key: str
    measure: Callable[[Setting], Any]
    report: Callable[[Any, Setting], None]
    targets: Callable[[Any, Setting], list[Measured]] = no_targets
