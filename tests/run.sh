#!/usr/bin/env bash
# The test command: sets up what the tests need on a fresh machine and runs them.
#   - a virtualenv in .venv with the CPU build of torch and this package with its dev extras
#   - vLLM's CPU build for the integration tests (examples/setup_vllm.sh), verl and Ray for the
#     verl engine's (examples/setup_verl.sh)
#   - a second virtualenv, .venv-torch215, with torch 2.15 (its transport API) and this package
#     (examples/setup_torch215.sh); TRANSPORT_TEST_TORCH215=0 leaves it out
#   - Debian's redis-server (installed when missing), started on a free loopback port and
#     stopped afterwards, unless TRANSPORT_TEST_REDIS_URL names a server to use instead
#   - as root: Debian's iproute2 and nftables (installed when missing) for the hosts tests (marker hosts)
# Python packages go in through uv (examples/install.sh: seconds where pip takes minutes);
# TRANSPORT_INSTALLER=pip installs them with pip.
# Arguments are passed to pytest (for example: bash tests/run.sh -k faults -x).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# Python compiles a module to bytecode at its first import and, unless told not to, keeps it: the
# installs here skip compiling everything they unpack (vLLM, torch, Ray, transformers: about
# 29,000 modules in .venv; a whole run imports about 8,400 of them) and every process of the run
# writes what it compiled, so each module is compiled about once (examples/install.sh)
unset PYTHONDONTWRITEBYTECODE
export TRANSPORT_COMPILE_BYTECODE=0
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
source examples/install.sh  # venv_install: uv, with pip's configuration passed on
# The CPU build of torch pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
venv_install "torch==2.13.0" -e ".[dev]"
.venv/bin/python -c "import torch, transport, transport.backends.nixl as n; n.load_nixl()" || {
    echo "tests/run.sh: the environment did not install cleanly (see above)" >&2
    exit 2
}
# The second environment installs beside vLLM and verl (separate environments, one uv cache that
# uv locks): most of each install is compiling bytecode, which the two share the cores for. (Its
# tests run after the first run's: beside them, at the same priority, they made live peers of the
# first run miss heartbeats; at nice 19, its own children missed their start deadlines.)
SECOND=${TRANSPORT_TEST_TORCH215:-1}
if [ "$SECOND" != "0" ]; then
    SETUP_LOG=$(mktemp)
    bash examples/setup_torch215.sh >"$SETUP_LOG" 2>&1 &
    SETUP_SECOND=$!
fi
bash examples/setup_vllm.sh
export TRANSPORT_TEST_VLLM=1  # the vLLM tests fail, not skip, without it
bash examples/setup_verl.sh
export TRANSPORT_TEST_VERL=1  # the verl tests fail, not skip, without it
if [ "$SECOND" != "0" ] && ! wait "$SETUP_SECOND"; then
    cat "$SETUP_LOG" >&2
    echo "tests/run.sh: examples/setup_torch215.sh failed (its output is above)" >&2
    exit 2
fi
[ "$SECOND" = "0" ] || rm -f "$SETUP_LOG"

# The hosts tests (marker hosts: network namespaces, as root) shape links with tc and, where the
# kernel lacks tc's netem, drop packets with nftables: install iproute2 and nftables when missing.
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    missing=""
    command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing="$missing iproute2"
    command -v nft >/dev/null 2>&1 || missing="$missing nftables"
    if [ -n "$missing" ]; then
        echo "tests/run.sh: installing Debian's$missing" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    fi
fi

