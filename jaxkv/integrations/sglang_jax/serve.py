"""sglang-jax's server with a jaxkv store under HiCache (the `storage` module's L3 tier).

    JAXKV_SGLANG_JAX_STORE=disk:/var/cache/kv \\
        python -m jaxkv.integrations.sglang_jax.serve --model-path ... --hicache-storage none

takes sglang-jax's server arguments (those of `python -m sgl_jax.launch_server`) and runs its
server with `storage.install()` done in this process and in every process it spawns: the
scheduler, which builds the tree, runs in one. The `JAXKV_SGLANG_JAX_*` variables configure the
tier (`storage.StoreSettings.from_env`).

`python -m jaxkv.integrations.sglang_jax.serve --jaxkv-check` instead spawns one process the way
sglang-jax starts its scheduler and reports from there whether the hook is installed and the
store answers; it exits with 0 when both hold, else 1.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Sequence

from jaxkv.integrations.sglang_jax import storage

_CHECK = "--jaxkv-check"


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


def _report(answers) -> None:
    """In the spawned process: whether the hook is installed and the store answers."""
    settings = storage.installed()
    if settings is None:
        answers.put((False, f"jaxkv's tree factory is not installed in process {os.getpid()}"))
        return
    try:
        store = storage.open_store(settings.store)
        store.contains_many(["0" * 64])
        errors = store.stats()["io_errors"]
    except Exception as err:
        answers.put((False, f"the store {settings.store!r} failed: {type(err).__name__}: {err}"))
        return
    if errors:
        answers.put((False, f"the store {settings.store!r} failed to answer (see the log)"))
        return
    answers.put(
        (
            True,
            f"the hook is installed in process {os.getpid()}, spawned by {os.getppid()}, "
            f"and its store {settings.store!r} ({type(store).__name__}) answers",
        )
    )


def check() -> int:
    """Spawns a process as sglang-jax starts its scheduler and prints its report; 0 when the
    hook is installed there and the store answers, else 1."""
    spawn = multiprocessing.get_context("spawn")
    answers = spawn.SimpleQueue()
    child = spawn.Process(target=_report, args=(answers,))
    child.start()
    child.join()
    if answers.empty():
        ok, line = False, f"the spawned process exited with {child.exitcode} and reported nothing"
    else:
        ok, line = answers.get()
    print(f"jaxkv: {line}")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> None:
    """Runs sglang-jax's server with `argv` (default: this program's arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == [_CHECK]:
        sys.exit(check())
    hicache = _hicache_storage(args)
    if hicache != "none":
        sys.exit(
            "jaxkv: pass --hicache-storage none to sglang-jax (jaxkv's store sits under "
            f"HiCache's host memory), got --hicache-storage {hicache}"
        )
    from sgl_jax.launch_server import main as launch

    sys.argv = [sys.argv[0], *args]
    launch()


if __name__ == "__main__":
    main()
