"""The serving loop over jaxkv: prefix reuse (device and store), no retracing, in-place pools,
all or nothing under failures, the demo program."""

import io
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_DECODER as SMALL
from helpers import run_python

from jaxkv import PagedAllocator, RadixCache, ReqToTokenPool, demo, testing
from jaxkv.connector import DiskStore, HostStore, KVConnector
from jaxkv.models import (
    LOGIT_BOUNDS,
    CompiledSteps,
    Decoder,
    DecoderConfig,
    Engine,
    Request,
    params_fingerprint,
)

ROOT = Path(__file__).resolve().parents[1]
BF16 = jnp.dtype(jnp.bfloat16)
ENGINE = dict(pool_size=1024, page_size=16, max_batch=4, max_context=128)
# Host stores here hold 1 MiB (256 of the GQA decoder's 4 KiB blocks), more than any test stores:
# a HostStore maps and touches its arena, up to its capacity, when it is made.
# The uncached reference: every prompt prefilled in full.
PLAIN = {**ENGINE, "prefix_cache": False}


def small_model(attention="gqa"):
    model = Decoder(DecoderConfig(attention=attention, **SMALL))
    return model, model.init_params()


def shared_prefix_requests(seed=0, prefix_len=70, new_tokens=4):
    """Prompts sharing a `prefix_len`-token prefix; the first arrives alone, the rest next."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 256, prefix_len)
    return [
        Request(
            np.concatenate([prefix, rng.integers(0, 256, n)]).astype(np.int32),
            new_tokens,
            arrival=0 if i == 0 else 1,
        )
        for i, n in enumerate((5, 12, 1, 30))
    ]


def assert_same_outputs(want, got, dtype=BF16):
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=LOGIT_BOUNDS[dtype])


def sources(results):
    """Where each request's prompt K/V came from: (device, store, computed) tokens."""
    return [(r.device_tokens, r.reused_tokens, r.computed_tokens) for r in results]


def assert_holds_only_the_tree(engine):
    """Between calls no request holds anything: every slot taken is the prefix cache's, and
    none is locked (a slot both free and cached, or held by nobody, breaks the sum)."""
    tree = engine.tree_cache
    assert engine.allocator.available_size() + tree.total_size() == engine.allocator.size
    assert tree.protected_size() == 0


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_prefix_reuse_from_host_store_equals_no_reuse(attention):
    model, params = small_model(attention)
    requests = shared_prefix_requests()
    plain = Engine(model, params, **PLAIN).generate(requests)
    assert sources(plain) == [(0, 0, len(r.prompt)) for r in requests]
    engine = Engine(model, params, store=HostStore(1 << 20), **PLAIN)
    reused = engine.generate(requests)
    assert_same_outputs(plain, reused)
    # The first request computed the prefix and offloaded it; the others loaded its 4 full
    # blocks (64 of the 70 shared tokens) and prefilled only the rest.
    assert [r.reused_tokens for r in reused] == [0, 64, 64, 64]
    assert [r.device_tokens for r in reused] == [0, 0, 0, 0]
    stats = engine.connector.stats()
    assert stats["blocks_stored"] > 0 and stats["blocks_loaded"] == 12
    assert engine.stats["prefill_tokens"] == engine.stats["prompt_tokens"] - 3 * 64
    assert engine.tree_cache is None
    engine.close()


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_prefix_reuse_from_the_device_equals_no_reuse(attention):
    model, params = small_model(attention)
    requests = shared_prefix_requests()
    plain = Engine(model, params, **PLAIN).generate(requests)
    engine = Engine(model, params, store=HostStore(1 << 20), **ENGINE)
    got = engine.generate(requests)
    assert_same_outputs(plain, got)
    # The first request's prompt pages joined the prefix cache after its prefill: the others,
    # arriving while it decodes, read its 4 full pages (64 of the 70 shared tokens) in place.
    assert sources(got) == [(0, 0, 75), (64, 0, 18), (64, 0, 7), (64, 0, 36)]
    assert engine.connector.stats()["blocks_loaded"] == 0
    s = engine.stats
    assert (s["device_tokens"], s["reused_tokens"]) == (3 * 64, 0)
    assert s["prefill_tokens"] == s["prompt_tokens"] - 3 * 64
    assert_holds_only_the_tree(engine)
    # Served again: every prompt's cached pages (generated tokens' included) are found.
    again = engine.generate(requests)
    assert_same_outputs(plain, again)
    assert [d for d, _, _ in sources(again)] == [64, 80, 64, 96]
    assert_holds_only_the_tree(engine)
    engine.close()


