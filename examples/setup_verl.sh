#!/usr/bin/env bash
# Adds verl (0.9.1) and what its checkpoint engines import to .venv, next to vLLM's CPU build, for
# the verl engine (transport.integrations.verl) and its tests. verl 0.9.1 asks for
# transformers<5.11 while vLLM's CPU build needs >=5.16.1; verl's checkpoint-engine path runs with
# the newer one (tested), so verl goes in with --no-deps and its imports are installed with torch
# and transformers held where they are (a plain `pip install verl` also spends minutes resolving).
#   - cupy-cuda13x: verl's nccl/nixl engines import CuPy (it imports without a GPU)
#   - nixl (the Python package, --no-deps): verl's nixl engine imports nixl._api over nixl-cu13
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "examples/setup_verl.sh: run examples/setup_vllm.sh first" >&2; exit 2; }
source examples/install.sh
# what the engine and its tests import, and both engines registered with verl: one interpreter
# (importing verl takes seconds of CPU), once when it is there, twice when it is installed here
verl_ready() {
    .venv/bin/python -W ignore -c "
import ray, cupy, nixl._api, tests.checkpoint_engine.test_utils
import transport.integrations.verl
from verl.checkpoint_engine import CheckpointEngineRegistry as R
missing = {'transport', 'nixl'} - set(R._registry)
assert not missing, f'not registered: {missing}'
"
}
if ! verl_ready 2>/dev/null; then
    held=$(mktemp)
    .venv/bin/python -m pip freeze 2>/dev/null | grep -i -E "^(torch|transformers|numpy|protobuf|pydantic|fastapi|msgpack)==" > "$held"
    venv_install --no-deps "verl==0.9.1" "nixl==1.5.1"
    venv_install -c "$held" ray hydra-core "tensordict<=0.10" codetiming dill pylatexenc torchdata \
        datasets accelerate peft pandas pyarrow pyzmq cupy-cuda13x
    rm -f "$held"
    verl_ready || {
        echo "examples/setup_verl.sh: verl did not install cleanly (see above)" >&2
        exit 2
    }
fi