if [ -z "${TRANSPORT_TEST_REDIS_URL:-}" ]; then
    if ! command -v redis-server >/dev/null 2>&1; then
        echo "tests/run.sh: installing Debian's redis-server" >&2
        SUDO=""
        [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        $SUDO apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
    fi
    REDIS_DIR=$(mktemp -d)
    REDIS_PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
        --dir "$REDIS_DIR" --pidfile "$REDIS_DIR/redis.pid" --logfile "$REDIS_DIR/redis.log"
    stop_redis() {
        # never the reason this command fails: its exit status is pytest's
        if [ -n "${PROBE:-}" ]; then
            kill "$PROBE" 2>/dev/null || true
            .venv/bin/python tests/helpers/redis_probe.py report "$REDIS_URL" "$REDIS_DIR/silences.jsonl" || true
        fi
        local pid=""
        [ -f "$REDIS_DIR/redis.pid" ] && pid=$(cat "$REDIS_DIR/redis.pid" 2>/dev/null || true)
        if [ -n "$pid" ]; then
            kill "$pid" 2>/dev/null || true
            # it writes its log while it shuts down: wait (5 s at most) before removing its folder
            for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -rf "$REDIS_DIR" 2>/dev/null || true
    }
    trap stop_redis EXIT
    for _ in $(seq 1 100); do
        if redis-cli -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; then break; fi
        sleep 0.1
    done
    redis-cli -p "$REDIS_PORT" ping | grep -q PONG || { echo "tests/run.sh: redis-server did not start" >&2; cat "$REDIS_DIR/redis.log" >&2; exit 2; }
    export TRANSPORT_TEST_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"
    # Is the server ever silent, and whose fault is it? Its own stalls over 100 ms (LATENCY
    # LATEST) and a probe's pings, reported at the end (tests/helpers/redis_probe.py).
    REDIS_URL=$TRANSPORT_TEST_REDIS_URL
    redis-cli -p "$REDIS_PORT" config set latency-monitor-threshold 100 >/dev/null
    .venv/bin/python tests/helpers/redis_probe.py watch "$REDIS_URL" "$REDIS_DIR/silences.jsonl" &
    PROBE=$!
fi

export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
# One OpenMP thread per process: the suite runs dozens of processes on two cores, and a pool per
# process spends its waits spinning. vLLM's workers bind their own threads
# (VLLM_CPU_OMP_THREADS_BIND).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# The suite runs in ${TRANSPORT_TEST_WORKERS:-3} pytest-xdist workers, a test file per worker at a
# time (module fixtures such as a vLLM engine stay whole); most tests wait on processes, deadlines
# and the network, so three workers keep two cores busy. The files that start vLLM servers run one
# after another in one worker from the start, the longest other files first in the others
# (tests/helpers/scheduling.py). Each worker has Redis databases of its own
# (tests/helpers/redis_server.py). The slowest tests are listed at the end.
# TRANSPORT_TEST_WORKERS=0 runs everything in this one process.
WORKERS=${TRANSPORT_TEST_WORKERS:-3}
if [ "$WORKERS" = "0" ]; then
    PARALLEL=()
else
    PARALLEL=(-n "$WORKERS" --dist loadfile)
fi
status=0
.venv/bin/python -m pytest "${PARALLEL[@]}" --durations=25 --ignore=tests/integrations/torch_api "$@" || status=$?

# The second environment, torch 2.15 (vLLM's CPU build pins 2.13 in the first): torch's transport
# API on this library (marker torch_api), the stores (marker stores: the TCPStore is torch's) and
# the tests that run in one process (marker unit: the core and the weight-sync layer on the
# loopback backend). Not run twice: the decoders' fuzzing (marker fuzz, tests/fuzz) and the tests
# of vLLM, TRL and verl, which are not in this environment. Arguments go to both runs.
if [ "$SECOND" != "0" ]; then
    echo "tests/run.sh: the same library under torch 2.15 (.venv-torch215)"
    TRANSPORT_TEST_TORCH_API=1 .venv-torch215/bin/python -m pytest "${PARALLEL[@]}" \
        -m "(unit or stores or torch_api) and not vllm and not verl" tests \
        --ignore=tests/integrations/trl --ignore=tests/integrations/verl \
        --ignore=tests/weights/group/test_messages.py \
        --ignore=tests/weights/layouts/test_bad_layouts.py --ignore=tests/core/test_wire.py \
        --ignore=tests/memory/test_region_table_bounds.py "$@" || status=$?
fi
exit $status