def test_a_device_hit_reads_the_cached_slots_in_place():
    model, params = small_model()
    engine = Engine(model, params, **ENGINE)
    first, second = shared_prefix_requests(seed=3)[:2]
    engine.generate([Request(first.prompt, 2)])
    cached = engine.tree_cache.match_prefix(second.prompt[:64]).slots
    assert cached.size == 64
    rows = []

    def peek(n):  # while the second request runs: its row and what the allocator handed out
        rows.append(
            (np.asarray(engine.req_to_token.req_to_token), engine.allocator.available_size())
        )

    free, before = engine.allocator.available_size(), np.asarray(engine.req_to_token.req_to_token)
    [got] = engine.generate([Request(second.prompt, 2)], on_token=peek)
    table, free_while_running = rows[0]
    [row] = table[np.any(table != before, axis=1)]  # the one row the second request wrote
    # The row starts with the tree's own slots (no copy), and only the suffix got new pages.
    np.testing.assert_array_equal(row[:64], cached)
    assert free - free_while_running == 16 * -(-(len(second.prompt) - 64) // 16)
    assert got.device_tokens == 64
    [want] = Engine(model, params, **PLAIN).generate([Request(second.prompt, 2)])
    assert_same_outputs([want], [got])


def test_requests_prefilled_together_share_the_pages_they_both_computed():
    model, params = small_model()
    prompt = np.random.default_rng(8).integers(0, 256, 48).astype(np.int32)
    requests = [Request(prompt, 3), Request(prompt.copy(), 3)]
    engine = Engine(model, params, **ENGINE)
    got = engine.generate(requests)
    # Both computed the same 3 pages; after the prefill the second's row points at the first's
    # (its own copies freed), so the tree holds them once.
    assert sources(got) == [(0, 0, 48), (0, 0, 48)]
    assert engine.tree_cache.total_size() == 48
    assert_holds_only_the_tree(engine)
    assert_same_outputs(Engine(model, params, **PLAIN).generate(requests), got)


def test_a_short_pool_evicts_from_the_tree_and_writes_back_to_the_store():
    model, params = small_model()
    rng = np.random.default_rng(12)
    kw = {**ENGINE, "pool_size": 128}
    engine = Engine(model, params, store=HostStore(1 << 20), **kw)
    # 20 prompt tokens and 30 generated: 48 tokens with K/V in 3 full pages, of which only
    # the prompt's first block was offloaded after the prefill.
    a = Request(rng.integers(0, 256, 20).astype(np.int32), 30)
    [got_a] = engine.generate([a])
    assert engine.tree_cache.total_size() == 48
    # A 100-token prompt with 20 new tokens needs 8 pages: the tree gives up a's, which go
    # to the store first.
    b = Request(rng.integers(0, 256, 100).astype(np.int32), 20)
    [got_b] = engine.generate([b])
    assert engine.stats["evicted_tokens"] >= 48
    # a's prompt and output, served again: its first 48 tokens come back from the store,
    # generated tokens included.
    follow = Request(np.concatenate([a.prompt, got_a.tokens[:29]]).astype(np.int32), 3)
    [got] = engine.generate([follow])
    assert (got.device_tokens, got.reused_tokens) == (0, 48)
    assert_holds_only_the_tree(engine)
    plain = Engine(model, params, **{**kw, "prefix_cache": False})
    assert_same_outputs(plain.generate([a, b, follow]), [got_a, got_b, got])
    engine.close()


def test_prefix_cache_must_be_a_bool():
    model, params = small_model()
    with pytest.raises(TypeError, match="prefix_cache: expected a bool, got str 'yes'"):
        Engine(model, params, prefix_cache="yes", **ENGINE)


def test_prefix_reuse_from_a_disk_store_left_by_an_earlier_engine(tmp_path):
    # In one process (the test below runs the first engine in another): an engine serves one
    # request and is closed; only its DiskStore's folder stays behind.
    model, params = small_model()
    requests = shared_prefix_requests()
    first = Engine(model, params, store=DiskStore(tmp_path), **ENGINE)
    first.generate([Request(requests[0].prompt, 2)])
    first.close()
    assert first.connector.stats()["blocks_stored"] == 4  # 75 prompt tokens: 4 full blocks
    plain = Engine(model, params, **PLAIN).generate(requests)
    engine = Engine(model, params, store=DiskStore(tmp_path), **ENGINE)
    reused = engine.generate(requests)
    engine.close()
    # The second engine never computed the prefix: even the first request loads it from
    # disk, and the others find those blocks on the device.
    assert [r.reused_tokens for r in reused] == [64, 0, 0, 0]
    assert [r.device_tokens for r in reused] == [0, 64, 64, 64]
    assert_same_outputs(plain, reused)


@pytest.mark.slow  # a second interpreter
def test_prefix_reuse_from_a_disk_store_left_by_an_earlier_process(tmp_path):
    # An earlier process serves one request and exits; its DiskStore stays behind.
    child = textwrap.dedent(
        f"""
        import numpy as np
        from jaxkv.connector import DiskStore
        from jaxkv.models import LOGIT_BOUNDS, Decoder, DecoderConfig, Engine, Request
        model = Decoder(DecoderConfig(**{SMALL!r}))
        requests = [Request(np.array({shared_prefix_requests()[0].prompt.tolist()}), 2)]
        engine = Engine(model, model.init_params(), store=DiskStore({str(tmp_path)!r}),
                        **{ENGINE!r})
        engine.generate(requests)
        engine.close()
        print(engine.connector.stats()["blocks_stored"])
        """
    )
    proc = run_python("-c", child, timeout=300)
    assert int(proc.stdout.split()[-1]) == 4  # 75 prompt tokens: 4 full blocks of 16

    model, params = small_model()
    requests = shared_prefix_requests()
    plain = Engine(model, params, **PLAIN).generate(requests)
    engine = Engine(model, params, store=DiskStore(tmp_path), **ENGINE)
    reused = engine.generate(requests)
    engine.close()
    # This process never computed the prefix: even the first request loads it from disk, and
    # the others find those blocks on the device.
    assert [r.reused_tokens for r in reused] == [64, 0, 0, 0]
    assert [r.device_tokens for r in reused] == [0, 64, 64, 64]
    for a, b in zip(plain, reused):
        np.testing.assert_array_equal(a.tokens, b.tokens)


def test_decode_does_not_retrace_as_requests_come_and_go():
    model, params = small_model()
    rng = np.random.default_rng(2)
    engine = Engine(model, params, **ENGINE)

    # Prompts of 70-79 tokens: prefills and decodes fall in the (token, context) buckets of
    # the prefix-reuse tests (context 128), so the steps they compiled serve here too.
    def requests(arrivals, new_tokens):
        return [
            Request(rng.integers(0, 256, 70 + 3 * i).astype(np.int32), n, arrival=a)
            for i, (a, n) in enumerate(zip(arrivals, new_tokens))
        ]

    before = engine.steps.traces["decode"]
    # Requests join one by one and leave at different times: batches of 1, 2, 3, 4, 3, 2, 1.
    engine.generate(requests((0, 1, 2, 3), (12, 10, 8, 4)))
    traced = engine.steps.traces["decode"] - before
    decode_shapes = {s for s in engine.steps.shapes() if s[0][1] == 1}
    assert engine.stats["decode_steps"] >= 11
    # One trace per (batch bucket, context bucket): batch buckets 1, 2 and 4.
    assert traced <= len(decode_shapes) and {s[0][0] for s in decode_shapes} >= {1, 2, 4}
    steps = engine.stats["decode_steps"]
    # Another mix of arrivals and lengths within the same buckets traces nothing new.
    before = engine.steps.traces["decode"]
    engine.generate(requests((0, 0, 3, 5), (9, 3, 11, 6)))
    assert engine.steps.traces["decode"] == before
    assert engine.stats["decode_steps"] > steps + 10


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_serving_steps_keep_the_pool_in_place(prefix_cache):
    model, params = small_model("mla")
    engine = Engine(
        model, params, store=HostStore(1 << 20), **{**ENGINE, "prefix_cache": prefix_cache}
    )
    before = testing.buffer_pointers(engine.pool)
    requests = shared_prefix_requests(seed=4)
    engine.generate(requests)
    if prefix_cache:  # the device gives up the prefix: the next call loads it back
        tree = engine.tree_cache
        assert engine.stats["device_tokens"] > 0
        tree.evict(tree.evictable_size(), pool=engine.pool)
        engine.generate(requests[:1])
    # Prefill, decode and the connector's loads all wrote into the same buffers.
    testing.assert_updated_in_place(before, engine.pool)
    assert engine.stats["decode_steps"] > 0 and engine.stats["reused_tokens"] > 0
    engine.close()


def test_one_decode_step_writes_its_row_in_place():
    model, params = small_model()
    engine = Engine(model, params, **ENGINE)
    pool = engine.pool
    before = testing.buffer_pointers(pool)
    # Row 1 maps positions 0..5 to slots 32..37: five cached tokens and the step's new one,
    # written at slot 37; entry 1 is padding (row 0, its write dropped). Context 128: the
    # bucket the other tests' decode steps compiled at this batch size.
    table = engine.req_to_token.write(1, 0, np.arange(32, 38)).req_to_token
    logits, pool = engine.steps(
        params, pool, table, np.array([1, 0], np.int32), np.array([[7], [0]], np.int32),
        np.array([5, 0], np.int32), np.array([1, 0], np.int32), np.array([[37], [-1]], np.int32),
        ctx=128,
    )  # fmt: skip
    testing.assert_updated_in_place(before, pool)
    assert logits.shape == (2, model.cfg.vocab_size)
    k = np.asarray(pool.get_key_buffer(0), np.float32)
    assert np.abs(k[37]).sum() > 0 and np.abs(k[38:]).sum() == 0


def test_engine_rejects_tiny_pools():
    model, params = small_model()
    tiny = Engine(model, params, pool_size=32, page_size=16, max_batch=2, max_context=128)
    with pytest.raises(RuntimeError, match="pool too small"):
        tiny.generate([Request(np.zeros(40, np.int32), 2)])
    # 32 prompt tokens fill both pages; the first decode token needs a third.
    with pytest.raises(RuntimeError, match="no page left for 1 decoding requests"):
        tiny.generate([Request(np.zeros(32, np.int32), 3)])
    # The failed call gave its slots, lock and row back (its prompt's pages stay cached,
    # evictable): the engine still serves.
    assert tiny.allocator.available_size() + tiny.tree_cache.evictable_size() == 32
    assert_holds_only_the_tree(tiny)
    assert len(tiny.generate([Request(np.zeros(20, np.int32), 2)])[0].tokens) == 2


def test_requests_beyond_the_batch_wait_and_get_the_same_tokens():
    model, params = small_model()
    requests = shared_prefix_requests(seed=9, new_tokens=3)
    wide = Engine(model, params, **PLAIN).generate(requests)
    narrow = Engine(model, params, **{**ENGINE, "max_batch": 2}).generate(requests)
    for a, b in zip(wide, narrow):
        np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.slow  # a second interpreter; the whole demo twice
def test_demo_prints_the_table_and_fails_when_a_check_fails(capsys, monkeypatch):
    small = DecoderConfig(**SMALL)
    assert demo.run(requests=3, new_tokens=3, config=small) == 0
    out = capsys.readouterr().out
    for label in (
        "prefix hit rate",
        "device hits",
        "store hits",
        "misses",
        "bytes offloaded",
        "bytes loaded",
        "time to first token",
        "decode tokens/s",
    ):
        assert label in out
    assert "verification: OK" in out
    monkeypatch.setitem(demo.BOUNDS, "bf16", -1.0)
    assert demo.run(requests=2, new_tokens=2, config=small) == 1
    assert "verification: FAILED" in capsys.readouterr().out


def test_progress_bar_only_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    quiet, tty = io.StringIO(), Terminal()
    for stream in (quiet, tty):
        bar = demo.Progress(10, stream)
        bar.phase("serving")
        bar.advance(5)
        bar.close()
    assert quiet.getvalue() == ""
    assert "50%" in tty.getvalue() and "serving" in tty.getvalue()


# The whole serving loop three times on an fp8 pool of its own shapes. Every run covers fp8
# serving with reuse otherwise: test_cli's demo (an fp8 MLA pool, reuse from disk and device
# against no reuse and the uncached reference) and test_models' fp8 GQA and MLA generations.
@pytest.mark.slow
def test_fp8_pool_serves_with_reuse():
    model, params = small_model("gqa")
    requests = shared_prefix_requests(seed=11)
    kw = {**PLAIN, "dtype": jnp.float8_e4m3fn}
    plain = Engine(model, params, **kw).generate(requests)
    reused = Engine(model, params, store=HostStore(1 << 20), **kw).generate(requests)
    assert [r.reused_tokens for r in reused] == [0, 64, 64, 64]
    on_device = Engine(model, params, **{**kw, "prefix_cache": True}).generate(requests)
    assert [r.device_tokens for r in on_device] == [0, 64, 64, 64]
    for a, b, c in zip(plain, reused, on_device):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.tokens, c.tokens)


