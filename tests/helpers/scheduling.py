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

#: the files outside the lane that take 10 s or more of a worker's time, longest first (what two
#: runs of the test command measured on the 2-core machine, 2026-12-07; a folder stands for its
#: files): dealt out first, in this order, so that the run ends with the short files. The rest
#: follow, the files with the most tests first (xdist's own order). Dealt out in xdist's order,
#: the files that mostly wait (deadlines, heartbeats, a peer stopped or frozen) came last and left
#: part of the machine idle at the end; dealt out longest first, more of their waits overlap the
#: other workers' work (benchmarks/README.md, the test command's time).
LONG_FILES = (
    "test_benchmarks.py",
    "cli/test_bench.py",
    "integrations/",
    "cluster/test_chaos.py",
    "fuzz/test_fuzz.py",
    "weights/test_converge.py",
    "cluster/test_link_faults.py",
    "test_wheel.py",
    "weights/test_scale.py",
    "weights/group/test_membership.py",
    "cluster/test_cluster.py",
    "core/test_drills.py",
    "test_gpu_check.py",
    "store/test_conformance.py",
    "weights/publishing/test_sharded_procs.py",
    "cli/test_doctor.py",
    "core/test_faults.py",
    "weights/subscribing/test_relay.py",
    "transfers/test_small_messages.py",
    "test_examples.py",
    "cli/test_peers.py",
    "cluster/test_connect_behind_cut.py",
    "transfers/test_transfers.py",
    "security/test_outsider.py",
    "weights/subscribing/test_idle_members.py",
    "cli/test_bench_hosts.py",
    "weights/subscribing/test_window.py",
    "weights/delta/test_delta.py",
    "weights/delta/test_delta_sharded.py",
    "weights/group/test_forged_store_values.py",
    "store/test_counters_in_namespace.py",
    "weights/buckets/test_buckets.py",
    "core/test_idle.py",
    "core/test_trace.py",
    "core/test_hostile_frames.py",
    "weights/group/test_group_leave_race.py",
    "weights/publishing/test_close.py",
    "test_timeouts.py",
    "peers/test_leave_race.py",
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
