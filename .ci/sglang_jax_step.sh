#!/usr/bin/env bash
# CI step: sglang-jax (sgl-project/sglang-jax at commit cddbf6f) in its own environment.
#
# 1. .venv-sglang-jax: jaxkv with its test extra, plus what sglang-jax's memory-pool modules and
#    their tests import (.ci/sglang-jax-requirements.txt says why each is there). sglang-jax is
#    not installed: its source goes on PYTHONPATH (its pyproject asks for Python >= 3.12; the
#    source runs on 3.11). SGLANG_JAX_SRC names its python/ folder; the default is the copy of
#    shared/ beside the repository (../shared/peers/sglang-jax/python).
# 2. sglang-jax's own mem_cache tests on the CPU, under its CPU shim (its mem_cache conftest),
#    without the TPU-only files (*_tpu*). test_unified_radix_cache.py runs in a process of its
#    own with the 8 CPU devices its files ask for: its data-parallel test builds a mesh of two
#    data ranks, which one device cannot hold. The others run on one device, as their mesh
#    setup expects.
# 3. sglang-jax's HiCache tests (test_host_kv_pool.py, test_hicache_controller.py,
#    test_hicache_e2e.py) again, on jaxkv's LRUHostKVPool: the hicache_on_jaxkv plugin
#    (tests_sglang_jax/hicache_on_jaxkv.py) swaps the class in before they import it and
#    deselects the white-box tests of sglang-jax's own implementation it lists; it fails the
#    run when a listed test is gone or the swap did not take.
# 4. tests_sglang_jax/: jaxkv against sglang-jax's pools (test_server.py apart, step 5); the
#    persistent tier on Mooncake runs against real mooncake_master and mooncake_client
#    processes (the `mooncake` extra; .ci/run installs the libraries their binaries need).
# 5. tests_sglang_jax/test_server.py: sglang-jax's own server (python -m sgl_jax.launch_server)
#    and jaxkv's launcher, started on the CPU on a tiny random checkpoint, over HTTP; it needs
#    what the server imports besides (.ci/sglang-jax-server-requirements.txt, installed into
#    the same environment). One server at a time, each 30-80 s to start: its own timed run.
#
# pytest's exit 5 ("no tests collected") is a failure, and with CI set a skipped test fails the
# run (tests_sglang_jax/ci_no_skips.py). Prints the install time and each run's time and peak
# memory. Bytecode goes under the environment (PYTHONPYCACHEPREFIX), never into the sglang-jax
# source, which may be a read-only copy.
set -euo pipefail
cd "$(dirname "$0")/.."

src=${SGLANG_JAX_SRC:-../shared/peers/sglang-jax/python}
if [ ! -f "$src/sgl_jax/srt/mem_cache/memory_pool.py" ]; then
  echo "CI: SGLANG_JAX_SRC: expected sglang-jax's python/ folder (commit cddbf6f), got $src" >&2
  exit 1
fi
SGLANG_JAX_SRC=$(cd "$src" && pwd)
export SGLANG_JAX_SRC
export CI=${CI:-1}
export JAX_PLATFORMS=cpu
venv=.venv-sglang-jax
export PYTHONPYCACHEPREFIX="$PWD/$venv/pycache"
unset PYTHONDONTWRITEBYTECODE # three interpreters import the same modules: compile them once

pytest_rc() {
  # Runs pytest with the given arguments in the environment; returns its status with 5 (no
  # tests collected) turned into a failure. `pytest_rc LABEL SECONDS ...` prints the run's
  # wall time and peak resident memory beside its bounds (SECONDS, 6 GB).
  local label=$1 seconds=$2
  shift 2
  set +e
  python3 .ci/measure.py "$label" "$seconds" 6144 -- "$venv/bin/python" -m pytest \
    -p no:cacheprovider -p ci_no_skips "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "CI: pytest collected no tests in $*; failing." >&2
    rc=1
  fi
  return "$rc"
}

start=$(date +%s)
python3 -m venv "$venv"
echo '*' >"$venv/.gitignore" # the environment is never part of the repository
# No bytecode at install: the tests' interpreters compile only the modules they import, once,
# into the prefix above, instead of every installed file.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile \
  -e ".[test,mooncake]" -r .ci/sglang-jax-requirements.txt \
  -r .ci/sglang-jax-server-requirements.txt
installed=$(date +%s)
echo "CI: sglang-jax environment installed in $((installed - start)) s"
"$venv/bin/python" -c "import jax, numpy; print('jax', jax.__version__, 'numpy', numpy.__version__)"

export PYTHONPATH="$SGLANG_JAX_SRC:$PWD/tests_sglang_jax"
tests="$SGLANG_JAX_SRC/sgl_jax/test/mem_cache"
one_device=()
for f in "$tests"/test_*.py; do
  case "$(basename "$f")" in
    *_tpu*) ;; # TPU-only (Pallas kernels, pinned host memory)
    test_unified_radix_cache.py) ;;
    *) one_device+=("$f") ;;
  esac
done

own_rc=0
pytest_rc "sglang-jax mem_cache tests" 300 --rootdir "$SGLANG_JAX_SRC" -q "${one_device[@]}" \
  || own_rc=$?
eight_rc=0
XLA_FLAGS="--xla_force_host_platform_device_count=8" \
  pytest_rc "sglang-jax test_unified_radix_cache.py (8 devices)" 120 \
  --rootdir "$SGLANG_JAX_SRC" -q "$tests/test_unified_radix_cache.py" || eight_rc=$?
hicache_rc=0
pytest_rc "sglang-jax HiCache tests on jaxkv's LRUHostKVPool" 120 -p hicache_on_jaxkv \
  --rootdir "$SGLANG_JAX_SRC" -q "$tests/test_host_kv_pool.py" "$tests/test_hicache_controller.py" \
  "$tests/test_hicache_e2e.py" || hicache_rc=$?
ours_rc=0
pytest_rc "tests_sglang_jax" 180 tests_sglang_jax -rxX \
  --ignore tests_sglang_jax/test_server.py || ours_rc=$?
server_rc=0
pytest_rc "sglang-jax server end to end" 600 tests_sglang_jax/test_server.py -rxX -s \
  || server_rc=$?
echo "CI: sglang-jax step took $(($(date +%s) - start)) s (install $((installed - start)) s)"

for rc in "$own_rc" "$eight_rc" "$hicache_rc" "$server_rc"; do
  if [ "$rc" -ne 0 ]; then
    exit "$rc"
  fi
done
exit "$ours_rc"
