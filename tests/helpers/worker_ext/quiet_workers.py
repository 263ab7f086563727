"""On a test server's ``PYTHONPATH`` (helpers.vllm_server): the worker extension the tests run
vLLM with. It reports the transport engine's state, as the product's extension does, and can make
the workers' collectives wait in the kernel.

The collectives of vLLM's tensor-parallel workers (the all-reduce of every layer, the gather of
the logits) go through vLLM's CPU shared-memory communicator, whose waiting rank spins until the
other arrives. On two cores shared with the rest of the suite the other rank is often not
running, and the spinning one burns its core meanwhile: a fifth of a TP = 2 server file's CPU was
seen there. :meth:`blocking_collectives` hands them to the group's torch.distributed (gloo)
group, which waits in the kernel; a sum of two ranks' values is the same in either order, so the
tokens are the same bit for bit. (The workers' readers of vLLM's message queues spin 1 ms after
a message instead of 1 s from their start: helpers/startup/sitecustomize.py.)"""

from __future__ import annotations

from transport.integrations.vllm.extension import TransportState


class TestWorkers(TransportState):
    """The product's extension plus :meth:`blocking_collectives` (owns nothing)."""

    __test__ = False  # not a pytest class

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
