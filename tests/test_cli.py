"""The command line and the README: what a newcomer runs must work as written."""

import dataclasses
import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO as ROOT
from conftest import SMALL_DECODER, run_python

from jaxkv import bench, demo
from jaxkv.__main__ import main
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


def test_pool_walkthrough_example_verifies_every_pool():
    proc = run_python(str(ROOT / "examples" / "pool_walkthrough.py"), timeout=300)
    for name in ("MHA", "MLA", "K-only"):
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(name))
        assert line.endswith("bit-exact, in place"), line


@pytest.mark.slow  # every bench section, an 8-device child included
def test_bench_runs_every_section_and_target_and_writes_well_formed_json(tmp_path, capsys):
    # Every section and target at toy sizes, in this process: `--quick` itself runs the same
    # code at 16K-1M-token pools (minutes, gigabytes), which is the bench's job, not a test's.
    out = tmp_path / "bench.json"
    assert bench.run(json_path=str(out), sizes=bench.TINY) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["quick"] and res["sizes"] == json.loads(json.dumps(dataclasses.asdict(bench.TINY)))
    sections = {"machine", "updates", "connector", "hashing", "allocators", "async", "serving"}
    assert sections | {"targets"} <= set(res)
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
    remote = res["remote"]  # Redis rows, or the reason they were skipped
    assert remote["skipped"] or {
        r["store_round_trips"] for r in remote["rows"] if r["tier"] == "redis"
    } == {2}
    sharded = res["sharded"]  # a head-sharded pool on 8 devices, or why it was skipped
    if not sharded["skipped"]:
        split, one = sharded["connector"]["sharded"], sharded["connector"]["one"]
        assert split["bytes_per_shard"] * 8 == one["bytes_per_shard"] == split["bytes_total"]
    assert res["machine"]["backend"] and res["machine"]["device_kind"]
    assert res["serving"]["ttft"]["reused_tokens"] == bench.TINY.prefix
    assert all(r["jaxkv per layer"] > 0 for r in res["serving"]["decode"])
    # Updates: 5 targets on CPU, 4 on accelerators; connector 2; hashing 2; async 1; serving 2
    # on CPU, 1 on accelerators (the decode step's floor is the host's).
    assert len(res["targets"]) == (12 if cpu else 10)
    for target in res["targets"]:
        assert isinstance(target["value"], float) and target["value"] > 0, target
        value, limit = target["value"], target["limit"]
        assert target["ok"] == (value >= limit if target["at_least"] else value <= limit)
        verdict = "ok" if target["ok"] else "MISS"
        assert f"[{verdict}] {target['target']}: {value:.2f}" in printed
    titles = ("updates on", "connector (GB/s", "hashing (", "allocators (", "store_async:")
    assert all(title in printed for title in titles)


@pytest.mark.parametrize("kind", ("mha", "mla", "k_only"))
def test_bench_accelerator_contenders_run_here_too(kind, monkeypatch):
    """The accelerator-only update contenders (floors and the update over buffer lists), run
    on CPU so that CI calls them: a GPU is not where their code should first be run."""
    monkeypatch.setattr(bench, "accelerated", lambda: True)
    rng = np.random.default_rng(0)
    cases, reps, nbytes = bench._update_cases(kind, jnp.bfloat16, 256, 16, True, False, rng)
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
            "updates": [
                {
                    "kind": "mha",
                    "dtype": "bfloat16",
                    "tokens": 256,
                    "pool_tokens": n,
                    "jaxkv jit": 1e-5,
                    "jaxkv eager": 2e-5,
                    "naive JAX": n * 1e-9,
                }
                for n in (1 << 14, 1 << 18)
            ]
        }
        bench._plot(res, str(tmp_path / "p.png"))
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
