"""The tests of torch's transport API on this library (``new_transport("transport")``): they need
torch 2.15 or newer (marker ``torch_api``). The test command runs them in its second environment, which has that torch
(``TRANSPORT_TEST_TORCH_API=1``): there a torch without the API fails them instead of skipping."""

from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.fixture(autouse=True)
def _torch_api() -> None:
    if importlib.util.find_spec("torch.distributed._transport") is None:
        if os.environ.get("TRANSPORT_TEST_TORCH_API") == "1":
            pytest.fail(
                "this torch has no transport API, and the test command promised one", pytrace=False
            )
        pytest.skip(
            "torch's transport API needs torch 2.15 (tests/run.sh runs these in its second environment)"
        )
