"""sglang-jax's own server, started on the CPU, with and without jaxkv's store under HiCache.

Each server is a real `python -m sgl_jax.launch_server` (or jaxkv's launcher around it) on a
tiny random Qwen2 written at test time (`sgljax_server`, which also says what it works around
in sglang-jax). Requests go over HTTP with `input_ids`, greedy, one at a time.

Both kinds of server get the same arguments, HiCache included (`--hicache-storage none`, which
jaxkv's launcher asks for): only the store differs. jaxkv's servers set nothing but
`JAXKV_SGLANG_JAX_STORE`, so they run at the launcher's defaults (the prefetch wait, the host
pool). That makes sglang-jax's own server the reference twice over: its tokens are what
jaxkv's must reproduce, and it shows what the tree keeps. `UnifiedRadixCache.reset` frees the
host pages with the tree, so after a flush sglang-jax reuses nothing (the reference test
asserts `cached_tokens == 0`): a prefix jaxkv's server reuses after a flush came from its
store. The same holds for a prefix pushed out of the device and host memory by other prompts
(the reference server, same tree and sizes, reuses none of it), for a new process on the same
store folder, and for a second server on the same Redis server.

A store hit is compared with the reference server computing the same cut of the prompt (its
whole blocks cached, the rest computed): this tiny bf16 model's greedy tokens depend on where
a prefill is cut, on sglang-jax's own server alone, so a prompt computed whole is not the
reference for a prompt whose first 1,792 tokens were cached.

Servers run one at a time (an idle one busy-polls a core), six in all, each started once: the
reference server serves every prompt and stops; jaxkv's first server (a folder store) serves
the shared, flushed, evicted and restart prompts; a second one on the same folder, a third on
the folder with every file damaged; then two on one Redis server, the second also while that
Redis server is killed. Each case's time to first token is printed (run with -s to see them),
with its ratio to the reference server's cold one of the same prompt, never asserted.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis
from sgljax_server import (
    MODEL_CONFIG,
    Server,
    build_checkpoint,
    host_pool_tokens,
    wait_until_count_settles,
    wait_until_settled,
)
from sgljax_trees import local_redis

NEW_TOKENS = 8
# The store's block: the connector's default for sglang-jax's page size 1 (the server's).
BLOCK = 16
# Prompts a jaxkv server serves from its store (their cut is computed by the reference).
STORE_HITS = ("stored", "evicted", "restart", "redis")
LONG = 1800  # a long prompt: 28 whole 64-token blocks of the store, under the context of 2,048
FILLERS = 8  # prompts that may push one out of the device and host memory (see _fillers_needed)


def _prompts() -> dict[str, list[int]]:
    # Random ids past the special tokens, fixed seed. "shared-*" share prefixes of 1,000 and
    # 600 tokens in the order they are served, so the later ones start from the tree; the
    # others share nothing with any prompt.
    rng = np.random.default_rng(20260612)

    def ids(n: int) -> list[int]:
        return rng.integers(3, MODEL_CONFIG["vocab_size"], size=n).tolist()

    base = ids(1000)
    prompts = {
        "shared-1000": base,
        "shared-1000+500": base + ids(500),
        "shared-600+900": base[:600] + ids(900),
        "shared-1000+800": base + ids(800),
        "stored": ids(1500),
        "evicted": ids(LONG),
        "restart": ids(LONG),
        "redis": ids(LONG),
    }
    return prompts | {f"filler-{i}": ids(LONG) for i in range(FILLERS)}


PROMPTS = _prompts()
SHARED = [name for name in PROMPTS if name.startswith("shared")]
SERVER_ARGS = ("--hicache-storage", "none")


def _mostly_cached(meta_info: dict, prompt: list[int]) -> bool:
    # A store hit covers the prompt's whole 64-token blocks; 90% leaves room for the last
    # partial block and for a block the prefetch had not landed when the match stopped waiting.
    return meta_info["cached_tokens"] >= 0.9 * len(prompt)


def _record(case: str, ttft: float, meta_info: dict, cold_ttft: float | None = None) -> None:
    ratio = "" if cold_ttft is None else f" ({ttft / cold_ttft:.2f} x the reference's cold)"
    print(
        f"\n[server e2e] {case}: first token after {ttft * 1000:.0f} ms{ratio}, "
        f"cached_tokens {meta_info['cached_tokens']}/{meta_info['prompt_tokens']}"
    )


def _started(kind: str, server: Server) -> None:
    print(f"\n[server e2e] {kind} server started in {server.start_seconds:.1f} s")


def _fillers_needed(host_tokens: int) -> int:
    # Prompts served after P, sharing nothing with it or each other: their pages are backed up
    # to host memory as they are served (write-through, threshold 1), so once they hold more
    # than the host pool's tokens, the tree's least-recently-used eviction has dropped every
    # page older than them from the host, P's included; the device (4,096 tokens) held at most
    # two of them. One more than that, for the pages a request holds while it runs.
    needed = host_tokens // LONG + 2
    assert needed <= FILLERS, f"{host_tokens} host tokens need {needed} fillers; raise FILLERS"
    return needed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="module")
def reference(checkpoint, tmp_path_factory):
    """sglang-jax's own server's answers: {case: (tokens, meta_info, ttft)}, with "fillers",
    how many prompts push one out of its device and host memory; the server has stopped when
    this returns."""
    logs = tmp_path_factory.mktemp("reference")
    answers = {}

    def serve(server, name, case=None):
        tokens, meta, ttft = server.generate(PROMPTS[name], NEW_TOKENS)
        _record(f"sglang-jax {case or name}", ttft, meta)
        answers[case or name] = tokens, meta, ttft

    with Server.start(checkpoint, logs / "server.log", extra_args=SERVER_ARGS) as server:
        _started("sglang-jax", server)
        for name in [*SHARED, "stored"]:
            serve(server, name)
        server.flush_cache()
        serve(server, "stored", "stored after flush")
        # The eviction case, as jaxkv's server will serve it: the same tree and sizes then
        # keep nothing of "evicted" (asserted by the reference test).
        answers["fillers"] = _fillers_needed(host_pool_tokens(server.log_path))
        serve(server, "evicted")
        for i in range(answers["fillers"]):
            serve(server, f"filler-{i}")
        serve(server, "evicted", "evicted again")
        serve(server, "restart")
        serve(server, "redis")
        # A store hit caches a prompt's whole blocks and computes the rest. This tiny bf16
        # model's greedy tokens depend on where the prefill is cut (sglang-jax alone gives
        # "evicted" other tokens from the 6th on with 1,792 of its tokens cached on the
        # device), so each store hit is compared with this server computing the same cut:
        # the prompt's whole blocks served first (then cached on the device), then the prompt.
        for name in STORE_HITS:
            prompt = PROMPTS[name]
            cut = len(prompt) // BLOCK * BLOCK
            server.flush_cache()
            other = 3 if prompt[cut] != 3 else 4  # the cut's next token differs: k cached
            server.generate(prompt[:cut] + [other], 1)
            tokens, meta, ttft = server.generate(prompt, NEW_TOKENS)
            _record(f"sglang-jax {name}, its first {cut} tokens cached", ttft, meta)
            assert meta["cached_tokens"] == cut, meta
            answers[f"{name} cut"] = tokens, meta, ttft
    return answers


def _expected(reference, name: str, meta_info: dict) -> list[int]:
    """The reference's tokens for `name` computed with as many tokens cached as jaxkv's
    server reported: none (computed whole) or the prompt's whole blocks (a store hit)."""
    cached = meta_info["cached_tokens"]
    if cached == 0:
        return reference[name][0]
    cut = reference[f"{name} cut"]
    assert cached == cut[1]["cached_tokens"], (
        f"{name}: {cached} tokens cached, expected the prompt's whole blocks "
        f"({cut[1]['cached_tokens']}): a store hit that stopped short"
    )
    return cut[0]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("disk-store")


