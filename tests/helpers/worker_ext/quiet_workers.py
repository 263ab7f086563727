"""On a test server's ``PYTHONPATH`` (helpers.vllm_server): the worker extension the tests run
vLLM with. It reports the transport engine's state, as the product's extension does, and can
make the workers' readers of vLLM's message queues sleep sooner.

vLLM's tensor-parallel workers spin for 1 s after each message from the engine before they
sleep (``SpinCondition.busy_loop_s`` of its shared-memory message queue). With as many workers as
cores (TP = 2 on the test machines' two), the spinning workers hold both cores, and every call of
an update (start, update, finish, each ``collective_rpc``) waits about a second for the engine,
the trainer and the test to run. ``benchmarks/vllm_update.py --worker-spin-s`` measures it; the
tests set 1 ms, which changes when a reader sleeps, not what it reads."""

from __future__ import annotations

import gc

from transport.integrations.vllm.extension import TransportState


class TestWorkers(TransportState):
    """The product's extension plus :meth:`reader_spin` and :meth:`blocking_collectives` (owns
    nothing)."""

    __test__ = False  # not a pytest class

    def reader_spin(self, seconds: float) -> int:
        """Readers of this worker's message queues spin ``seconds`` after a message before they
        sleep; returns how many readers it changed."""
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        # type(o), not isinstance(o, ...): the heap holds weak proxies, and isinstance asks a
        # proxy whose object is gone for its class, which raises ReferenceError
        found = [o for o in gc.get_objects() if issubclass(type(o), SpinCondition) and o.is_reader]
        for o in found:
            o.busy_loop_s = seconds
        return len(found)

    def blocking_collectives(self) -> int:
        """This worker's groups (tensor-, pipeline-, data- and expert-parallel) do their
        collectives through torch.distributed instead of vLLM's spinning shared-memory
        communicator; returns how many groups it changed. Called on every worker at once
        (``collective_rpc``), between steps: no collective is under way."""
        import torch.distributed
        from vllm.distributed import parallel_state
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

        changed = 0
        for getter in ("get_tp_group", "get_pp_group", "get_dp_group", "get_ep_group"):
            try:
                group = getattr(parallel_state, getter)()
            except AssertionError:  # a group this server has not made
                continue
            comm = group.device_communicator
            if isinstance(comm, CpuCommunicator) and comm.dist_module is not torch.distributed:
                comm.dist_module = torch.distributed
                comm.supports_tensor_dict = False  # what vLLM sets for a torch.distributed group
                changed += 1
        return changed
