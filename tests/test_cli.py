"""The command line and the README: what a newcomer runs must work as written."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO as ROOT
from helpers import SMALL_DECODER, require, run_example
from redis_server import MISSING, LocalRedis

from jaxkv import bench, demo
from jaxkv.__main__ import main
from jaxkv.bench import _allocators, _hashing, _plot, _radix, _remote, _targets, _updates
from jaxkv.models import DecoderConfig


def test_demo_serves_with_every_option_and_verifies(capsys, monkeypatch, tmp_path):
    # The command line in this process, on the tests' small decoder: the real-size demo is
    # the README's first command, which CI runs as it is written.
    small = DecoderConfig(**SMALL_DECODER)
    monkeypatch.setattr(demo, "DecoderConfig", lambda: small)
    args = ["demo", "--attention", "mla", "--store", "disk", "--dtype", "fp8"]
    args += ["--requests", "2", "--new-tokens", "3", "--cache-dir", str(tmp_path)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "MLAPool, fp8 pool, page size 16, disk store" in out
    assert "verification: OK" in out
    hits = next(ln for ln in out.splitlines() if ln.startswith("requests with a prefix"))
    assert hits.split()[-2:] == ["0/2", "1/2"]
    # Not a terminal: no progress bar on stderr.
    assert "%" not in err


def test_demo_rejects_bad_counts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--requests", "0"])
    assert exit_info.value.code == 2
    assert "--requests and --new-tokens must be at least 1" in capsys.readouterr().err


def test_pool_walkthrough_example_verifies_every_pool(capsys):
    assert run_example("pool_walkthrough.py") == 0
    out = capsys.readouterr().out
    for name in ("MHA", "MLA", "K-only"):
        line = next(ln for ln in out.splitlines() if ln.startswith(name))
        assert line.endswith("bit-exact, in place"), line


def _redis_or_skip() -> None:
    """Skips (fails under CI, which installs both) without redis-server or redis-py."""
    try:
        import redis  # noqa: F401
    except ImportError:
        reason = "redis-py is not installed (`pip install 'jaxkv[redis]'`)"
    else:
        reason = None if LocalRedis.available() else MISSING
    require([reason] if reason else [], "the bench's Redis rows")


@pytest.mark.slow  # every bench section, an 8-device child included
def test_bench_runs_every_section_and_target_and_writes_well_formed_json(tmp_path, capsys):
    # Every section and target at toy sizes, in this process: `--quick` itself runs the same
    # code at 16K-256K-token pools (a minute or two, a few GB), which is the bench's job.
    _redis_or_skip()
    out = tmp_path / "bench.json"
    with LocalRedis() as server:
        assert bench.run(json_path=str(out), sizes=bench.TINY, redis_url=server.url) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["quick"] and res["sizes"] == json.loads(json.dumps(dataclasses.asdict(bench.TINY)))
    assert {s.key for s in bench.SECTIONS} | {"machine", "targets"} <= set(res)
    # Each backend is measured against its own floors: host numpy and memcpy on CPU, a device
    # copy and the plain donated scatter on accelerators (and the same update over buffer
    # lists, which tells the pool pytree's host cost apart).
    cpu = res["machine"]["backend"] == "cpu"
    accelerator_floors = {"device copy", "plain donated .at[].set", "jaxkv jit over buffer lists"}
    floors = {"memcpy", "numpy in-place"} if cpu else accelerator_floors
    contenders = {"jaxkv eager", "jaxkv jit"}
    for row in res["updates"]:
        assert contenders <= set(row) and all(row[c] > 0 for c in contenders)
    assert any(floors | {"naive JAX"} <= set(r) for r in res["updates"])
    for row in res["connector"]:
        assert all(row[k] > 0 for k in ("export_GBps", "store_GBps", "load_GBps"))
    remote = res["remote"]  # host, disk and the server given: one round trip per call
    assert remote["redis_skipped"] is None
    assert {r["tier"] for r in remote["rows"]} == {"host", "disk", "redis"}
    trips = [(r["store_round_trips"], r["load_round_trips"]) for r in remote["rows"]
             if r["tier"] == "redis"]  # fmt: skip
    assert trips and set(trips) == {(2, 1)}
    sharded = res["sharded"]  # a head-sharded pool on 8 devices, or why it was skipped
    if not sharded["skipped"]:
        split, one = sharded["connector"]["sharded"], sharded["connector"]["one"]
        assert split["bytes_per_shard"] * 8 == one["bytes_per_shard"] == split["bytes_total"]
    assert res["machine"]["backend"] and res["machine"]["device_kind"]
    ttft = res["serving"]["ttft"]
    assert ttft["reused_tokens"] == ttft["device_tokens"] == bench.TINY.prefix
    assert all(ttft[k] > 0 for k in ("no reuse", "device hit", "bare step", "reuse from HostStore"))
    assert all(r["jaxkv per layer"] > 0 for r in res["serving"]["decode"])
    radix = res["radix"]  # jaxkv's tree, and SGLang's where it imports
    assert all(r["jaxkv ops/s"] > 0 for r in radix["rows"])
    # Updates: 5 targets on CPU, 4 on accelerators; connector 2; hashing 2; async 1; serving 4
    # on CPU, 3 on accelerators (the decode step's floor is the host's); the prefix cache 1
    # where SGLang imports.
    assert len(res["targets"]) == (14 if cpu else 12) + (radix["skipped"] is None)
    for target in res["targets"]:
        assert isinstance(target["value"], float) and target["value"] > 0, target
        value, limit = target["value"], target["limit"]
        assert limit == bench.TARGETS[target["key"]].quick  # TINY uses --quick's limits
        assert target["ok"] == (value >= limit if target["at_least"] else value <= limit)
        verdict = "ok" if target["ok"] else "MISS"
        assert f"[{verdict}] {target['target']}: {value:.2f}" in printed
    titles = ("updates on", "connector (GB/s", "store tiers (", "hashing (", "allocators (")
    titles += ("prefix cache (",)
    assert all(title in printed for title in titles + ("store_async:", "reference decoder"))


def test_bench_prefix_cache_section_without_sglang_says_why(monkeypatch, capsys):
    # Whether or not SGLang is installed here: the section measures jaxkv's tree alone and says
    # why SGLang's rows are missing when its tree does not import.
    monkeypatch.setattr(_radix, "_sglang", lambda: (None, "no SGLang in this test"))
    setting = bench.Setting(bench.TINY, jax.default_backend())
    res = _radix.measure(setting)
    assert res["skipped"] == "no SGLang in this test"
    assert {(r["shared"], r["page_size"]) for r in res["rows"]} == {
        (s, p) for s in _radix.STREAMS for p in _radix.PAGES
    }
    for row in res["rows"]:
        assert row["jaxkv ops/s"] > 0 and "SGLang ops/s" not in row
        assert row["cached_tokens"] >= 4096  # the tree filled and evicted (TINY: 4K cached)
    assert _radix.targets(res, setting) == []  # nothing to compare: no target, not a miss
    _radix.report(res, setting)
    assert "SGLang rows skipped: no SGLang in this test" in capsys.readouterr().out


def _cheap_sections(monkeypatch) -> None:
    """`--quick` at TINY sizes with two sections of host work (a second or two), whose two
    targets (block hashing's) never miss unless a test lowers a limit."""
    monkeypatch.setattr(bench, "QUICK", bench.TINY)
    monkeypatch.setattr(bench, "SECTIONS", [_hashing.SECTION, _allocators.SECTION])
    for key in ("hashing.block16", "hashing.block256"):
        monkeypatch.setitem(bench.TARGETS, key, _targets.Target(1e9, 1e9, "never missed"))


def test_bench_check_exits_1_naming_each_missed_target(monkeypatch, capsys, tmp_path):
    _cheap_sections(monkeypatch)
    assert main(["bench", "--quick", "--check"]) == 0  # every target held
    assert "--check:" not in capsys.readouterr().out
    monkeypatch.setitem(bench.TARGETS, "hashing.block16", _targets.Target(9.0, 0.0, "missed"))
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--check", "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    missed = [t for t in json.loads(out.read_text())["targets"] if not t["ok"]]
    assert [(t["key"], t["limit"]) for t in missed] == [("hashing.block16", 0.0)]
    tail = printed[printed.index("--check: 1 of 2 targets missed") :]
    assert f"{missed[0]['target']}: measured {missed[0]['value']:.2f}, limit at most 0.0" in tail
    # Without --check the same miss is reported in the targets table and the run succeeds.
    assert main(["bench", "--quick"]) == 0
    printed = capsys.readouterr().out
    assert f"[MISS] {missed[0]['target']}: " in printed and "--check:" not in printed


def test_bench_rejects_a_redis_url_it_cannot_use_before_running(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(bench, "SECTIONS", [bench.Section("x", ran.append, print)])
    assert main(["bench", "--quick", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert not ran and "--redis-url redis://127.0.0.1:1/0: " in capsys.readouterr().err


def test_bench_store_tiers_without_a_redis_url_say_how_to_add_them(capsys):
    setting = bench.Setting(bench.TINY, jax.default_backend())
    res = _remote.measure(setting)
    assert {r["tier"] for r in res["rows"]} == {"host", "disk"}
    _remote.report(res, setting)
    assert "Redis rows skipped: no --redis-url given" in capsys.readouterr().out
    assert "--redis-url redis://HOST:6379/0" in res["redis_skipped"]


def test_bench_store_tiers_leave_nothing_on_the_redis_server_given():
    _redis_or_skip()
    import redis

    with LocalRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.set("the-users-own-key", b"1")
        setting = bench.Setting(bench.TINY, jax.default_backend(), server.url)
        res = _remote.measure(setting)
        assert [r["blocks"] for r in res["rows"] if r["tier"] == "redis"] == [1, 4]
        assert client.keys("*") == [b"the-users-own-key"]
        client.close()


def test_docs_state_every_target_limit_per_size_set():
    text = (ROOT / "docs" / "cli.md").read_text()
    rows = {ln.split("|")[1].strip(): ln for ln in text.splitlines() if ln.startswith("| `")}
    for key, spec in bench.TARGETS.items():
        cells = [c.strip() for c in rows[f"`{key}`"].split("|")[1:-1]]
        bound = "at least" if spec.at_least else "at most"
        assert cells[1:4] == [bound, f"{spec.full:g}", f"{spec.quick:g}"], key


@pytest.mark.parametrize("kind", ("mha", "mla", "k_only"))
def test_bench_accelerator_contenders_run_here_too(kind):
    """The accelerator-only update contenders (floors and the update over buffer lists), run
    on CPU so that CI calls them: a GPU is not where their code should first be run."""
    rng = np.random.default_rng(0)
    cases, reps, nbytes = _updates.update_cases(
        kind, jnp.bfloat16, 256, 16, naive=True, numpy_base=False, accel=True, rng=rng
    )
    assert reps == 64 and nbytes > 0
    assert set(cases) == {
        "jaxkv eager", "jaxkv jit", "jaxkv jit raw bits", "naive JAX",
        "plain donated .at[].set", "jaxkv jit over buffer lists", "device copy",
    }  # fmt: skip
    for run in cases.values():
        run()


def test_bench_plot_without_matplotlib_or_with_it(tmp_path, capsys):
    # --plot needs the optional `bench` extra; without it the command says so and exits 2.
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(["bench", "--quick", "--plot", str(tmp_path / "p.png")]) == 2
        assert "jaxkv[bench]" in capsys.readouterr().err
    else:
        res = {
            "machine": {"backend": "cpu"},
            "sizes": dataclasses.asdict(bench.QUICK),
            "updates": [
                {
                    "kind": "mha",
                    "dtype": "bfloat16",
                    "tokens": bench.QUICK.tokens[1],
                    "pool_tokens": n,
                    "jaxkv jit": 1e-5,
                    "jaxkv eager": 2e-5,
                    **({"naive JAX": n * 1e-9} if n <= bench.QUICK.naive_pool else {}),
                }
                for n in bench.QUICK.pools
            ],
        }
        _plot.plot(res, str(tmp_path / "p.png"))
        assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_readme_usage_snippet_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = code.replace("/tmp/jaxkv-cache", str(tmp_path / "cache"))
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["n"] == 32


def test_readme_shows_the_two_newcomer_commands():
    text = (ROOT / "README.md").read_text()
    assert "pip install -e . && python -m jaxkv demo" in text
    assert 'pip install -e ".[test]" && python -m pytest' in text
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
