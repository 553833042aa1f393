"""The prefix cache: `jaxkv.RadixCache` against SGLang's `RadixCache` on the same operations.

Both trees serve one stream of requests, as a scheduler drives its tree: each request matches
its prompt, locks the match, evicts when the allocator is short of the slots the rest of its
prompt needs, and, once a few later requests have come in (requests overlap), inserts its
prompt and releases its lock. The prompts are 1K tokens: the start of one of 32 system
prompts, then tokens of their own. Two streams: each system prompt shared whole (256 to 768
tokens, drawn once per system prompt: a shallow tree), or each request sharing a length of
its own in that range (matches end inside edges and split them, so chains of nodes grow).
The allocator holds 100K tokens more than the requests in flight, so once warm the tree caches
about 100K tokens and every request evicts about what it adds. Page sizes 1 and 16.

Only the tree calls are timed. Each tree has its own jaxkv `PagedAllocator` (SGLang's through
the simulated cache's allocator hook, `free_segment`), and each gets its inputs in its own
types, made before the clock starts: numpy token ids and slots for jaxkv, `RadixKey` arrays
and torch tensors for SGLang. A match includes reading the matched slots (jaxkv's
`PrefixMatch.slots`; SGLang's `path_device_indices` of the matched node), which the caller
needs for the request's row. The two trees must answer alike (matched lengths, insert
returns, tokens evicted); a stream where they do not is an error, not a figure.

SGLang is measured only when `sglang.srt.mem_cache.radix_cache` imports (SGLang 0.5.23's tree
in an environment that has it); otherwise the section says so and why.
"""

from __future__ import annotations

import collections
import time
from array import array
from typing import Any

import numpy as np

from jaxkv import PagedAllocator, RadixCache, TokenAllocator
from jaxkv.bench._report import print_table
from jaxkv.bench._section import Section, Setting
from jaxkv.bench._sizes import label
from jaxkv.bench._targets import Measured

OPS = ("match", "lock", "evict", "insert", "unlock")
SYSTEM_PROMPTS = 32
IN_FLIGHT = 8  # requests holding a lock at once
PAGES = (1, 16)
# The two kinds of sharing: whole system prompts (a shallow tree: one node per system prompt,
# a leaf per request), or shared lengths of every size (matches end anywhere, so chains of
# splits grow along each system prompt and a walk passes many nodes).
STREAMS = {"whole": True, "any length": False}


def _shape(setting: Setting) -> tuple[int, int, int, int]:
    """`(cached tokens, prompt tokens, requests per round, rounds)`: 100K and 1K in the full
    and quick runs (the same work; quick runs fewer rounds), toy sizes for `TINY`."""
    sizes = setting.sizes
    if sizes.name == "tiny":
        return 4096, 128, 20, 3
    return 100 << 10, 1 << 10, 100, 5 if sizes.quick else 15


def _sglang():
    """SGLang's radix cache module and its parameter classes, or the reason they are not
    here."""
    try:
        from sglang.srt.mem_cache import radix_cache
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
    except Exception as err:  # not installed, or an install that does not import
        return None, f"SGLang's RadixCache does not import here ({type(err).__name__}: {err})"
    return (radix_cache, EvictParams, InsertParams, MatchPrefixParams), None


