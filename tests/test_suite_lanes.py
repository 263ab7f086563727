"""The test command's scheduling (helpers/scheduling.py): every file it names exists, the files
of the server lane are one unit of work dealt out before any other, and the rest keep xdist's
order among equals. A renamed file would otherwise leave the lane silently and run beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.scheduling import LANE, LONG_FILES, SERVER_LANE, order, place_in_lane, queue_order

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent


def test_every_named_file_or_folder_exists():
    for part in (*SERVER_LANE, *LONG_FILES):
        assert (TESTS / part).exists(), part


def test_the_lane_files_are_placed_and_no_other():
    assert [place_in_lane(f"tests/{f}::t[x]") for f in SERVER_LANE] == list(range(len(SERVER_LANE)))
    assert place_in_lane("tests/integrations/vllm/test_vllm_offline.py::t") is None
    assert place_in_lane("tests/core/test_trl_transfer.py::t") is None


def test_the_lane_is_dealt_out_first_then_the_long_files_then_xdists_order():
    xdist = ["tests/core/test_b.py", "tests/cluster/test_cluster.py", "tests/core/test_a.py", LANE]
    assert queue_order(xdist) == [
        LANE,
        "tests/cluster/test_cluster.py",
        "tests/core/test_b.py",
        "tests/core/test_a.py",
    ]


def test_the_collection_order_puts_the_lane_first_in_its_order():
    ids = ["tests/core/test_a.py::t", *(f"tests/{f}::t" for f in reversed(SERVER_LANE))]
    ranked = sorted(ids, key=order)
    assert ranked[: len(SERVER_LANE)] == [f"tests/{f}::t" for f in SERVER_LANE]