def test_readme_model_walkthrough_runs():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using jaxkv in your model", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    # The step wrote the new token's K at its slot and kept the pool's buffers.
    slot = int(scope["new"][0])
    assert float(scope["pool"].get_key_buffer(0)[slot, 0, 0]) == 1.0
    assert scope["out"].shape == (2, 1, 2, 64)


# --------------------------------------------------------------------------------------------
# Whose KV: the default namespace covers the weights


def test_params_fingerprint_covers_every_leafs_path_dtype_shape_and_bytes():
    _, params = small_model()
    fp = params_fingerprint(params)
    assert len(fp) == 64 and int(fp, 16) >= 0
    # Canonical: the dict's order and the arrays' home (device or host) do not matter.
    assert params_fingerprint(dict(reversed(list(params.items())))) == fp
    assert params_fingerprint(jax.tree.map(np.asarray, params)) == fp
    w = np.arange(12, dtype=np.float32)
    others = [
        {"a": w, "b": w + 1},
        {"a": w + 1, "b": w},  # the same bytes at swapped paths
        {"a": w.view(np.int32), "b": w + 1},  # the same bits as another dtype
        {"a": w.reshape(3, 4), "b": w + 1},  # the same bytes in another shape
        {"a": jnp.asarray(w, jnp.bfloat16), "b": w + 1},
        {"a": w, "b": w + 1, "c": 0.0},
    ]
    assert len({params_fingerprint(p) for p in others}) == len(others)
    with pytest.raises(TypeError, match=r"params\['x'\]: expected numeric array data"):
        params_fingerprint({"x": np.array([object()])})