def _stream(n: int, prompt: int, seed: int, fixed: bool) -> list[np.ndarray]:
    """`n` prompts of `prompt` tokens: the start of one of the system prompts, then tokens of
    their own. `fixed`: each system prompt is always shared whole (its length, a quarter to
    three quarters of the prompt, drawn once); else each prompt shares a length of its own
    in that range, so matches end anywhere and chains of splits grow."""
    rng = np.random.default_rng(seed)
    systems = rng.integers(0, 32000, (SYSTEM_PROMPTS, 3 * prompt // 4))
    lengths = rng.integers(prompt // 4, 3 * prompt // 4 + 1, SYSTEM_PROMPTS)
    out = []
    for _ in range(n):
        which = int(rng.integers(SYSTEM_PROMPTS))
        shared = int(lengths[which] if fixed else rng.integers(prompt // 4, 3 * prompt // 4 + 1))
        own = rng.integers(0, 32000, prompt - shared)
        out.append(np.concatenate([systems[which][:shared], own]))
    return [p.astype(np.int32) for p in out]


class _Tree:
    """One implementation behind the five calls, with its own allocator and clock."""

    name = ""

    def __init__(self, page: int, capacity: int):
        self.page = page
        self.alloc = TokenAllocator(capacity) if page == 1 else PagedAllocator(capacity, page)
        self.seconds = dict.fromkeys(OPS, 0.0)
        self.calls = dict.fromkeys(OPS, 0)
        self.answers: list[int] = []

    def timed(self, op: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.seconds[op] += time.perf_counter() - t0
        self.calls[op] += 1
        return out

    def serve(self, prompts: list[np.ndarray], held: collections.deque) -> None:
        """Serves `prompts` in order; `held` carries the requests in flight across calls."""
        for tokens in prompts:
            key = self.key(tokens)
            node, slots = self.match(key)
            self.answers.append(len(slots))
            self.timed("lock", self.lock, node)
            need = len(tokens) // self.page * self.page - len(slots)
            short = need - self.alloc.available_size()
            if short > 0:
                self.answers.append(self.timed("evict", self.evict, short))
            new = self.alloc.alloc(need)
            if new is None:  # the allocator holds every lock in flight and a prompt more
                raise RuntimeError(f"{self.name}: {need} slots wanted, none left to evict")
            full = np.concatenate([slots, new])
            held.append((tokens, full, len(slots), node))
            if len(held) > IN_FLIGHT:
                self.finish(*held.popleft())

    def finish(self, tokens, full, matched: int, node) -> None:
        cached = self.timed("insert", self.insert, self.key(tokens), self.value(full))
        self.answers.append(cached)
        self.alloc.free(full[matched:cached])  # the copies of what the tree held already
        self.timed("unlock", self.unlock, node)

    # Each implementation's calls, in its own types.

    def key(self, tokens: np.ndarray) -> Any:
        raise NotImplementedError

    def value(self, slots: np.ndarray) -> Any:
        raise NotImplementedError

    def match(self, key) -> tuple[Any, np.ndarray]:
        raise NotImplementedError

    def lock(self, node) -> None:
        raise NotImplementedError

    def unlock(self, node) -> None:
        raise NotImplementedError

    def evict(self, n: int) -> int:
        raise NotImplementedError

    def insert(self, key, value) -> int:
        raise NotImplementedError

    def total(self) -> int:
        raise NotImplementedError


class _Jaxkv(_Tree):
    name = "jaxkv"

    def __init__(self, page: int, capacity: int):
        super().__init__(page, capacity)
        self.cache = RadixCache(self.alloc)

    def key(self, tokens):
        return tokens

    def value(self, slots):
        return slots

    def match(self, key):
        m = self.timed("match", self.cache.match_prefix, key)
        return m.node, m.slots

    def lock(self, node):
        self.cache.inc_lock_ref(node)

    def unlock(self, node):
        self.cache.dec_lock_ref(node)

    def evict(self, n: int) -> int:
        return self.cache.evict(n)

    def insert(self, key, value) -> int:
        return self.cache.insert(key, value)

    def total(self) -> int:
        return self.cache.total_size()


class _SGLang(_Tree):
    name = "SGLang"

    def __init__(self, page: int, capacity: int, sgl):
        super().__init__(page, capacity)
        import torch

        self.torch = torch
        radix, self.EvictParams, self.InsertParams, self.MatchParams = sgl
        self.RadixKey = radix.RadixKey
        alloc = self.alloc

        class Slots:  # what the simulated cache asks of an allocator
            device = "cpu"

            @staticmethod
            def free_segment(values, start_pos=0):
                alloc.free(values.numpy())

        self.cache = radix.RadixCache.create_simulated(mock_allocator=Slots(), page_size=page)

    def key(self, tokens):
        return self.RadixKey(array("q", tokens.tolist()))

    def value(self, slots):
        return self.torch.from_numpy(slots.astype(np.int64))

    def match(self, key):
        def match_and_read(key):
            found = self.cache.match_prefix(self.MatchParams(key=key))
            return found.last_device_node, self.cache.path_device_indices(found.last_device_node)

        node, slots = self.timed("match", match_and_read, key)
        return node, slots.numpy()

    def lock(self, node):
        self.cache.inc_lock_ref(node)

    def unlock(self, node):
        self.cache.dec_lock_ref(node)

    def evict(self, n: int) -> int:
        return self.cache.evict(self.EvictParams(num_tokens=n)).num_tokens_evicted

    def insert(self, key, value) -> int:
        return self.cache.insert(self.InsertParams(key=key, value=value)).prefix_len

    def total(self) -> int:
        return self.cache.total_size()


def _compare(page: int, stream: str, setting: Setting, sgl) -> dict:
    cached, prompt, per_round, rounds = _shape(setting)
    capacity = cached + (IN_FLIGHT + 1) * prompt
    warm = 3 * cached // prompt  # enough requests to fill the tree and evict for a while
    prompts = _stream(warm + per_round * rounds, prompt, seed=11 + page, fixed=STREAMS[stream])
    trees = [_Jaxkv(page, capacity)] + ([_SGLang(page, capacity, sgl)] if sgl else [])
    held: dict[str, collections.deque] = {t.name: collections.deque() for t in trees}
    for t in trees:
        t.serve(prompts[:warm], held[t.name])
        t.seconds, t.calls = dict.fromkeys(OPS, 0.0), dict.fromkeys(OPS, 0)
    per_round_s: dict[str, list[float]] = {t.name: [] for t in trees}
    for r in range(rounds):
        chunk = prompts[warm + r * per_round : warm + (r + 1) * per_round]
        for t in trees:  # alternately, so a slow moment of the machine hits both
            before = sum(t.seconds.values())
            t.serve(chunk, held[t.name])
            per_round_s[t.name].append(sum(t.seconds.values()) - before)
    if sgl and trees[0].answers != trees[1].answers:
        raise RuntimeError(
            f"page {page}: jaxkv's and SGLang's trees answered the same stream differently"
        )
    row = {
        "page_size": page,
        "shared": stream,
        "cached_tokens": trees[0].total(),
        "prompt_tokens": prompt,
    }
    for t in trees:
        calls = sum(t.calls.values())
        row[f"{t.name} ops"] = calls
        row[f"{t.name} ops/s"] = calls / sum(t.seconds.values())
        for op in OPS:
            if t.calls[op]:
                row[f"{t.name} {op} us"] = 1e6 * t.seconds[op] / t.calls[op]
    if sgl:
        ratios = [s / j for j, s in zip(per_round_s["jaxkv"], per_round_s["SGLang"])]
        row["SGLang/jaxkv"] = float(np.median(ratios))
    return row


def measure(setting: Setting) -> dict:
    sgl, why = _sglang()
    rows = [_compare(page, stream, setting, sgl) for stream in STREAMS for page in PAGES]
    return {"skipped": why, "rows": rows}


def targets(res: dict, setting: Setting) -> list[Measured]:
    """Measured only where SGLang is: a run without it has nothing to compare."""
    if res["skipped"]:
        return []
    worst = min(res["rows"], key=lambda r: r["SGLang/jaxkv"])
    cached, prompt, _, _ = _shape(setting)
    return [
        Measured(
            "radix.sglang",
            f"prefix cache, {label(cached)} cached tokens, {label(prompt)}-token prompts, worst "
            "stream and page size: SGLang's RadixCache time / jaxkv's",
            worst["SGLang/jaxkv"],
        )
    ]


def report(res: dict, setting: Setting) -> None:
    cached, prompt, per_round, rounds = _shape(setting)
    cols = [("shared", "shared", "s"), ("page_size", "page", "d"), ("cached_tokens", "cached", "d")]
    names = ["jaxkv"] if res["skipped"] else ["jaxkv", "SGLang"]
    for name in names:
        cols.append((f"{name} ops/s", f"{name} ops/s", ".0f"))
        cols += [(f"{name} {op} us", f"{op} us", ".1f") for op in OPS]
    if not res["skipped"]:
        cols.append(("SGLang/jaxkv", "SGLang/jaxkv", ".2f"))
    print_table(
        f"prefix cache (tree calls per second, and us per call; {label(prompt)}-token prompts, "
        f"about {label(cached)} tokens cached, {IN_FLIGHT} requests in flight, "
        f"{rounds} rounds of {per_round} requests)",
        res["rows"],
        cols,
    )
    if res["skipped"]:
        print(
            f"  SGLang rows skipped: {res['skipped']}; run the bench where SGLang 0.5.23 "
            "imports (pip install sglang==0.5.23) to compare"
        )


SECTION = Section("radix", measure, report, targets)
