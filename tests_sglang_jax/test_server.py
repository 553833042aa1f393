"""sglang-jax's own server, started on the CPU, with and without jaxkv's store under HiCache.

Each server is a real `python -m sgl_jax.launch_server` (or jaxkv's launcher around it) on a
tiny random Qwen2 written at test time (`sgljax_server`, which also says what it works around
in sglang-jax). Requests go over HTTP with `input_ids`, greedy, one at a time.

Both kinds of server get the same arguments, HiCache included (`--hicache-storage none`, which
jaxkv's launcher asks for): only the store differs. That makes sglang-jax's own server the
reference twice over: its tokens are what jaxkv's must reproduce, and it shows what
`/flush_cache` empties. `UnifiedRadixCache.reset` frees the host pages with the tree, so after
a flush sglang-jax reuses nothing (the reference test asserts `cached_tokens == 0`): a prefix
jaxkv's server reuses after a flush came from its store. A second process on the same store
folder proves it again without any flush.

Servers run one at a time (an idle one busy-polls a core): the reference server serves every
prompt and stops before jaxkv's starts; the restart test stops jaxkv's first server itself.
Each case's time to first token is printed (run with -s to see them), never asserted.
"""

from __future__ import annotations

import numpy as np
import pytest
from sgljax_server import MODEL_CONFIG, Server, build_checkpoint, wait_until_settled

NEW_TOKENS = 8


def _prompts() -> dict[str, list[int]]:
    # Random ids past the special tokens, fixed seed. "shared-*" share prefixes of 1,000 and
    # 600 tokens in the order they are served, so the later ones start from the tree;
    # "stored" shares nothing with them.
    rng = np.random.default_rng(20260612)

    def ids(n: int) -> list[int]:
        return rng.integers(3, MODEL_CONFIG["vocab_size"], size=n).tolist()

    base = ids(1000)
    return {
        "shared-1000": base,
        "shared-1000+500": base + ids(500),
        "shared-600+900": base[:600] + ids(900),
        "shared-1000+800": base + ids(800),
        "stored": ids(1500),
    }


PROMPTS = _prompts()
SHARED = [name for name in PROMPTS if name.startswith("shared")]
SERVER_ARGS = ("--hicache-storage", "none")


def _record(case: str, ttft: float, meta_info: dict) -> None:
    print(
        f"\n[server e2e] {case}: first token after {ttft * 1000:.0f} ms, "
        f"cached_tokens {meta_info['cached_tokens']}/{meta_info['prompt_tokens']}"
    )


def _started(kind: str, server: Server) -> None:
    print(f"\n[server e2e] {kind} server started in {server.start_seconds:.1f} s")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="module")
def reference(checkpoint, tmp_path_factory):
    """sglang-jax's own server's answers: {case: (tokens, meta_info)}; the server has stopped
    when this returns."""
    logs = tmp_path_factory.mktemp("reference")
    answers = {}
    with Server.start(checkpoint, logs / "server.log", extra_args=SERVER_ARGS) as server:
        _started("sglang-jax", server)
        for name in [*SHARED, "stored"]:
            tokens, meta, ttft = server.generate(PROMPTS[name], NEW_TOKENS)
            _record(f"sglang-jax {name}", ttft, meta)
            answers[name] = tokens, meta
        server.flush_cache()
        tokens, meta, ttft = server.generate(PROMPTS["stored"], NEW_TOKENS)
        _record("sglang-jax stored, after /flush_cache", ttft, meta)
        answers["stored after flush"] = tokens, meta
    return answers


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("disk-store")


def _jaxkv_env(store_dir) -> dict[str, str]:
    # A wait long enough that a store hit on this loaded 2-core machine is reported in the
    # request's own scheduling round, not the next request's.
    return {"JAXKV_SGLANG_JAX_STORE": f"disk:{store_dir}", "JAXKV_SGLANG_JAX_WAIT_MS": "1000"}


@pytest.fixture(scope="module")
def jaxkv_server(checkpoint, store_dir, reference, tmp_path_factory):
    # `reference` first: its server has stopped by then.
    logs = tmp_path_factory.mktemp("jaxkv")
    with Server.start(checkpoint, logs / "server.log", jaxkv_env=_jaxkv_env(store_dir)) as server:
        _started("jaxkv", server)
        yield server


def test_the_reference_server_reuses_prefixes_and_flush_cache_empties_every_tier(reference):
    # The harness's own check: sglang-jax's tree serves shared prefixes, and after
    # /flush_cache nothing (neither the device nor HiCache's host memory) is reused.
    assert reference["shared-1000"][1]["cached_tokens"] == 0
    assert reference["shared-1000+500"][1]["cached_tokens"] >= 1000
    assert reference["shared-600+900"][1]["cached_tokens"] >= 600
    assert reference["stored after flush"][1]["cached_tokens"] == 0
    assert reference["stored after flush"][0] == reference["stored"][0]


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
    _record("jaxkv stored, after /flush_cache", ttft, meta)
    assert tokens == reference["stored"][0]
    # sglang-jax alone reuses 0 tokens here (the reference test); the store's blocks cover the
    # prompt but for its last, partial block (and at least the last token is computed).
    assert meta["cached_tokens"] >= len(prompt) - 64, meta


def test_a_second_server_on_the_same_folder_serves_the_prefix(
    jaxkv_server, checkpoint, store_dir, reference, tmp_path_factory
):
    # Runs last: it stops the module's jaxkv server (one server at a time).
    prompt = PROMPTS["shared-1000+800"]
    jaxkv_server.generate(prompt, NEW_TOKENS)  # stored already if the tests before ran
    wait_until_settled(store_dir)
    jaxkv_server.stop()

    logs = tmp_path_factory.mktemp("jaxkv-restarted")
    with Server.start(checkpoint, logs / "server.log", jaxkv_env=_jaxkv_env(store_dir)) as second:
        _started("jaxkv (second, same folder)", second)
        tokens, meta, ttft = second.generate(prompt, NEW_TOKENS)
        _record("jaxkv second server, shared-1000+800", ttft, meta)
    assert tokens == reference["shared-1000+800"][0]
    # A fresh process: nothing on its device or host; the prefix came from the folder.
    assert meta["cached_tokens"] >= len(prompt) - 64, meta
