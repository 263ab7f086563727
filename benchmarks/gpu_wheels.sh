#!/usr/bin/env bash
# Run here, before a GPU lease: downloads the wheels that the lent GPU machine lacks into .whl/
# (ignored by git) and checks that the working tree plus the wheels fit the 64 MiB a call carries.
#   bash benchmarks/gpu_wheels.sh                      # for the lent machine's Python 3.12
#   bash benchmarks/gpu_wheels.sh --python-version 3.11 --dest /tmp/wheels   # a dry run elsewhere
# The lent machine has torch, CuPy, numpy, msgpack, pytest, pytest-timeout and hypothesis; it lacks
# NIXL, the redis client and rich (the bench's tables and progress, with its three dependencies).
# Not cryptography (4.8 MiB with cffi, past the 64 MiB a call carries): it is imported only for a
# secret=, which no GPU test or benchmark uses, and gpu_check.sh installs this tree with --no-deps.
# benchmarks/gpu_check.sh installs these wheels there with --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."

# Exactly what the lent machine lacks, pinned to what the tests here use; and, in build/, what
# pip needs to install this tree in editable mode there (whatever setuptools that machine has).
WHEELS=("nixl-cu13==1.5.1" "redis==8.1.0" "rich==15.0.0" "pygments==2.21.0" "markdown-it-py==4.3.0"
        "mdurl==0.1.2")
BUILD=("setuptools==84.2.1")
LIMIT_MIB=64
PYVER=3.12
DEST=.whl
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) PYVER=$2; shift 2 ;;
        --dest) DEST=$2; shift 2 ;;
        -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
        *) echo "gpu_wheels: unknown argument '$1' (known: --python-version X.Y, --dest DIR)" >&2; exit 2 ;;
    esac
done

PY=${PYTHON:-python3}
download() {  # download FOLDER SPEC...: one wheel of each SPEC for the lent machine into FOLDER
    local folder=$1 spec dist
    shift
    mkdir -p "$folder"
    # one version of each: a stale wheel of another version would stop the install there
    for spec in "$@"; do
        dist=${spec%%==*}
        rm -f "$folder/${dist//-/_}"-*.whl
    done
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d "$folder" "$@" 2>&1 | grep -v "^WARNING: Location" || true
    for spec in "$@"; do
        dist=${spec%%==*}
        ls "$folder/${dist//-/_}-${spec##*==}"-*.whl >/dev/null 2>&1 || {
            echo "gpu_wheels: no wheel of $spec for Python $PYVER was downloaded (see pip's message above)" >&2
            exit 1
        }
    done
}
download "$DEST" "${WHEELS[@]}"
download "$DEST/build" "${BUILD[@]}"

# What a device call carries: tracked and untracked files that git does not ignore, plus the wheels.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null \
    | awk '{s += $1} END {print s + 0}')
wheels=$(find "$DEST" -maxdepth 2 -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
awk -v t="$tree" -v w="$wheels" -v lim="$LIMIT_MIB" -v d="$DEST" 'BEGIN {
    m = 1048576
    printf "gpu_wheels: tree %.1f MiB + wheels in %s %.1f MiB = %.1f MiB of the %d MiB a call carries\n", t / m, d, w / m, (t + w) / m, lim
    if (t + w > lim * m) {
        print "gpu_wheels: over the limit: commit or delete untracked files, or ignore build outputs" > "/dev/stderr"
        exit 1
    }
}'
ls -1 "$DEST"/*.whl "$DEST"/build/*.whl
