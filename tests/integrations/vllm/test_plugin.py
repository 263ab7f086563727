"""The vLLM backend costs nothing to those who do not use it: importing transport (and its vLLM
package) imports no vLLM, and vLLM finds the backend by the entry point the package declares.
Each check runs in a fresh interpreter, so what this test process imported does not count."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

from helpers.processes import REPO

pytestmark = [pytest.mark.unit, pytest.mark.vllm]


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_transport_and_its_vllm_package_imports_no_vllm():
    printed = _run(
        "import sys, transport, transport.integrations.vllm as v\n"
        "print(v.BACKEND, sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    assert printed.split() == ["transport", "[]"]


def test_the_entry_point_vllm_loads_names_the_register_function():
    (ep,) = [
        e for e in metadata.entry_points(group="vllm.general_plugins") if e.name == "transport"
    ]
    assert ep.value == "transport.integrations.vllm:register"


def test_register_is_idempotent_and_names_both_sides():
    pytest.importorskip("vllm")
    printed = _run(
        "from transport.integrations.vllm import register\n"
        "register(); register()\n"
        "from vllm.distributed.weight_transfer.factory import (\n"
        "    WeightTransferEngineFactory as W, WeightTransferTrainerFactory as T)\n"
        "print(W._registry['transport']().__name__, T._registry['transport']().__name__)"
    )
    assert printed.split()[-2:] == ["TransportEngine", "TransportTrainer"]
