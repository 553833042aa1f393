"""Time to first token on sglang-jax's real server, with jaxkv's store under HiCache (CPU).

A program, not a test: it starts sglang-jax's server through jaxkv's launcher on the tiny random
Qwen2 of the end-to-end tests, one server at a time, serves 1,800-token prompts (8 new tokens,
greedy) and prints a markdown table of the time to first token of each case, as the median of 3
prompts and as a ratio to the cold median of the same server kind:

    cold                      a prompt the server has never seen
    device hit                the same prompt again at once
    store, after /flush_cache the prompt after `/flush_cache` (which empties device and host)
    store, after eviction     the prompt after enough other prompts that the tree dropped it
                              from the device and host memory (the device is then full of
                              cached prefixes, so the load back evicts some)
    store, after a restart    the prompt's first request to a new server on the same folder
    store, second server      the prompt's first request to a server that shares the Redis
                              server only
    host hit                  the prompt after two others pushed it off the device (4,096
                              tokens) but not out of host memory (8,192)

"tokens as cold" says whether each of the 3 prompts gave the tokens its cold request gave. A
store hit computes only the tail of a prompt, and this tiny bf16 model's greedy tokens depend
on where a prefill is cut (sglang-jax's own device hit with the same cut changes them too), so
"NO" there is the model, not the KV: the end-to-end tests compare a store hit with the same
cut computed by sglang-jax's own server.

Each case runs with jaxkv's host pool (`JAXKV_SGLANG_JAX_HOST_POOL=jaxkv`, the default) and with
sglang-jax's own (`sglang-jax`). A case that fails is reported as such, with the line of the
server's log that says why, not left out: sglang-jax's host pool reloads pages with a TPU
kernel, and what that does on the CPU is measured here. The host-hit case runs last on its
server, since a failure there may end the server.

Servers per kind: the first on a `TieredStore` of a folder and a Redis server
(`disk:DIR,redis://...`: one server writes both, so the restart and second-server cases have
their blocks; the folder is read first, so the flush and eviction cases read the folder); the
second on the folder alone (restart), the third on Redis alone (second server). Every jaxkv
setting but the store and the host pool is at its default.

    SGLANG_JAX_SRC=/path/to/sglang-jax/python \\
    PYTHONPATH=$SGLANG_JAX_SRC:$PWD/tests_sglang_jax JAX_PLATFORMS=cpu \\
      .venv-sglang-jax/bin/python examples/sglang_jax_server_bench.py --json out.json

Needs `redis-server` on the PATH and the packages of `.ci/sglang-jax-requirements.txt`. The
harness (`tests_sglang_jax/sgljax_server.py`: the server's CPU flags, its Python 3.11 hook, the
checkpoint) and `tests/redis_server.py` are test helpers, not part of the package: their
folders are put on `sys.path` below, so this program uses the very servers the tests use.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# The test helpers, imported by path (see the docstring).
sys.path[:0] = [str(REPO_ROOT / "tests_sglang_jax"), str(REPO_ROOT / "tests")]

import numpy as np  # noqa: E402
import redis  # noqa: E402
from redis_server import LocalRedis  # noqa: E402
from sgljax_server import (  # noqa: E402
    MODEL_CONFIG,
    Server,
    ServerError,
    build_checkpoint,
    host_pool_tokens,
    wait_until_count_settles,
    wait_until_settled,
)

LONG = 1800
NEW_TOKENS = 8
SAMPLES = 3
KINDS = ("jaxkv", "sglang-jax")
ROWS = (
    "cold",
    "device hit",
    "store, after /flush_cache",
    "store, after eviction",
    "store, after a restart",
    "store, second server (Redis)",
    "host hit",
)


class Prompts:
    """Fresh 1,800-token prompts, none sharing a token prefix with another (random ids)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def take(self, n: int = 1) -> list[list[int]]:
        vocab = MODEL_CONFIG["vocab_size"]
        return [self.rng.integers(3, vocab, size=LONG).tolist() for _ in range(n)]


def _why(server: Server, err: Exception) -> str:
    # The last exception of the server's log (a traceback's last line, "ValueError: ...")
    # says more than the HTTP failure.
    lines = server.log_path.read_text(errors="replace").splitlines()
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
    return (errors[-1] if errors else str(err).splitlines()[0]).strip()[:300]


class Row:
    """One case's samples: seconds to the first token, cached tokens, and whether the tokens
    were the cold request's for the same prompt."""

    def __init__(self, name: str):
        self.name = name
        self.ttft: list[float] = []
        self.cached: list[int] = []
        self.same: list[bool] = []
        self.failure: str | None = None

    def add(self, answer, cold_tokens: list[int]) -> None:
        tokens, meta, ttft = answer
        self.ttft.append(ttft)
        self.cached.append(meta["cached_tokens"])
        self.same.append(tokens == cold_tokens)

    def as_dict(self, cold_s: float | None) -> dict:
        if not self.ttft:
            return {"case": self.name, "failure": self.failure or "not run"}
        median = statistics.median(self.ttft)
        return {
            "case": self.name,
            "ttft_ms": round(median * 1000, 1),
            "ratio_to_cold": round(median / cold_s, 3) if cold_s else None,
            "samples_ms": [round(t * 1000, 1) for t in self.ttft],
            "cached_tokens": self.cached,
            "prompt_tokens": LONG,
            "same_tokens_as_cold": all(self.same),
            "failure": self.failure,
        }


def _serve(server: Server, prompt: list[int]):
    return server.generate(prompt, NEW_TOKENS)


