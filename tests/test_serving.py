"""The serving loop over jaxkv: prefix reuse, no retracing, in-place pools, the demo program."""

import io
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_DECODER as SMALL
from conftest import run_python

from jaxkv import demo
from jaxkv.connector import DiskStore, HostStore
from jaxkv.models import LOGIT_BOUNDS, Decoder, DecoderConfig, Engine, Request

ROOT = Path(__file__).resolve().parents[1]
BF16 = jnp.dtype(jnp.bfloat16)
ENGINE = dict(pool_size=1024, page_size=16, max_batch=4, max_context=128)


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


def pointers(pool):
    return [leaf.unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(pool)]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_prefix_reuse_from_host_store_equals_no_reuse(attention):
    model, params = small_model(attention)
    requests = shared_prefix_requests()
    plain = Engine(model, params, **ENGINE).generate(requests)
    engine = Engine(model, params, store=HostStore(1 << 26), **ENGINE)
    reused = engine.generate(requests)
    for a, b in zip(plain, reused):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=LOGIT_BOUNDS[BF16])
    # The first request computed the prefix and offloaded it; the others loaded its 4 full
    # blocks (64 of the 70 shared tokens) and prefilled only the rest.
    assert [r.reused_tokens for r in reused] == [0, 64, 64, 64]
    stats = engine.connector.stats()
    assert stats["blocks_stored"] > 0 and stats["blocks_loaded"] == 12
    assert engine.stats["prefill_tokens"] == engine.stats["prompt_tokens"] - 3 * 64
    engine.close()


@pytest.mark.slow  # a second interpreter; the whole demo twice
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
    plain = Engine(model, params, **ENGINE).generate(requests)
    engine = Engine(model, params, store=DiskStore(tmp_path), **ENGINE)
    reused = engine.generate(requests)
    engine.close()
    # This process never computed the prefix: even the first request loads it from disk.
    assert [r.reused_tokens for r in reused] == [64, 64, 64, 64]
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


def test_serving_steps_keep_the_pool_in_place():
    model, params = small_model("mla")
    engine = Engine(model, params, store=HostStore(1 << 26), **ENGINE)
    before = pointers(engine.pool)
    engine.generate(shared_prefix_requests(seed=4))
    # Prefill, decode and the connector's loads all wrote into the same buffers.
    assert pointers(engine.pool) == before
    assert engine.stats["decode_steps"] > 0 and engine.stats["reused_tokens"] > 0
    engine.close()


def test_one_decode_step_writes_its_row_in_place():
    model, params = small_model()
    engine = Engine(model, params, **ENGINE)
    pool = engine.pool
    before = pointers(pool)
    # Row 1 maps positions 0..5 to slots 32..37: five cached tokens and the step's new one,
    # written at slot 37; entry 1 is padding (row 0, its write dropped). Context 128: the
    # bucket the other tests' decode steps compiled at this batch size.
    table = engine.req_to_token.write(1, 0, np.arange(32, 38)).req_to_token
    logits, pool = engine.steps(
        params, pool, table, np.array([1, 0], np.int32), np.array([[7], [0]], np.int32),
        np.array([5, 0], np.int32), np.array([1, 0], np.int32), np.array([[37], [-1]], np.int32),
        ctx=128,
    )  # fmt: skip
    assert pointers(pool) == before
    assert logits.shape == (2, model.cfg.vocab_size)
    k = np.asarray(pool.get_key_buffer(0), np.float32)
    assert np.abs(k[37]).sum() > 0 and np.abs(k[38:]).sum() == 0


def test_engine_rejects_bad_requests_and_tiny_pools():
    model, params = small_model()
    engine = Engine(model, params, **ENGINE)
    with pytest.raises(ValueError, match=r"requests\[0\]: prompt \(130\).*max_context=128"):
        engine.generate([Request(np.zeros(130, np.int32), 1)])
    with pytest.raises(ValueError, match=r"requests\[1\]: expected a non-empty prompt"):
        engine.generate([Request(np.zeros(3, np.int32), 1), Request(np.zeros(0, np.int32), 1)])
    with pytest.raises(ValueError, match=r"requests\[0\]: expected token ids in \[0, 258\)"):
        engine.generate([Request(np.array([3, 258]), 1)])
    tiny = Engine(model, params, pool_size=32, page_size=16, max_batch=2, max_context=128)
    with pytest.raises(RuntimeError, match="pool too small"):
        tiny.generate([Request(np.zeros(40, np.int32), 2)])
    # 32 prompt tokens fill both pages; the first decode token needs a third.
    with pytest.raises(RuntimeError, match="no page left for 1 decoding requests"):
        tiny.generate([Request(np.zeros(32, np.int32), 3)])
    # The failed call gave its slots and row back: the engine still serves.
    assert tiny.allocator.available_size() == 32
    assert len(tiny.generate([Request(np.zeros(20, np.int32), 2)])[0].tokens) == 2


def test_requests_beyond_the_batch_wait_and_get_the_same_tokens():
    model, params = small_model()
    requests = shared_prefix_requests(seed=9, new_tokens=3)
    wide = Engine(model, params, **ENGINE).generate(requests)
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
        "tokens not recomputed",
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


def test_fp8_pool_serves_with_reuse():
    model, params = small_model("gqa")
    requests = shared_prefix_requests(seed=11)
    kw = {**ENGINE, "dtype": jnp.float8_e4m3fn}
    plain = Engine(model, params, **kw).generate(requests)
    reused = Engine(model, params, store=HostStore(1 << 26), **kw).generate(requests)
    assert [r.reused_tokens for r in reused] == [0, 64, 64, 64]
    for a, b in zip(plain, reused):
        np.testing.assert_array_equal(a.tokens, b.tokens)


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
