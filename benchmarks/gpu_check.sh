#!/usr/bin/env bash
# Every GPU test and GPU benchmark on one lent H200 in under 8 minutes, installing nothing from the
# network: the machine's python3 (its torch and CuPy as they are), the wheels carried in .whl
# (made here by benchmarks/gpu_wheels.sh) installed into a temporary folder on PYTHONPATH, and this
# tree installed in editable mode. The exact device call is in benchmarks/README.md.
#   bash benchmarks/gpu_check.sh               # on the lent machine
#   bash benchmarks/gpu_check.sh --dry-run     # anywhere: no CUDA device needed, the GPU tests skip
# Environment: TRANSPORT_GPU_PYTHON (default python3), TRANSPORT_GPU_WHEELS (default .whl).
# Results, at most 8 files, in $OUT (or ./gpu-results): summary.txt, versions.json, install.log,
# gpu-tests.txt, gpu-bench.json, lanes.json and traces.tar.gz (flight-recorder dumps, if any).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
DRY=""
case "${1:-}" in
    "") ;;
    --dry-run) DRY=--dry-run ;;
    *) echo "gpu_check: unknown argument '$1' (known: --dry-run)" >&2; exit 2 ;;
esac
PY=${TRANSPORT_GPU_PYTHON:-python3}
WHEELS=${TRANSPORT_GPU_WHEELS:-.whl}
CARRIED=()
RESULTS=${OUT:-gpu-results}
mkdir -p "$RESULTS"
: >"$RESULTS/summary.txt"
: >"$RESULTS/install.log"
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR TRANSPORT_TRACE_DIR="$SCRATCH/traces"
mkdir -p "$TRANSPORT_TRACE_DIR"
say() { echo "gpu_check: $*" | tee -a "$RESULTS/summary.txt"; }
fail() { say "$*"; exit 2; }
command -v "$PY" >/dev/null 2>&1 || fail "no '$PY' here; set TRANSPORT_GPU_PYTHON to a Python with torch and CuPy"

# 1. The carried wheels, into a temporary folder on PYTHONPATH (--no-index: nothing is fetched).
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --no-cache-dir --target "$SCRATCH/site" "${wheels[@]}" >>"$RESULTS/install.log" 2>&1 \
        || fail "installing the wheels of $WHEELS failed (see install.log); remake them with benchmarks/gpu_wheels.sh"
    export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
    CARRIED=(--carried "$WHEELS")
    say "installed ${#wheels[@]} carried wheels: $(cd "$WHEELS" && echo *.whl)"
else
    say "no wheels in $WHEELS (run benchmarks/gpu_wheels.sh here and name .whl in carry when the machine lacks NIXL)"
fi

# 2. This tree, in editable mode, so that every process (the spawned peers too) imports it.
# (asked from another folder: python -c puts the current folder on sys.path, which hides a missing
# install from this check but not from a script such as benchmarks/gpu_env.py)
from_tree='import sys, transport.backends as b; sys.exit(not b.__file__.startswith(sys.argv[1]))'
if ! (cd / && "$PY" -c "$from_tree" "$PWD/") >/dev/null 2>&1; then
    build=(--no-build-isolation)  # the machine's own setuptools (74.1 or newer: ext-modules)
    builders=("$WHEELS"/build/*.whl)
    [ ${#builders[@]} -gt 0 ] && build=(--find-links "$WHEELS/build")  # the carried one
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps "${build[@]}" -e . \
        >>"$RESULTS/install.log" 2>&1 \
        || fail "installing this tree (pip install -e . ${build[*]}) failed: see install.log (benchmarks/gpu_wheels.sh carries a setuptools for it in .whl/build)"
    say "installed this tree in editable mode (${build[*]})"
fi

# 3. The versions found; fail in seconds if anything is missing.
timeout -k 5 120 "$PY" benchmarks/gpu_env.py $DRY "${CARRIED[@]}" --json "$RESULTS/versions.json" 2>&1 | tee -a "$RESULTS/summary.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "this machine cannot run the GPU check (see 'missing' above)"
say "ready after ${SECONDS} s"

# 4. The GPU tests (and, on the GPU machine, the stream tests that run anywhere: a dry run leaves
#    them to the test suite, which runs them anyway): 4 minutes at most.
mapfile -t suites < <(find tests -name 'test_*_gpu.py' | sort)  # every GPU test file (marker cuda)
[ -z "$DRY" ] && suites+=(tests/cuda/test_stream.py)
#    Each test without a timeout of its own gets 60 s: a test that hangs fails and the rest still
#    run and report (the outer timeout would lose the whole report). At 45 s faulthandler's own
#    thread prints every thread's stack, which it can do while a thread blocked in C holds the GIL.
timeout -k 10 240 "$PY" -m pytest "${suites[@]}" -q -p no:cacheprovider -rs --timeout 60 \
    -o faulthandler_timeout=45 \
    >"$RESULTS/gpu-tests.txt" 2>&1
tests=$?
say "tests: exit $tests after ${SECONDS} s; $(tail -n 1 "$RESULTS/gpu-tests.txt")"
grep -E "^(FAILED|ERROR|SKIPPED)" "$RESULTS/gpu-tests.txt" | head -n 20 | tee -a "$RESULTS/summary.txt"

# 5. The GPU figures (2.5 minutes at most) and lanes on the lent host's cores (1 minute at most).
bench=0
if [ -z "$DRY" ]; then
    timeout -k 10 150 "$PY" benchmarks/gpu_bench.py --json "$RESULTS/gpu-bench.json" 2>&1 | tee -a "$RESULTS/summary.txt"
    bench=${PIPESTATUS[0]}
    sizes=4K,1G
else
    say "dry run: benchmarks/gpu_bench.py needs a CUDA device; lanes measured at 4K only"
    sizes=4K
fi
timeout -k 10 60 "$PY" -m transport.cli bench put --sizes "$sizes" --op write --baselines raw,memcpy \
    --lanes 4,2,1 --budget 0.5 --batch none --no-progress --json "$RESULTS/lanes.json" 2>&1 \
    | tail -n 25 | tee -a "$RESULTS/summary.txt"
lanes=${PIPESTATUS[0]}

if [ -n "$(ls -A "$TRANSPORT_TRACE_DIR")" ]; then
    tar -czf "$RESULTS/traces.tar.gz" -C "$TRANSPORT_TRACE_DIR" .
    if [ "$(stat -c %s "$RESULTS/traces.tar.gz")" -gt $((15 << 20)) ]; then
        rm -f "$RESULTS/traces.tar.gz"
        say "flight-recorder dumps over 15 MiB: not kept (a file over 16 MiB does not come back)"
    else
        say "flight-recorder dumps in traces.tar.gz ($(du -h "$RESULTS/traces.tar.gz" | cut -f1))"
    fi
fi
files=$(find "$RESULTS" -type f | wc -l)
[ "$files" -le 8 ] || say "warning: $files result files, more than the 8 that come back"
say "done after ${SECONDS} s: tests exit $tests, bench exit $bench, lanes exit $lanes"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$lanes" -eq 0 ]