def _start_jaxkv(checkpoint, store: str, kind: str, tmp_path_factory) -> Server:
    # The store alone: every other setting at the launcher's default.
    logs = tmp_path_factory.mktemp(kind)
    server = Server.start(
        checkpoint, logs / "server.log", jaxkv_env={"JAXKV_SGLANG_JAX_STORE": store}
    )
    _started(kind, server)
    return server


@pytest.fixture(scope="module")
def jaxkv_server(checkpoint, store_dir, reference, tmp_path_factory):
    # `reference` first: its server has stopped by then.
    with _start_jaxkv(checkpoint, f"disk:{store_dir}", "jaxkv", tmp_path_factory) as server:
        yield server


def test_the_reference_server_reuses_prefixes_and_evicts_and_flushes_every_tier(reference):
    # The harness's own check: sglang-jax's tree serves shared prefixes, and after
    # /flush_cache, or after enough other prompts, nothing of a prompt (neither on the device
    # nor in HiCache's host memory) is reused.
    assert reference["shared-1000"][1]["cached_tokens"] == 0
    assert reference["shared-1000+500"][1]["cached_tokens"] >= 1000
    assert reference["shared-600+900"][1]["cached_tokens"] >= 600
    assert reference["stored after flush"][1]["cached_tokens"] == 0
    assert reference["stored after flush"][0] == reference["stored"][0]
    assert reference["evicted again"][1]["cached_tokens"] == 0
    assert reference["evicted again"][0] == reference["evicted"][0]


