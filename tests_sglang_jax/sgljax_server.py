"""A real sglang-jax server on the CPU, for end-to-end tests (helpers; no tests here).

`Server.start(model_dir, log_path)` runs sglang-jax's own server (`python -m
sgl_jax.launch_server`, its source unchanged, from `SGLANG_JAX_SRC` on `PYTHONPATH`), or, with
`jaxkv_env=`, jaxkv's launcher (`python -m jaxkv.integrations.sglang_jax.serve`, the same
arguments plus `--hicache-storage none`, the `JAXKV_SGLANG_JAX_*` variables given). Requests
go over HTTP; `build_checkpoint` writes the tiny random model the servers load.

    with Server.start(model_dir, tmp / "server.log") as server:
        tokens, meta_info, ttft = server.generate(prompt, 8)
        server.flush_cache()

sglang-jax at commit cddbf6f has limits on this machine; each is worked around here, and only
here (neither sglang-jax nor jaxkv is changed):

- **Python 3.12 syntax on 3.11.** Only CPython 3.11 has a jaxlib wheel here, and one line of
  sglang-jax needs 3.12: `class _Communicator[T]:` (PEP 695) in
  `sgl_jax/srt/managers/tokenizer_manager.py`. Each server process gets a `sitecustomize.py`
  on its `PYTHONPATH` that installs `install_py311_hook`: an import hook that loads that one
  module from its file with the line spelled the 3.11 way (`typing.Generic[T]`, the TypeVar
  defined on the blank line before it, so line numbers stay). Nothing on disk changes, and
  the hook fails loudly if the line is no longer there.
- **The CPU.** `--device cpu --attention-backend native` (the default backend is a TPU
  Pallas kernel), and the small-memory flags of `SMALL_ARGS` (~1.5 GB over the server's
  processes). The native backend's prefill attends over the request table padded to the
  largest batch padding times the context length, so `SMALL_ARGS` holds one running request
  and 2,048 tokens of context: at 4 x 4,096 a 1,000-token prefill took ~15 s here, at
  1 x 2,048 about 1 s.
- **head_dim 128.** A 64-dim model fails in `o_proj` with a shape error on the CPU, so the
  checkpoint's heads are 128 wide.
- **Logprobs.** The scheduler dies (`TypeError` in `process_batch_result_decode`) when a
  request with logprobs and one without share a decode batch. `generate` never asks for
  logprobs, and the tests send one request at a time.
- **`/flush_cache` after a response.** It can answer 400 while the scheduler still holds the
  last batch; `flush_cache` retries for a bounded time.
- **An idle scheduler busy-polls a core.** One server at a time (the fixtures start the next
  one after the last one stopped); `stop` always ends the whole process group, with SIGKILL
  when a polite stop times out, and `Server` is a context manager. sglang-jax's own shutdown
  SIGKILLs its scheduler, so a store write still in flight then is lost: a test that restarts
  on a store folder waits for it to settle first (`wait_until_settled`).
- **"fired up" is printed even when the port bind failed.** The port is a free one, found
  here, and readiness is checked over HTTP: `/get_model_info` must name this server's model
  folder, and the log must show the warm-up done.

Every server's output goes to its log file; a start that fails raises with the log's tail.

The harness imports only the standard library at the top (the hook's `sitecustomize` imports
this module in every server process); `build_checkpoint` imports jax, safetensors and
tokenizers when called.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
DEFAULT_SOURCE = REPO_ROOT / ".." / "shared" / "peers" / "sglang-jax" / "python"

# sglang-jax's flags for a small CPU server: a few thousand tokens of KV, one request at a time
# (see the module's docstring for why not more), and compiled shapes limited to the ones the
# tests use (each padding is one XLA compile at start).
SMALL_ARGS = (
    "--device", "cpu",
    "--attention-backend", "native",
    "--max-total-tokens", "4096",
    "--max-running-requests", "1",
    "--chunked-prefill-size", "2048",
    "--max-prefill-tokens", "2048",
    "--context-length", "2048",
    "--precompile-bs-paddings", "1",
    "--precompile-token-paddings", "64", "256", "2048",
)  # fmt: skip

START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0
FLUSH_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
_READY_LINE = "The server is fired up and ready to roll!"

# The tiny model: what the tests need of it is that sglang-jax loads it as a Qwen2 and that
# greedy decoding is decisive (see build_checkpoint).
MODEL_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 8192,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_sliding_window": False,
}


# ---- the Python 3.11 hook (runs in the server's processes) ------------------------------------

_PATCHED_MODULE = "sgl_jax.srt.managers.tokenizer_manager"
_PEP695_LINE = "\n\nclass _Communicator[T]:"
# The blank line before the class becomes the TypeVar, so every line keeps its number.
_PY311_LINES = (
    '\nT = __import__("typing").TypeVar("T")\nclass _Communicator(__import__("typing").Generic[T]):'
)
_SITECUSTOMIZE = (
    "# Written by tests_sglang_jax/sgljax_server.py for the sglang-jax servers it starts.\n"
    "import sgljax_server\n\nsgljax_server.install_py311_hook()\n"
)


class _Py311Loader(importlib.abc.Loader):
    """Loads `_PATCHED_MODULE` from its file with the PEP 695 class line spelled for 3.11."""

    def __init__(self, path: str):
        self.path = path

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        with open(self.path, encoding="utf-8") as f:
            source = f.read()
        if source.count(_PEP695_LINE) != 1:
            raise ImportError(
                f"{self.path}: expected one line {_PEP695_LINE.strip()!r} to rewrite for "
                "Python 3.11 (sglang-jax at commit cddbf6f); found "
                f"{source.count(_PEP695_LINE)}: update sgljax_server's hook"
            )
        source = source.replace(_PEP695_LINE, _PY311_LINES)
        exec(compile(source, self.path, "exec"), module.__dict__)


class _Py311Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _PATCHED_MODULE or sys.version_info >= (3, 12):
            return None
        for entry in path or ():
            file = os.path.join(entry, fullname.rpartition(".")[2] + ".py")
            if os.path.isfile(file):
                return importlib.util.spec_from_file_location(
                    fullname, file, loader=_Py311Loader(file)
                )
        return None


def install_py311_hook() -> None:
    """Puts the finder first on `sys.meta_path` (once); `sitecustomize` calls it."""
    if not any(isinstance(f, _Py311Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Py311Finder())


# ---- the checkpoint ---------------------------------------------------------------------------


def build_checkpoint(folder: Path, *, seed: int = 0) -> Path:
    """Writes a random Qwen2 of `MODEL_CONFIG` into `folder`: `config.json`, bf16
    `model.safetensors`, a word-level `tokenizer.json` with its `tokenizer_config.json`.

    The weights' scales make greedy decoding decisive: the final norm gives unit-RMS states and
    the head's entries have std 0.5, so logits spread over tens of units and the top two are
    far apart next to bf16 rounding (a prefix read from a cache, a different padding or batch
    then yields the same tokens). Deterministic for one `seed`.

    Returns:
        `folder`.
    """
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from safetensors.flax import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    cfg = MODEL_CONFIG
    hidden, inter, heads, kv_heads, dim, vocab = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["vocab_size"],
    )
    shapes: dict[str, tuple[tuple[int, ...], float]] = {
        "model.embed_tokens.weight": ((vocab, hidden), 1.0),
        "model.norm.weight": ((hidden,), 0.0),
        "lm_head.weight": ((vocab, hidden), 0.5),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": ((hidden,), 0.0),
            f"{p}.post_attention_layernorm.weight": ((hidden,), 0.0),
            f"{p}.self_attn.q_proj.weight": ((heads * dim, hidden), 0.1),
            f"{p}.self_attn.q_proj.bias": ((heads * dim,), 0.1),
            f"{p}.self_attn.k_proj.weight": ((kv_heads * dim, hidden), 0.1),
            f"{p}.self_attn.k_proj.bias": ((kv_heads * dim,), 0.1),
            f"{p}.self_attn.v_proj.weight": ((kv_heads * dim, hidden), 0.1),
            f"{p}.self_attn.v_proj.bias": ((kv_heads * dim,), 0.1),
            f"{p}.self_attn.o_proj.weight": ((hidden, heads * dim), 0.05),
            f"{p}.mlp.gate_proj.weight": ((inter, hidden), 0.05),
            f"{p}.mlp.up_proj.weight": ((inter, hidden), 0.05),
            f"{p}.mlp.down_proj.weight": ((hidden, inter), 0.05),
        }
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (shape, std) in sorted(shapes.items()):
        # std 0 marks a norm's scale: ones, as a trained model's start.
        value = np.ones(shape) if std == 0.0 else std * rng.standard_normal(shape)
        tensors[name] = jnp.asarray(value.astype(ml_dtypes.bfloat16))

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))

    # Word-level: token i is the word "w{i}"; the first ids are the special tokens.
    specials = ["<unk>", "<s>", "</s>"]
    words = specials + [f"w{i}" for i in range(len(specials), vocab)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # sglang-jax's grammar backend (llguidance) reads the token strings through the decoder
    # and refuses a tokenizer without one; the words are ASCII, which byte-level keeps as is.
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": cfg["max_position_embeddings"],
            },
            indent=1,
        )
    )
    return folder


# ---- the server -------------------------------------------------------------------------------


def sglang_jax_source() -> Path:
    """sglang-jax's python/ folder: `SGLANG_JAX_SRC`, or the copy of shared/ beside the repo."""
    source = Path(os.environ.get("SGLANG_JAX_SRC") or DEFAULT_SOURCE).resolve()
    if not (source / "sgl_jax" / "launch_server.py").is_file():
        raise RuntimeError(
            f"SGLANG_JAX_SRC: expected sglang-jax's python/ folder (commit cddbf6f, holding "
            f"sgl_jax/launch_server.py), got {source}; set SGLANG_JAX_SRC to it"
        )
    return source


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"(no log: {err})"
    return "\n".join(text.splitlines()[-lines:])