def test_engines_with_other_weights_never_reuse_each_others_kv():
    model, params = small_model()
    store = HostStore(1 << 20)
    [request] = shared_prefix_requests(seed=5)[:1]
    a = Engine(model, params, store=store, **ENGINE)
    a.generate([request])
    a.close()
    # Same config, other weights (a fine-tune of A, say): A's blocks are not B's KV.
    scaled = jax.tree.map(lambda x: x * 1.5, params)
    b = Engine(model, scaled, store=store, **ENGINE)
    [got] = b.generate([request])
    b.close()
    [own] = Engine(model, scaled, **ENGINE).generate([request])
    assert got.reused_tokens == 0
    np.testing.assert_array_equal(got.tokens, own.tokens)
    np.testing.assert_allclose(got.logits, own.logits, rtol=0, atol=LOGIT_BOUNDS[BF16])
    # The same weights in other arrays are the same model: its blocks are reused.
    c = Engine(model, jax.tree.map(jnp.copy, params), store=store, **ENGINE)
    assert c.generate([request])[0].reused_tokens == 64
    c.close()
    # A namespace given is the caller's word for what the KV is, taken as it is.
    d = Engine(model, scaled, store=store, namespace=a.connector.namespace, **ENGINE)
    assert d.connector.namespace == a.connector.namespace
    d.close()