def test_jaxkv_launcher_gives_sglang_jax_tokens(jaxkv_server, reference):
    for name in SHARED:
        tokens, meta, ttft = jaxkv_server.generate(PROMPTS[name], NEW_TOKENS)
        _record(f"jaxkv {name}", ttft, meta)
        assert len(tokens) == NEW_TOKENS
        assert tokens == reference[name][0], name
        # The same tree behind both: the same prefix reused.
        assert meta["cached_tokens"] == reference[name][1]["cached_tokens"], name


def test_after_flush_cache_the_store_serves_the_prefix(jaxkv_server, store_dir, reference):
    prompt = PROMPTS["stored"]
    tokens, meta, ttft = jaxkv_server.generate(prompt, NEW_TOKENS)
    _record("jaxkv stored, first", ttft, meta)
    assert tokens == reference["stored"][0]
    # HiCache backs the prefix up to host memory, and jaxkv to the store, in the background.
    wait_until_settled(store_dir)
    jaxkv_server.flush_cache()

    tokens, meta, ttft = jaxkv_server.generate(prompt, NEW_TOKENS)
    _record("jaxkv stored, after /flush_cache", ttft, meta, reference["stored"][2])
    assert tokens == _expected(reference, "stored", meta)
    # sglang-jax alone reuses 0 tokens here (the reference test).
    assert _mostly_cached(meta, prompt), meta


def test_a_prefix_evicted_from_device_and_host_comes_back_from_the_store(jaxkv_server, reference):
    # The reference server served the same sequence and reused nothing of "evicted" after the
    # fillers (the reference test): the tree dropped it from the device and host memory. Here
    # the device is then full of the fillers' cached prefixes, so the load back must evict
    # some of them to make room.
    prompt = PROMPTS["evicted"]
    tokens, meta, ttft = jaxkv_server.generate(prompt, NEW_TOKENS)
    _record("jaxkv evicted, first", ttft, meta)
    assert tokens == reference["evicted"][0]
    for i in range(reference["fillers"]):
        tokens, _, _ = jaxkv_server.generate(PROMPTS[f"filler-{i}"], NEW_TOKENS)
        assert tokens == reference[f"filler-{i}"][0], i

    tokens, meta, ttft = jaxkv_server.generate(prompt, NEW_TOKENS)
    _record("jaxkv evicted, after the fillers", ttft, meta, reference["evicted"][2])
    assert tokens == _expected(reference, "evicted", meta)
    assert _mostly_cached(meta, prompt), meta


