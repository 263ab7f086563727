"""How pytest-xdist deals the test files out to its workers (``--dist loadfile``, the test
command's): one lane for the files that start vLLM servers, the longest files first.

A vLLM server of two tensor-parallel workers, or TRL's training job beside its server, keeps
both cores of the test machine busy for a minute or more. Dealt out like any other file, several
of them ran at once at the end of the run (xdist hands out the files with the most tests first,
and these have few): the load went above 20 and tests of seconds timed out. Here they form one
unit of work, run in order by one worker from the start while the other workers take everything
else, longest first, so that no long file is left alone at the end."""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling

#: files that start vLLM servers of two workers, TRL's job or Ray clusters (verl's): one after
#: another, in one lane
SERVER_LANE = (
    "integrations/trl/test_trl.py",
    "integrations/vllm/test_vllm_moe_tp2.py",
    "integrations/vllm/test_vllm_tp2_server.py",
    "integrations/vllm/test_vllm_lora_server.py",
    "integrations/vllm/test_vllm_tp2.py",
    "integrations/verl/test_verl.py",
    "test_benchmarks_servers.py",
)

#: files of tens of seconds or more outside the lane (clusters of hosts, the chaos runs, 100,000 tensors, the
#: wheel and the GPU dry run's installs, vLLM engines in one process): dealt out first, in this
#: order; the rest follow, the files with the most tests first (xdist's own order)
LONG_FILES = (
    "cluster/test_chaos.py",
    "cluster/test_link_faults.py",
    "weights/test_scale.py",
    "cluster/test_cluster.py",
    "cli/test_bench.py",
    "fuzz/test_fuzz.py",
    "test_wheel.py",
    "test_gpu_check.py",
    "test_benchmarks.py",
    "integrations/",
    "cli/test_bench_hosts.py",
    "transfers/test_small_messages.py",
    "weights/test_converge.py",
)

LANE = "vllm-servers"


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def place_in_lane(nodeid: str) -> int | None:
    """Where a test's file runs in the server lane (None: its file is a unit of its own)."""
    path = _file(nodeid)
    return next((i for i, f in enumerate(SERVER_LANE) if path.endswith(f)), None)


def order(nodeid: str) -> tuple[int, int]:
    """A test's place in the collection: the lane's files first, in the lane's order, then the
    rest by ``rank`` (the order a run in one process takes)."""
    lane = place_in_lane(nodeid)
    return (0, lane) if lane is not None else (rank(_file(nodeid)), 0)


def rank(scope: str) -> int:
    """Where a unit of work goes in the queue: the lane, then LONG_FILES in order, then the
    rest."""
    if scope == LANE:
        return 0
    found = (i for i, part in enumerate(LONG_FILES) if part in scope)
    return 1 + next(found, len(LONG_FILES))


def queue_order(scopes: list[str]) -> list[str]:
    """Units of work in the order they are dealt out: by ``rank``, stable (xdist's order, most
    tests first, decides among equals)."""
    return sorted(scopes, key=rank)


class LaneScheduling(LoadFileScheduling):
    """xdist's file-by-file scheduling with the files of SERVER_LANE as one unit of work, and the
    queue put in ``queue_order`` before the first unit is dealt out. Owns nothing but the
    queue's order."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self._ordered = False

    def _split_scope(self, nodeid: str) -> str:
        if place_in_lane(nodeid) is not None:
            return LANE
        return super()._split_scope(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        if not self._ordered:
            units = dict(self.workqueue)
            self.workqueue.clear()
            self.workqueue.update((scope, units[scope]) for scope in queue_order(list(units)))
            self._ordered = True
        super()._assign_work_unit(node)