class ServerError(RuntimeError):
    """A server that did not start, died, or answered a request with an error."""


class Server:
    """One sglang-jax server process group; see the module's docstring.

    Attributes:
        url: `http://127.0.0.1:PORT`.
        log_path: the file its stdout and stderr go to.
        start_seconds: from the process start to ready.
    """

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, model_dir: Path):
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.model_dir = model_dir
        self.start_seconds = float("nan")

    # -- lifecycle

    @classmethod
    def start(
        cls,
        model_dir: Path,
        log_path: Path,
        *,
        jaxkv_env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        timeout_s: float = START_TIMEOUT_S,
    ) -> Server:
        """Starts a server on `model_dir` and waits until it serves.

        Args:
            model_dir: a checkpoint folder (`build_checkpoint`).
            log_path: the server's output goes there (its folder also gets the hook's
                `sitecustomize.py`, in a subfolder).
            jaxkv_env: `None` runs sglang-jax's own server; a mapping runs jaxkv's launcher
                with `--hicache-storage none` and these variables (`JAXKV_SGLANG_JAX_STORE`...).
            extra_args: more sglang-jax server arguments.
            timeout_s: how long to wait for it to serve.

        Raises:
            ServerError: it exited or did not serve in time (with its log's tail); the
                process group is killed first.
        """
        source = sglang_jax_source()
        log_path = Path(log_path)
        site = log_path.parent / f"{log_path.stem}-site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)

        env = dict(os.environ)
        # The test process's conftest asks XLA for two CPU devices; a server has one.
        env.pop("XLA_FLAGS", None)
        env["JAX_PLATFORMS"] = "cpu"
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(source), str(HERE)])
        env["PYTHONUNBUFFERED"] = "1"  # the log shows progress as it happens
        port = free_port()
        args = [
            "--model-path", str(model_dir),
            "--host", "127.0.0.1",
            "--port", str(port),
            *SMALL_ARGS,
            *extra_args,
        ]  # fmt: skip
        if jaxkv_env is None:
            module = "sgl_jax.launch_server"
        else:
            module = "jaxkv.integrations.sglang_jax.serve"
            args += ["--hicache-storage", "none"]
            env.update(jaxkv_env)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"$ {module} {' '.join(args)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: `stop` ends all of it
            )
        server = cls(proc, f"http://127.0.0.1:{port}", log_path, Path(model_dir))
        began = time.monotonic()
        try:
            server._wait_ready(began + timeout_s)
        except BaseException:
            server.kill()
            raise
        server.start_seconds = time.monotonic() - began
        return server

    def _wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"the server exited with {self.proc.returncode} before serving; "
                    f"{self.log_path}:\n{log_tail(self.log_path)}"
                )
            if _READY_LINE in self.log_path.read_text(errors="replace"):
                try:
                    info = self._get("/get_model_info", timeout_s=5)
                except (OSError, ServerError):
                    info = {}
                # The log says ready even when the bind failed: only this server's answer
                # counts.
                if Path(info.get("model_path", "")) == self.model_dir:
                    return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"the server did not serve within its start timeout; {self.log_path}:\n"
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the launcher, then SIGKILL to whatever is left of its process group once
        it exited or `timeout_s` passed. Idempotent."""
        if self.proc.poll() is None:
            # The launcher alone, as a user's `kill` would: sglang-jax's own shutdown then ends
            # its children.
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        self.kill()

    def kill(self) -> None:
        """SIGKILL to the whole process group (the launcher, its scheduler, its detokenizer)."""
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests

    def generate(
        self, input_ids: Sequence[int], max_new_tokens: int = 8
    ) -> tuple[list[int], dict[str, Any], float]:
        """Greedy tokens for `input_ids` (`ignore_eos`, no logprobs), streamed.

        Returns:
            (the new token ids, the last chunk's `meta_info`, seconds from sending the request
            to the first streamed chunk holding a token).
        """
        body = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
            "stream": True,
        }
        request = urllib.request.Request(
            self.url + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        sent = time.perf_counter()
        first = None
        last: dict[str, Any] | None = None
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise self._failure(f"/generate streamed an error: {chunk['error']}")
                    if first is None and chunk.get("output_ids"):
                        first = time.perf_counter() - sent
                    last = chunk
        except urllib.error.HTTPError as err:
            raise self._failure(f"/generate: HTTP {err.code}: {err.read()[:500]!r}") from err
        except OSError as err:  # refused, reset, timed out: the server died or hangs
            raise self._failure(f"/generate: {err!r}") from err
        if last is None or first is None:
            raise self._failure("/generate streamed no tokens")
        # Without --stream-output each chunk holds all the tokens so far.
        return list(last["output_ids"]), last["meta_info"], first

    def flush_cache(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Empties the server's tree (device and host pages), retrying while it answers 400:
        right after a response the scheduler may still hold the finished batch."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(self.url + "/flush_cache", method="POST"),
                    timeout=REQUEST_TIMEOUT_S,
                ):
                    return
            except urllib.error.HTTPError as err:
                if err.code != 400 or time.monotonic() > deadline:
                    raise self._failure(
                        f"/flush_cache: HTTP {err.code}: {err.read()[:500]!r}"
                    ) from err
            except OSError as err:
                raise self._failure(f"/flush_cache: {err!r}") from err
            time.sleep(0.2)

    def _failure(self, what: str) -> ServerError:
        state = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        return ServerError(f"{what} (server {state}); {self.log_path}:\n{log_tail(self.log_path)}")

    def _get(self, path: str, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as response:
            return json.loads(response.read())


def wait_until_settled(folder: Path, *, quiet_s: float = 2.0, timeout_s: float = 60.0) -> int:
    """Waits until `folder` holds files and their count stays the same for `quiet_s`: a
    `DiskStore`'s background writes have landed. Returns the count.

    Raises:
        TimeoutError: the folder stayed empty or kept changing for `timeout_s`.
    """
    return wait_until_count_settles(
        lambda: sum(1 for p in folder.rglob("*") if p.is_file()),
        f"{folder}: files",
        quiet_s=quiet_s,
        timeout_s=timeout_s,
    )


def wait_until_count_settles(
    count: Callable[[], int], what: str, *, quiet_s: float = 2.0, timeout_s: float = 60.0
) -> int:
    """Waits until `count()` is above 0 and stays the same for `quiet_s` (a store's records:
    files in a folder, keys in a Redis database), polling it. Returns the count.

    Raises:
        TimeoutError: it stayed 0 or kept changing for `timeout_s`; `what` names it.
    """
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif last > 0 and time.monotonic() - since >= quiet_s:
            return last
        time.sleep(0.2)
    raise TimeoutError(f"{what}: {last}, still 0 or changing after {timeout_s} s")


_HOST_POOL_LINE = re.compile(r"HiCache enabled: host pool=\d+ pages \(page_size=\d+, ~(\d+) tokens")


def host_pool_tokens(log_path: Path) -> int:
    """The tokens HiCache's host pool holds, from the line sglang-jax's `init_hicache` logs
    (`--hicache-ratio` times the device pool's size).

    Raises:
        ServerError: the log has no such line (HiCache off, or sglang-jax changed it).
    """
    found = _HOST_POOL_LINE.findall(Path(log_path).read_text(errors="replace"))
    if not found:
        raise ServerError(f"{log_path}: no 'HiCache enabled: host pool=...' line")
    return int(found[-1])