def test_a_restarted_server_at_the_defaults_serves_the_prefix(
    jaxkv_server, checkpoint, store_dir, reference, tmp_path_factory
):
    # It stops the module's jaxkv server (one server at a time); the tests after it start
    # their own.
    prompt = PROMPTS["restart"]
    tokens, _, _ = jaxkv_server.generate(prompt, NEW_TOKENS)
    assert tokens == reference["restart"][0]
    # sglang-jax's shutdown SIGKILLs its scheduler: writes still in flight would be lost.
    wait_until_settled(store_dir)
    jaxkv_server.stop()

    store = f"disk:{store_dir}"
    with _start_jaxkv(checkpoint, store, "jaxkv-restarted", tmp_path_factory) as second:
        tokens, meta, ttft = second.generate(prompt, NEW_TOKENS)
    _record("jaxkv restarted, first request", ttft, meta, reference["restart"][2])
    assert tokens == _expected(reference, "restart", meta)
    # A fresh process: nothing on its device or host; the prefix came from the folder, in the
    # request's own scheduling round (the default wait).
    assert _mostly_cached(meta, prompt), meta


def test_a_server_on_damaged_files_recomputes(checkpoint, store_dir, reference, tmp_path_factory):
    # After the restart test: its servers stopped, and the folder holds "restart"'s blocks.
    files = [p for p in store_dir.rglob("*") if p.is_file()]
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        # The middle of the record, past its header: the size stays right, so the store
        # finds the damage only when it verifies the checksum of a read.
        for i in range(len(data) // 2, min(len(data), len(data) // 2 + 16)):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))

    prompt = PROMPTS["restart"]
    with _start_jaxkv(checkpoint, f"disk:{store_dir}", "jaxkv-damaged", tmp_path_factory) as server:
        tokens, meta, ttft = server.generate(prompt, NEW_TOKENS)
    _record("jaxkv on damaged files", ttft, meta, reference["restart"][2])
    assert tokens == reference["restart"][0]
    # Every block of the folder is damaged and the process is new: nothing to reuse (the
    # intact folder gave the restarted server at least 90%).
    assert meta["cached_tokens"] == 0, meta


@pytest.fixture(scope="module")
def redis_server():
    server = local_redis().start()
    yield server
    server.close()


def test_a_second_server_on_one_redis_server_serves_the_prefix(
    checkpoint, redis_server, reference, tmp_path_factory
):
    # After the folder tests, whose servers stopped.
    prompt = PROMPTS["redis"]
    with _start_jaxkv(checkpoint, redis_server.url, "jaxkv-redis-a", tmp_path_factory) as first:
        tokens, _, _ = first.generate(prompt, NEW_TOKENS)
        assert tokens == reference["redis"][0]
        client = redis.Redis.from_url(redis_server.url)
        wait_until_count_settles(client.dbsize, f"{redis_server.url}: keys")
        client.close()

    with _start_jaxkv(checkpoint, redis_server.url, "jaxkv-redis-b", tmp_path_factory) as second:
        tokens, meta, ttft = second.generate(prompt, NEW_TOKENS)
        _record("jaxkv second server on one Redis", ttft, meta, reference["redis"][2])
        assert tokens == _expected(reference, "redis", meta)
        assert _mostly_cached(meta, prompt), meta

        # The store goes away under the running server: a match that asks it, and the
        # backup of what is computed then, fail in jaxkv's background; the request is
        # recomputed.
        redis_server.stop()
        for name in ["restart", "evicted"]:
            tokens, meta, ttft = second.generate(PROMPTS[name], NEW_TOKENS)
            _record(f"jaxkv {name}, Redis killed", ttft, meta, reference[name][2])
            assert tokens == _expected(reference, name, meta), name
