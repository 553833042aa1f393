"""sglang-jax's server with a jaxkv store under HiCache (the `storage` module's L3 tier).

    JAXKV_SGLANG_JAX_STORE=disk:/var/cache/kv \\
        python -m jaxkv.integrations.sglang_jax.serve --model-path ... --hicache-storage none

takes sglang-jax's server arguments (those of `python -m sgl_jax.launch_server`) and runs its
server with `storage.install()` done in this process and in every process it spawns: the
scheduler, which builds the tree, runs in one. The `JAXKV_SGLANG_JAX_*` variables configure the
tier (`storage.StoreSettings.from_env`).

`--jaxkv-check`, wherever it stands among the arguments, runs a check instead of the server:
the other arguments, if any, are checked as the launch would check them (`--hicache-storage
none`), then one process is spawned the way sglang-jax starts its scheduler, and it reports
from there whether the hook is installed and the store works: it writes a probe record under
the reserved key `PROBE_KEY`, reads it back, compares it and removes it (each tier of a tiered
store in turn). The report goes to stdout when both hold (exit status 0), else to stderr with
the cause: the step that failed, the exception and the store's spec (exit status 1).
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import sys
from collections.abc import Sequence

import numpy as np

from jaxkv.connector import BlockRecord, BlockStore
from jaxkv.integrations.sglang_jax import storage
from jaxkv.integrations.sglang_jax._store_settings import spec_parts

_CHECK = "--jaxkv-check"
#: The key of the check's probe record, reserved: the sha256 of a constant string, where a
#: block's key hashes its namespace, layout and tokens, so a check never overwrites or removes
#: a block. Nothing else may be stored under it.
PROBE_KEY = hashlib.sha256(b"jaxkv.integrations.sglang_jax.serve: probe record").hexdigest()


def _install() -> None:
    try:
        storage.install()
    except ValueError as err:  # the environment's settings: say which, without a traceback
        sys.exit(f"jaxkv: {err}")


# Run as the program (`__main__`), and again in every process multiprocessing spawns from it:
# spawned children import the parent's main module under the name `__mp_main__` before they
# run their target, which is how the hook reaches sglang-jax's scheduler. Imported any other
# way, this module installs nothing.
if __name__ in ("__main__", "__mp_main__"):
    _install()


def _hicache_storage(argv: Sequence[str]) -> str:
    """The `--hicache-storage` value among sglang-jax's arguments (its default: disable)."""
    value = "disable"
    for i, arg in enumerate(argv):
        if arg == "--hicache-storage" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--hicache-storage="):
            value = arg.partition("=")[2]
    return value


def _probe_record() -> BlockRecord:
    parts = {"probe": (np.arange(4096) % 251).astype(np.uint8).reshape(1, 16, 256)}
    return BlockRecord(key=PROBE_KEY, layout="jaxkv-probe", tokens="jaxkv-probe", parts=parts)


def _same(got: BlockRecord, want: BlockRecord) -> bool:
    names = (got.key, got.layout, got.tokens, list(got.parts))
    if names != (want.key, want.layout, want.tokens, list(want.parts)):
        return False
    return all(
        got.parts[n].dtype == a.dtype and np.array_equal(got.parts[n], a)
        for n, a in want.parts.items()
    )


def probe(store: BlockStore) -> str | None:
    """Writes the probe record (`PROBE_KEY`) to `store`, reads it back, compares it and removes
    it, each call strict; None when every step worked, else the step that failed and why."""
    record = _probe_record()
    step = "writing"
    try:
        stored = store.put_many([record], strict=True).answer(True)[0]
        if not stored:  # maybe a probe an interrupted check left behind: once more without it
            store.discard_many([PROBE_KEY], strict=False)
            stored = store.put_many([record], strict=True).answer(True)[0]
        if not stored:
            return f"{step} the probe record: the store did not keep it"
        step = "reading back"
        got = store.get_many([PROBE_KEY], strict=True).answer(True)[0]
        if got is None or not _same(got, record):
            answered = "nothing" if got is None else "another record"
            return f"{step} the probe record: the store answered {answered}"
        step = "removing"
        if not store.discard_many([PROBE_KEY], strict=True).answer(True)[0]:
            return f"{step} the probe record: the store did not remove it"
        if store.contains_many([PROBE_KEY], strict=True).answer(True)[0]:
            return f"{step} the probe record: the store still holds it"
    except Exception as err:
        return f"{step} the probe record failed: {type(err).__name__}: {err}"
    return None


class _Warnings(logging.Handler):
    """The warnings of the `jaxkv` logger while attached: the causes a store that answers a
    failure as a miss (a `RedisStore` whose server is gone) logs but does not report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _probe_spec(store: BlockStore, spec: str) -> str | None:
    """Probes `store`, opened from `spec` (each tier of a tiered store in turn: a write lands
    in every tier, a read in the first that holds the record, so only a tier's own probe
    proves it); None when it works, else why not."""
    parts = [arg if kind == "redis" else f"{kind}:{arg}" for kind, arg in spec_parts(spec)]
    for part, tier in zip(parts, getattr(store, "tiers", (store,))):
        failure = probe(tier)
        if failure is not None:
            return failure if len(parts) == 1 else f"its part {part!r}: {failure}"
    return None


def _report(answers) -> None:
    """In the spawned process: whether the hook is installed and the store works."""
    settings = storage.installed()
    if settings is None:
        answers.put((False, f"jaxkv's tree factory is not installed in process {os.getpid()}"))
        return
    logger, warnings = logging.getLogger("jaxkv"), _Warnings()
    logger.addHandler(warnings)
    try:
        store = storage.open_store(settings.store)
    except Exception as err:
        failure: str | None = f"opening it failed: {type(err).__name__}: {err}"
    else:
        failure = _probe_spec(store, settings.store)  # each step's failure caught and named
    finally:
        logger.removeHandler(warnings)
    if failure is not None:
        logged = "".join(f"; it logged: {line}" for line in warnings.lines)
        answers.put((False, f"the store {settings.store!r} failed: {failure}{logged}"))
        return
    answers.put(
        (
            True,
            f"the hook is installed in process {os.getpid()}, spawned by {os.getppid()}, "
            f"and its store {settings.store!r} ({type(store).__name__}) works: a probe record "
            "was written, read back and removed",
        )
    )


def check() -> int:
    """Spawns a process as sglang-jax starts its scheduler and prints its report (stdout when
    the hook is installed there and the store works, returning 0; else stderr, returning 1)."""
    spawn = multiprocessing.get_context("spawn")
    answers = spawn.SimpleQueue()
    child = spawn.Process(target=_report, args=(answers,))
    child.start()
    child.join()
    if answers.empty():
        ok, line = False, f"the spawned process exited with {child.exitcode} and reported nothing"
    else:
        ok, line = answers.get()
    print(f"jaxkv: {line}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> None:
    """Runs sglang-jax's server with `argv` (default: this program's arguments); with
    `--jaxkv-check` among them, the check instead (see the module)."""
    args = list(sys.argv[1:] if argv is None else argv)
    checking = _CHECK in args
    args = [arg for arg in args if arg != _CHECK]
    hicache = _hicache_storage(args)
    if hicache != "none" and (args or not checking):
        sys.exit(
            "jaxkv: pass --hicache-storage none to sglang-jax (jaxkv's store sits under "
            f"HiCache's host memory), got --hicache-storage {hicache}"
        )
    if checking:
        sys.exit(check())
    from sgl_jax.launch_server import main as launch

    sys.argv = [sys.argv[0], *args]
    launch()


if __name__ == "__main__":
    main()
