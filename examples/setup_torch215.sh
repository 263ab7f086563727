#!/usr/bin/env bash
# A second environment, .venv-torch215, with torch 2.15 (its transport API, torch.distributed._transport)
# and this package: the test command runs the core, weight-sync and torch-API tests in it.
#
# PyPI's torch 2.15 for Linux is a CUDA build: it asks for 2.9 GB of CUDA wheels. A CPU machine needs
# only what the dynamic loader resolves when torch is imported: the libraries its own libraries link
# (cuBLAS, cuDNN, cuFFT, cuFile, cuSOLVER, cuSPARSE, cuSPARSELt, NCCL, NVRTC, NVSHMEM, nvJitLink, the
# CUDA runtime; 2.0 GB of wheels with torch itself), not Triton (torch.compile's GPU kernels),
# cuda-bindings, CUPTI, NVTX or CCCL. So torch and those go in without their dependencies, and
# this package without its own (torch among them), beside what it does need.
# Run from the repository root after .venv exists (its uv installs; TRANSPORT_INSTALLER=pip: pip).
# `setup_torch215.sh deps` installs torch and the rest only, `setup_torch215.sh package` this package
# only.
set -euo pipefail
STEP=${1:-all}
cd "$(dirname "$0")/.."

VENV=.venv-torch215
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"

TORCH=(
    "torch==2.15.0"
    "nvidia-cublas==13.4.1.3"
    "nvidia-cuda-runtime==13.2.86"
    "nvidia-cuda-nvrtc==13.2.86"
    "nvidia-cudnn-cu13==9.26.0.51"
    "nvidia-cufft==12.2.0.57"
    "nvidia-cufile==1.17.1.22"
    "nvidia-cusolver==12.2.0.11"
    "nvidia-cusparse==12.7.10.12"
    "nvidia-cusparselt-cu13==0.8.1"
    "nvidia-nccl-cu13==2.30.7"
    "nvidia-nvjitlink==13.5.37"
    "nvidia-nvshmem-cu13==3.7.2"
)
# torch's own small dependencies, this package's (pyproject.toml) and its test tools
DEPS=(
    filelock "typing-extensions>=4.13" sympy networkx jinja2 fsspec "setuptools>=77"
    "nixl-cu13>=1.5.1,<2" "msgpack>=1.0" "redis>=5.0" "numpy>=1.24" "rich>=13" "cryptography>=42"
    "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "hypothesis>=6"
)

install() {
    # the machine's pip configuration may cap torch below 2.15 (a constraint): not for this one
    if [ "${TRANSPORT_INSTALLER:-uv}" = "uv" ] && [ -x .venv/bin/uv ]; then
        .venv/bin/uv pip install -q --python "$VENV/bin/python" "$@"
    else
        PIP_CONFIG_FILE=/dev/null PIP_CONSTRAINT="" "$VENV/bin/python" -m pip install -q \
            --disable-pip-version-check "$@"
    fi
}

if [ "$STEP" != "package" ]; then
    if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__ != "2.15.0")' 2>/dev/null; then
        install --no-deps "${TORCH[@]}"
    fi
    install "${DEPS[@]}"
    # torch's own NIXL backend imports `nixl`: the package of that name loads nixl-cu13's build
    # (its other dependency, the CUDA 12 build, is left out)
    install --no-deps "nixl==1.5.1"
fi
[ "$STEP" = "deps" ] && exit 0
install --no-deps -e .
"$VENV/bin/python" -c "
import torch, torch.distributed._transport as api, transport.backends.nixl as n
n.load_nixl()
assert {'transport', 'nixl'} <= set(api.available_transports()), api.available_transports()
from torch.distributed._transport.nixl import NIXLTransport
assert NIXLTransport.supported()
" || {
    echo "examples/setup_torch215.sh: $VENV did not install cleanly (see above)" >&2
    exit 2
}