# --------------------------------------------------------------------------------------------
# All or nothing: a refused or failed generate takes nothing and breaks nothing


def _scenario() -> list[Request]:
    """Every step of a request's service, in a pool of 12 pages that the prefix cache fills:

    1. Two prompts sharing a 70-token prefix, prefilled together: the first loads the prefix's
       4 stored blocks, the second finds them on the device and loads one block more. Two
       equal 80-token prompts join while they decode, both find the prefix on the device and
       compute their fifth page; the second's copy of it is freed after the prefill.
    2. A 100-token prompt loads 6 stored blocks after the tree gives up room.
    3. A 40-token prompt loads 2 blocks, then the tree gives up the prefix for its last page.

    Run after run, from any state, phase 1 needs 10 of the 12 pages and evicts what came
    before it, so every run makes the same calls; and the tree ends holding the last two
    prompts, which the next run's phase 1 evicts (with the store as the tier below, written
    back).
    """
    rng = np.random.default_rng(6)
    shared = rng.integers(0, 256, 70)
    long = np.concatenate([shared, rng.integers(0, 256, 10)]).astype(np.int32)
    prompts = [np.concatenate([shared, rng.integers(0, 256, n)]) for n in (5, 12)]
    prompts += [long, long.copy(), rng.integers(0, 256, 100), rng.integers(0, 256, 40)]
    arrivals = (0, 0, 1, 1, 3, 5)
    return [Request(p.astype(np.int32), 3, arrival=a) for p, a in zip(prompts, arrivals)]


