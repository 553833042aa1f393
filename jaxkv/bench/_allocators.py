"""The paged allocator: `alloc_extend` and `alloc_decode` for a batch of 256 requests."""

from __future__ import annotations

import numpy as np

from jaxkv import PagedAllocator
from jaxkv.bench._harness import interleaved
from jaxkv.bench._report import print_table, scaled
from jaxkv.bench._section import Section, Setting

REQUESTS, PAGE = 256, 16


def measure(setting: Setting) -> list[dict]:
    """Seconds per call, each from the same saved state (the restore's own time taken off)."""
    rng = np.random.default_rng(3)
    alloc = PagedAllocator(1 << 20, PAGE)
    prefix = rng.integers(1, 2048, REQUESTS)
    held = alloc.alloc_extend(np.zeros(REQUESTS, int), prefix, np.full(REQUESTS, -1))
    assert held is not None  # a million slots hold every prefix
    last = held[np.cumsum(prefix) - 1]
    seq = prefix + rng.integers(1, 512, REQUESTS)
    state = alloc.backup_state()

    def extend():
        alloc.restore_state(state)
        assert alloc.alloc_extend(prefix, seq, last) is not None

    def decode():
        alloc.restore_state(state)
        assert alloc.alloc_decode(prefix + 1, last) is not None

    quick = setting.sizes.quick
    med = interleaved(
        {
            "alloc_extend": extend,
            "alloc_decode": decode,
            "restore": lambda: alloc.restore_state(state),
        },
        rounds=30 if quick else 100,
        budget_s=1.0 if quick else 3.0,
    )
    return [
        {
            "requests": REQUESTS,
            "page_size": PAGE,
            "extend_tokens": int((seq - prefix).sum()),
            "alloc_extend": med["alloc_extend"] - med["restore"],
            "alloc_decode": med["alloc_decode"] - med["restore"],
        }
    ]


def report(rows: list[dict], setting: Setting) -> None:
    print_table(
        "allocators (us per call)",
        scaled(rows, ("alloc_extend", "alloc_decode"), 1e6),
        [
            ("requests", "requests", "d"),
            ("extend_tokens", "extend tokens", "d"),
            ("alloc_extend", "alloc_extend", ".0f"),
            ("alloc_decode", "alloc_decode", ".0f"),
        ],
    )


SECTION = Section("allocators", measure, report)