def run_kind(kind: str, checkpoint: Path, work: Path, redis_url: str, seed: int) -> list[dict]:
    """The table's rows for one host pool kind (three servers, one after another)."""
    prompts = Prompts(seed)
    rows = {name: Row(name) for name in ROWS}
    store_dir = work / f"store-{kind}"
    env = {"JAXKV_SGLANG_JAX_HOST_POOL": kind}

    def start(store: str, name: str) -> Server:
        server = Server.start(
            checkpoint,
            work / f"{kind}-{name}.log",
            jaxkv_env={**env, "JAXKV_SGLANG_JAX_STORE": store},
        )
        print(f"[{kind}] {name} server started in {server.start_seconds:.1f} s", flush=True)
        return server

    def case(row: Row, server: Server, body) -> None:
        try:
            body()
        except ServerError as err:
            row.failure = _why(server, err)
            print(f"[{kind}] {row.name}: failed: {row.failure}", flush=True)

    cold_tokens: dict[int, list[int]] = {}  # id(prompt) -> its cold tokens

    def cold(server: Server, prompt: list[int], row: Row | None = None) -> None:
        answer = _serve(server, prompt)
        cold_tokens[id(prompt)] = answer[0]
        if row is not None:
            row.add(answer, answer[0])

    def hit(server: Server, prompt: list[int], row: Row) -> None:
        row.add(_serve(server, prompt), cold_tokens[id(prompt)])

    restart = prompts.take(SAMPLES)
    with start(f"disk:{store_dir},{redis_url}", "first") as server:
        host_tokens = host_pool_tokens(server.log_path)
        # Other prompts' pages fill the host pool (write-through backs each up as it is
        # served) past its size, so the tree's least-recently-used eviction drops every older
        # page; plus one for the pages a running request holds.
        fillers = host_tokens // LONG + 2

        def cold_and_device():
            for prompt in prompts.take(SAMPLES):
                cold(server, prompt, rows["cold"])
                hit(server, prompt, rows["device hit"])

        def after_flush():
            for prompt in prompts.take(SAMPLES):
                cold(server, prompt)
                wait_until_settled(store_dir)
                server.flush_cache()
                hit(server, prompt, rows["store, after /flush_cache"])

        def after_eviction():
            evicted = prompts.take(SAMPLES)
            for prompt in evicted:
                cold(server, prompt)
            for prompt in prompts.take(fillers):
                cold(server, prompt)
            for prompt in evicted:
                hit(server, prompt, rows["store, after eviction"])

        def stored_for_restart():
            for prompt in restart:
                cold(server, prompt)
            wait_until_settled(store_dir)
            client = redis.Redis.from_url(redis_url)
            wait_until_count_settles(client.dbsize, f"{redis_url}: keys")
            client.close()

        def host_hit():
            for prompt in prompts.take(SAMPLES):
                cold(server, prompt)
                # Two prompts more than the device's 4,096 tokens hold beside it: it leaves
                # the device; 5,400 tokens since it stay within the host pool's 8,192.
                for other in prompts.take(2):
                    cold(server, other)
                hit(server, prompt, rows["host hit"])

        case(rows["cold"], server, cold_and_device)
        case(rows["store, after /flush_cache"], server, after_flush)
        case(rows["store, after eviction"], server, after_eviction)
        case(rows["store, after a restart"], server, stored_for_restart)
        case(rows["host hit"], server, host_hit)  # last: it may end the server

    if rows["store, after a restart"].failure is None:
        with start(f"disk:{store_dir}", "restarted") as server:
            case(
                rows["store, after a restart"],
                server,
                lambda: [hit(server, p, rows["store, after a restart"]) for p in restart],
            )
        with start(redis_url, "second-redis") as server:
            case(
                rows["store, second server (Redis)"],
                server,
                lambda: [hit(server, p, rows["store, second server (Redis)"]) for p in restart],
            )
    cold_s = statistics.median(rows["cold"].ttft) if rows["cold"].ttft else None
    return [{"host_pool": kind, **rows[name].as_dict(cold_s)} for name in ROWS]


def table(results: list[dict]) -> str:
    lines = [
        "| host pool | case | TTFT ms (median of 3) | x cold | cached tokens | tokens as cold |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    for r in results:
        if "ttft_ms" not in r or r.get("failure"):
            why = r.get("failure") or "not run"
            lines.append(f"| {r['host_pool']} | {r['case']} | failed: {why} | | | |")
            continue
        cached = "/".join(str(c) for c in r["cached_tokens"])
        lines.append(
            f"| {r['host_pool']} | {r['case']} | {r['ttft_ms']:.0f} | "
            f"{r['ratio_to_cold']:.2f} | {cached} of {r['prompt_tokens']} | "
            f"{'yes' if r['same_tokens_as_cold'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows there, as JSON")
    parser.add_argument(
        "--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="host pool kinds to run"
    )
    args = parser.parse_args(argv)

    results = []
    with tempfile.TemporaryDirectory(prefix="sgljax-server-bench-") as tmp:
        work = Path(tmp)
        checkpoint = build_checkpoint(work / "tiny-qwen2", seed=0)
        with LocalRedis() as local:
            for seed, kind in enumerate(args.kinds):
                redis.Redis.from_url(local.url).flushall()  # each kind starts with an empty store
                results += run_kind(kind, checkpoint, work, local.url, seed)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"rows": results, "new_tokens": NEW_TOKENS}, indent=1))


if __name__ == "__main__":
    main()