SCENARIO = _scenario()
# Where each prompt's K/V comes from in that scenario: (device, store, computed) tokens.
SOURCES = [(0, 64, 11), (64, 16, 2), (64, 0, 16), (64, 0, 16), (0, 96, 4), (0, 32, 8)]
SCENARIO_ENGINE = {**ENGINE, "pool_size": 12 * 16}


@pytest.fixture(scope="module")
def served():
    """One engine whose store holds every prompt of `SCENARIO` and whose prefix cache holds
    what a run of it leaves, and what a fresh engine over that store returns for it."""
    model, params = small_model()
    store = HostStore(1 << 20)
    engine = Engine(model, params, store=store, **SCENARIO_ENGINE)
    for _ in range(2):  # the first computes and stores; the second leaves a run's state
        engine.generate(SCENARIO)
    fresh = Engine(model, params, store=store, **SCENARIO_ENGINE)
    want = fresh.generate(SCENARIO)
    fresh.close()
    yield engine, want
    engine.close()


def held(engine):
    """What the engine has to give: free plus evictable tokens (the prefix cache's unlocked
    pages are as good as free), locked tokens and free rows; and, between calls, nothing is
    held but the tree."""
    assert_holds_only_the_tree(engine)
    tree = engine.tree_cache
    free = engine.allocator.available_size() + tree.evictable_size()
    return free, tree.protected_size(), engine.req_to_token.available_size()


def assert_serves_like_a_fresh_engine(engine, want):
    got = engine.generate(SCENARIO)
    # Where a prefix comes from depends on what the tree holds (a failed call may have left
    # more there, or emptied it with a lost pool); how much is not computed does not.
    assert [d + r for d, r, _ in sources(got)] == [d + r for d, r, _ in sources(want)]
    assert_same_outputs(want, got)


def test_the_fault_scenario_reuses_from_the_device_and_the_store_and_evicts(served):
    engine, want = served
    assert sources(want) == SOURCES
    evicted = engine.stats["evicted_tokens"]
    got = engine.generate(SCENARIO)
    assert sources(got) == SOURCES
    assert engine.stats["evicted_tokens"] > evicted
    assert_same_outputs(want, got)
    model, params = small_model()
    assert_same_outputs(Engine(model, params, **PLAIN).generate(SCENARIO), got)


