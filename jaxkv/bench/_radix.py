"""The prefix cache: `jaxkv.RadixCache` against SGLang's `RadixCache` on the same operations.

Both trees serve one stream of requests, as a scheduler drives its tree: each request matches
its prompt, locks the match, evicts when the allocator is short of the slots the rest of its
prompt needs, and, once a few later requests have come in (requests overlap), inserts its
prompt and releases its lock. A prompt is the start of one of a few system prompts, then
tokens of its own. The allocator holds the tree's size more than the requests in flight, so
once warm the tree stays about that full and every request evicts about what it adds.

The streams (`STREAMS`), each at page sizes 1 and 16, span the shapes a server sees:

- `whole`: 1K-token prompts, each system prompt shared whole (a quarter to three quarters
  of the prompt, drawn once per system prompt: a shallow tree), 100K tokens cached.
- `anywhere`: as `whole`, but each request shares a length of its own, so matches end inside
  edges and split them, and chains of nodes grow along each system prompt.
- `short`: 32- to 128-token prompts over 8 system prompts, an 8K-token tree: per-call costs.
- `small`: 1K-token prompts sharing anywhere, a 4K-token tree: a few leaves, so SGLang's
  eviction (a heap of every evictable leaf, built per call) is at its cheapest, and the
  allocator's free, which both trees call, weighs most.
- `1M`: 8K-token prompts sharing anywhere, 1M tokens cached: long edges, many leaves.
- `evict-heavy`: 128- to 1K-token prompts that share nothing, 100K cached: every request
  evicts about its own length.
- `lock-heavy`: as `anywhere`, with 64 requests in flight, each locking and releasing its
  match 4 times more (as a chunked prefill does), over deep chains.
- `any-length`: prompts of 16 to 8K tokens (log-uniform), sharing anywhere, 100K cached.

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
import dataclasses
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
PAGES = (1, 16)


@dataclasses.dataclass(frozen=True)
class Stream:
    """The shape of one request stream.

    Attributes:
        cached: tokens the tree holds once warm (the allocator's room beyond the requests in
            flight).
        prompt: the shortest and longest prompt, in tokens (log-uniform between them).
        shared: `"whole"` (each system prompt is shared at one length, drawn once), `"any"`
            (each request shares a length of its own) or `"none"` (nothing is shared). A
            shared length is a quarter to three quarters of the prompt.
        systems: how many system prompts the requests start with.
        in_flight: requests holding a lock at once.
        relocks: further lock and release pairs each request makes on its match.
    """

    cached: int
    prompt: tuple[int, int]
    shared: str = "any"
    systems: int = 32
    in_flight: int = 8
    relocks: int = 0

    def mean_prompt(self) -> int:
        lo, hi = self.prompt
        return lo if lo == hi else int((hi - lo) / np.log(hi / lo))

    def tiny(self) -> Stream:
        """The same shape at toy sizes (4K tokens cached, prompts an eighth, from 32 on)."""
        lo, hi = (max(32, n // 8) if n > 128 else n for n in self.prompt)
        return dataclasses.replace(self, cached=4096, prompt=(lo, hi), in_flight=8)


STREAMS = {
    "whole": Stream(100 << 10, (1 << 10, 1 << 10), "whole"),
    "anywhere": Stream(100 << 10, (1 << 10, 1 << 10)),
    "short": Stream(8 << 10, (32, 128), systems=8),
    "small": Stream(4 << 10, (1 << 10, 1 << 10)),
    "1M": Stream(1 << 20, (8 << 10, 8 << 10)),
    "evict-heavy": Stream(100 << 10, (128, 1 << 10), "none"),
    "lock-heavy": Stream(100 << 10, (1 << 10, 1 << 10), in_flight=64, relocks=4),
    "any-length": Stream(100 << 10, (16, 8 << 10)),
}


def _rounds(setting: Setting) -> int:
    """Timed rounds per stream: the full run 15, --quick 5, TINY 3."""
    sizes = setting.sizes
    return 3 if sizes.name == "tiny" else 5 if sizes.quick else 15


def _sized(stream: Stream, setting: Setting) -> Stream:
    return stream.tiny() if setting.sizes.name == "tiny" else stream


def _per_round(stream: Stream) -> int:
    """Requests per timed round: about 100K prompt tokens, 20 to 1,000 requests."""
    return min(1000, max(20, (100 << 10) // stream.mean_prompt()))


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


def _prompts(stream: Stream, n: int, seed: int) -> list[np.ndarray]:
    """`n` prompts of `stream`'s shape: the start of one of its system prompts, then tokens of
    their own."""
    rng = np.random.default_rng(seed)
    lo, hi = stream.prompt
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(int) if lo < hi else [lo] * n
    systems = rng.integers(0, 32000, (stream.systems, 3 * hi // 4))
    fixed = rng.uniform(0.25, 0.75, stream.systems)  # each system prompt's share, for "whole"
    out = []
    for length in lengths:
        which = int(rng.integers(stream.systems))
        share = {"whole": fixed[which], "any": rng.uniform(0.25, 0.75), "none": 0.0}
        shared = int(share[stream.shared] * length)
        own = rng.integers(0, 32000, length - shared)
        out.append(np.concatenate([systems[which][:shared], own]).astype(np.int32))
    return out


class _Tree:
    """One implementation behind the five calls, with its own allocator and clock."""

    name = ""

    def __init__(self, page: int, capacity: int, stream: Stream):
        self.page = page
        self.stream = stream
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
        for prompt in prompts:
            # The whole pages: the partial tail page is the request's own (neither tree
            # caches it).
            tokens = prompt[: prompt.size // self.page * self.page]
            key = self.key(tokens)
            node, slots = self.match(key)
            self.answers.append(len(slots))
            self.timed("lock", self.lock, node)
            for _ in range(self.stream.relocks):
                self.timed("unlock", self.unlock, node)
                self.timed("lock", self.lock, node)
            need = len(tokens) - len(slots)
            short = need - self.alloc.available_size()
            if short > 0:
                self.answers.append(self.timed("evict", self.evict, short))
            new = self.alloc.alloc(need)
            if new is None:  # the allocator holds every lock in flight and a prompt more
                raise RuntimeError(f"{self.name}: {need} slots wanted, none left to evict")
            full = np.concatenate([slots, new])
            held.append((tokens, full, len(slots), node))
            if len(held) > self.stream.in_flight:
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

    def __init__(self, page: int, capacity: int, stream: Stream):
        super().__init__(page, capacity, stream)
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

    def __init__(self, page: int, capacity: int, stream: Stream, sgl):
        super().__init__(page, capacity, stream)
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


def _compare(name: str, page: int, setting: Setting, sgl) -> dict:
    stream = _sized(STREAMS[name], setting)
    rounds, per_round = _rounds(setting), _per_round(stream)
    capacity = stream.cached + (stream.in_flight + 1) * stream.prompt[1]
    warm = 3 * stream.cached // stream.mean_prompt()  # fills the tree and evicts a while
    prompts = _prompts(stream, warm + per_round * rounds, seed=11 + page)
    trees: list[_Tree] = [_Jaxkv(page, capacity, stream)]
    if sgl:
        trees.append(_SGLang(page, capacity, stream, sgl))
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
            f"{name}, page {page}: jaxkv's and SGLang's trees answered the same stream differently"
        )
    row = {
        "shared": name,  # the stream
        "page_size": page,
        "cached_tokens": trees[0].total(),
        "prompt_tokens": list(stream.prompt),
        "requests": rounds * per_round,
    }
    for t in trees:
        calls = sum(t.calls.values())
        row[f"{t.name} ops"] = calls
        row[f"{t.name} ops/s"] = calls / sum(t.seconds.values())
        row[f"{t.name} us/request"] = 1e6 * float(np.median(per_round_s[t.name])) / per_round
        for op in OPS:
            if t.calls[op]:
                row[f"{t.name} {op} us"] = 1e6 * t.seconds[op] / t.calls[op]
    if sgl:
        ratios = [s / j for j, s in zip(per_round_s["jaxkv"], per_round_s["SGLang"])]
        row["SGLang/jaxkv"] = float(np.median(ratios))
    return row


def measure(setting: Setting) -> dict:
    sgl, why = _sglang()
    rows = [_compare(name, page, setting, sgl) for name in STREAMS for page in PAGES]
    return {"skipped": why, "rows": rows}


def targets(res: dict, setting: Setting) -> list[Measured]:
    """Measured only where SGLang is: a run without it has nothing to compare."""
    if res["skipped"]:
        return []
    worst = min(res["rows"], key=lambda r: r["SGLang/jaxkv"])
    return [
        Measured(
            "radix.sglang",
            f"prefix cache, worst of {len(STREAMS)} streams x page sizes "
            f"({worst['shared']}, page {worst['page_size']}): SGLang's RadixCache time / "
            "jaxkv's",
            worst["SGLang/jaxkv"],
        )
    ]


def _prompt_label(row: dict) -> str:
    lo, hi = row["prompt_tokens"]
    return label(lo) if lo == hi else f"{label(lo)}-{label(hi)}"


def report(res: dict, setting: Setting) -> None:
    rows = [{**r, "prompts": _prompt_label(r)} for r in res["rows"]]
    names = ["jaxkv"] if res["skipped"] else ["jaxkv", "SGLang"]
    cols = [
        ("shared", "stream", "s"),
        ("page_size", "page", "d"),
        ("cached_tokens", "cached", "d"),
        ("prompts", "prompts", "s"),
    ]
    cols += [(f"{n} us/request", f"{n} us/req", ".1f") for n in names]
    if not res["skipped"]:
        cols.append(("SGLang/jaxkv", "SGLang/jaxkv", ".2f"))
    print_table(
        f"prefix cache (tree time per request: match, lock, evict, insert, release; "
        f"{_rounds(setting)} rounds, ratio the median of the rounds'; streams in "
        "jaxkv/bench/_radix.py)",
        rows,
        cols,
    )
    cols = [("shared", "stream", "s"), ("page_size", "page", "d")]
    for name in names:
        cols.append((f"{name} ops/s", f"{name} ops/s", ".0f"))
        cols += [(f"{name} {op} us", f"{op} us", ".1f") for op in OPS]
    print_table("prefix cache, per call (us)", rows, cols)
    if res["skipped"]:
        print(
            f"  SGLang rows skipped: {res['skipped']}; run the bench where SGLang 0.5.23 "
            "imports (pip install sglang==0.5.23) to compare"
        )


SECTION = Section("radix", measure, report, targets)
