"""Block hashing: `block_hashes` against one SHA-256 pass over the same tokens."""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from jaxkv import MHAPool
from jaxkv.bench._harness import interleaved
from jaxkv.bench._report import print_table
from jaxkv.bench._section import Section, Setting
from jaxkv.bench._sizes import label
from jaxkv.bench._targets import Measured
from jaxkv.connector import HostStore, KVConnector

BLOCKS = (16, 64, 256)


def measure(setting: Setting) -> list[dict]:
    """One row per block size: the keys of `hash_tokens` tokens, against a single SHA-256
    pass over their bytes (what hashing costs without the per-block chain)."""
    pool = MHAPool.create(size=16, head_num=1, head_dim=8, layer_num=1)
    tokens = np.random.default_rng(2).integers(0, 150_000, setting.sizes.hash_tokens)
    data = tokens.astype("<u4").tobytes()
    quick = setting.sizes.quick
    rows = []
    for block in BLOCKS:
        conn = KVConnector(pool, HostStore(1 << 20), block_size=block)
        med = interleaved(
            {
                "block_hashes": functools.partial(conn.block_hashes, tokens),
                "sha256 one pass": lambda: hashlib.sha256(data).digest(),
            },
            rounds=10 if quick else 30,
            budget_s=1.0 if quick else 3.0,
        )
        rows.append(
            {
                "block_size": block,
                "tokens": len(tokens),
                **med,
                "tokens_per_s": len(tokens) / med["block_hashes"],
                "ratio": med["block_hashes"] / med["sha256 one pass"],
            }
        )
    return rows


def targets(rows: list[dict], setting: Setting) -> list[Measured]:
    ratios = {r["block_size"]: r["ratio"] for r in rows}
    return [
        Measured(f"hashing.block{b}", f"block_hashes / one SHA-256 pass, block {b}", ratios.get(b))
        for b in (16, 256)
    ]


def report(rows: list[dict], setting: Setting) -> None:
    print_table(
        f"hashing ({label(setting.sizes.hash_tokens)} tokens)",
        rows,
        [
            ("block_size", "block", "d"),
            ("tokens_per_s", "tokens/s", ".3g"),
            ("ratio", "vs one sha256 pass", ".1f"),
        ],
    )


SECTION = Section("hashing", measure, report, targets)