@pytest.mark.parametrize(
    "bad, err, match",
    [
        (Request(np.zeros((2, 20), np.int32), 2), ValueError, r"\.prompt: .*1-D.*\(2, 20\)"),
        (Request(np.arange(10) + 0.7, 2), TypeError, r"\.prompt: .*integer.*float64"),
        (Request([1.0, 2.0], 2), TypeError, r"\.prompt: .*integer.*float64"),
        (Request(np.array([True, False]), 2), TypeError, r"\.prompt: .*integer.*bool"),
        (Request([[1, 2], [3]], 2), TypeError, r"\.prompt: expected a 1-D array"),
        (Request(np.zeros(0, np.int32), 1), ValueError, r"\.prompt: .*empty"),
        (Request([], 1), ValueError, r"\.prompt: .*empty"),
        (Request(np.array([3, 258]), 1), ValueError, r"\.prompt: .*\[0, 258\), got 258 at"),
        (Request(np.array([-1, 3]), 1), ValueError, r"\.prompt: .*\[0, 258\), got -1 at"),
        (Request(np.arange(5), 0), ValueError, r"\.max_new_tokens: .*positive int, got 0"),
        (Request(np.arange(5), 2.0), TypeError, r"\.max_new_tokens: .*got float 2\.0"),
        (Request(np.arange(5), True), TypeError, r"\.max_new_tokens: .*got bool"),
        (Request(np.arange(5), 1, arrival=-1), ValueError, r"\.arrival: .*>= 0, got -1"),
        (Request(np.arange(5), 1, arrival=0.5), TypeError, r"\.arrival: .*got float"),
        (Request(np.zeros(120, np.int32), 10), ValueError, r": expected len\(prompt\).*129"),
        ((np.arange(5), 1), TypeError, r": expected a Request, got tuple"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_taken(served, bad, err, match):
    engine, want = served
    before = held(engine)
    # The bad request is the second: the first, good one must not have been started either.
    with pytest.raises(err, match=r"requests\[1\]" + match):
        engine.generate([SCENARIO[0], bad])
    assert held(engine) == before
    assert_serves_like_a_fresh_engine(engine, want)


class InjectedFault(Exception):
    pass


# Every call a request's service makes that can fail, by the class it is made on. "before":
# the call raises instead of running; "after": it runs (donating what it donates) and then
# raises, as a failure after dispatch would; "none": the row allocator has none free.
FAULTS = [
    (ReqToTokenPool, "alloc", "before"),
    (ReqToTokenPool, "alloc", "none"),
    (PagedAllocator, "alloc_extend", "before"),
    (ReqToTokenPool, "write", "before"),
    (ReqToTokenPool, "write", "after"),
    (KVConnector, "lookup", "before"),
    (KVConnector, "load", "before"),
    (KVConnector, "load", "after"),
    (KVConnector, "store_async", "before"),
    (KVConnector, "store", "before"),
    (CompiledSteps, "__call__", "before"),
    (CompiledSteps, "__call__", "after"),
    (PagedAllocator, "alloc_decode", "before"),
    # The prefix cache's calls. Each is all or nothing itself, so a failure is one before it
    # changes anything; a lock taken that then failed is no failure mode of it. `load_back`
    # donates the pool, `evict` frees slots: both can also fail after doing so.
    (RadixCache, "match_prefix", "before"),
    (RadixCache, "match_prefix", "after"),
    (RadixCache, "inc_lock_ref", "before"),
    (RadixCache, "dec_lock_ref", "before"),
    (RadixCache, "load_back", "before"),
    (RadixCache, "load_back", "after"),
    (RadixCache, "insert", "before"),
    (RadixCache, "evict", "before"),
    (RadixCache, "evict", "after"),
]


def wrap(monkeypatch, cls, name, fault_at=None, mode="before"):
    """Replaces `cls.name` with a pass-through that counts its calls (`calls[0]`) and fails
    the one numbered `fault_at` as `mode` says."""
    real, calls = getattr(cls, name), [0]

    def call(self, *args, **kwargs):
        n, calls[0] = calls[0], calls[0] + 1
        if n != fault_at:
            return real(self, *args, **kwargs)
        if mode == "none":
            return None
        if mode == "after":
            real(self, *args, **kwargs)
        raise InjectedFault(f"{cls.__name__}.{name} call {n}")

    monkeypatch.setattr(cls, name, call)
    return calls


@pytest.mark.parametrize(
    "cls, name, mode", FAULTS, ids=[f"{c.__name__}.{n}-{m}" for c, n, m in FAULTS]
)
def test_a_failure_at_any_call_gives_everything_back(served, cls, name, mode):
    engine, want = served
    with pytest.MonkeyPatch.context() as mp:
        calls = wrap(mp, cls, name)
        engine.generate(SCENARIO)
    assert calls[0] > 0, f"{cls.__name__}.{name} is not on the serving path"
    for at in range(calls[0]):
        before = held(engine)
        with pytest.MonkeyPatch.context() as mp:
            wrap(mp, cls, name, fault_at=at, mode=mode)
            with pytest.raises((InjectedFault, RuntimeError)):
                engine.generate(SCENARIO)
        assert held(engine) == before, f"call {at} of {cls.__name__}.{name} kept what it took"
        assert_serves_like_a_fresh_engine(engine, want)


def test_a_strict_store_that_cannot_read_fails_the_call_and_nothing_else():
    class Unreadable(HostStore):
        strict = True

        def get_many(self, keys, *, stop_at_miss=False, strict=None):
            raise OSError("disk gone")

    model, params = small_model()
    store = Unreadable(1 << 20)
    engine = Engine(model, params, store=store, **ENGINE)
    engine.generate(SCENARIO[:1])  # computes and stores the prompt's blocks
    tree = engine.tree_cache
    tree.evict(tree.evictable_size(), pool=engine.pool)  # the device no longer holds them
    before = held(engine)
    for _ in range(2):  # the second call finds the engine as the first left it
        with pytest.raises(OSError, match="disk gone"):
            engine.generate(SCENARIO[:1])
        assert held(engine) == before
    engine.close()
