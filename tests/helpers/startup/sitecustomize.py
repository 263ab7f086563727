"""Run by every Python process the tests start (tests/conftest.py puts this folder first on
``PYTHONPATH``).

The garbage collector's passes come after ``FIRST_PASS`` new objects instead of CPython's 700.
The tests start hundreds of Python processes (peers, servers, benchmarks, vLLM's engines and
workers, Ray's workers), and most of each one's CPU goes to importing torch, vLLM or Ray: millions
of objects, all kept. With CPython's thresholds a pass runs every 700 of them and a full pass
each time the survivors grew by a quarter, each walking everything alive; in a profile of the
whole suite those passes were a large share of the CPU of both cores, finding almost nothing to
collect. What a process keeps and frees is unchanged: cycles are collected as before, later.

A reader of vLLM's shared-memory message queues (an engine core reading its workers' answers, a
worker reading the engine's calls) spins ``VLLM_READER_SPIN_S`` after a message before it sleeps
until the next one is announced, instead of vLLM's 1 s: on the test machines' two cores a
spinning reader takes a core from the processes it waits for, at every call of an update. What
it reads is unchanged.

vLLM's CPU platform starts its processes (an API server's engine core, an engine core's workers)
by spawn, and each imports vLLM anew: most of a server's start. In the tests' processes they are
forked from the process that starts them, vLLM's default start method (its GPU builds fork unless
CUDA is already initialized), where that process runs no thread besides its main one; they are
spawned as before from a process with threads and in a Ray actor (verl's), where vLLM itself must
spawn. What each server saves: benchmarks/README.md, the test command's time.

A port vLLM picks for itself (its processes' torch.distributed rendezvous, its message queues'
sockets) stays held by the process that picked it until that process ends, as
transport/store/ports.py holds ports: vLLM binds port 0, closes it and binds the number later in
another process, and on the test machines, which open thousands of connections a minute,
another process may be given the port meanwhile (the server then fails with EADDRINUSE)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
import sys
import threading
from types import ModuleType

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported as a package module (conftest.py) or run by its path
    sys.path.append(HERE)
from on_import import patch_on_import  # noqa: E402

#: new objects (allocations less deallocations) before the youngest generation's pass
FIRST_PASS = 100_000
#: how long a reader of vLLM's message queues spins after a message (vLLM: 1 s)
VLLM_READER_SPIN_S = 0.001

gc.set_threshold(FIRST_PASS, *gc.get_threshold()[1:])


def quiet_readers(shm_broadcast: ModuleType) -> None:
    """Readers of vLLM's message queues made from now on spin at most VLLM_READER_SPIN_S."""
    cls = shm_broadcast.SpinCondition
    init = cls.__init__

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = min(self.busy_loop_s, VLLM_READER_SPIN_S)

    cls.__init__ = __init__


patch_on_import("vllm.distributed.device_communicators.shm_broadcast", quiet_readers)


def fork_when_alone(system_utils: ModuleType) -> None:
    """vLLM's processes started from now on are forked, vLLM's default start method, where the
    CPU platform chose spawn and the starting process runs no thread besides its main one
    (forked from a process with threads, a child can inherit a lock that a thread held at the
    fork, and hang on it). Outside a Ray actor only, where vLLM itself must spawn."""
    choose = system_utils.get_mp_context

    def get_mp_context():  # type: ignore[no-untyped-def]
        context = choose()
        alone = threading.active_count() == 1 and not system_utils.is_in_ray_actor()
        if context.get_start_method() == "spawn" and alone:
            return multiprocessing.get_context("fork")
        return context

    system_utils.get_mp_context = get_mp_context


patch_on_import("vllm.utils.system_utils", fork_when_alone)


#: the ports vLLM picked in this process, held until it ends
HELD_PORTS: list[socket.socket] = []


def held_ports(network_utils: ModuleType) -> None:
    """vLLM's ports picked from now on stay held (where neither ``VLLM_PORT`` nor
    ``VLLM_DP_MASTER_PORT`` steers the pick): a bound socket with SO_REUSEADDR that never
    listens, which the kernel gives to no one asking for any port and which the
    torch.distributed store and ZeroMQ, binding by number with SO_REUSEADDR, still bind
    (transport/store/ports.py, not imported here: importing transport imports torch)."""
    pick = network_utils.get_open_port

    def get_open_port() -> int:
        if "VLLM_PORT" in os.environ or "VLLM_DP_MASTER_PORT" in os.environ:
            return int(pick())
        held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("", 0))
        HELD_PORTS.append(held)
        return int(held.getsockname()[1])

    network_utils.get_open_port = get_open_port


patch_on_import("vllm.utils.network_utils", held_ports)
