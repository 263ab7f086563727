# mypy: disable-error-code="attr-defined,assignment,arg-type"
"""verl's own checkpoint-engine harness around an engine, on machines without a GPU.

verl ships ``tests/checkpoint_engine/test_utils.py``: a ``TrainingWorkerTest`` (verl's FSDP
``TrainingWorker`` plus an engine), a ``CheckpointEngineWorkerTest`` with a mock server adapter that
checks every received weight against the Hugging Face model, and the replicas verl's
``CheckpointEngineManager`` drives. All of it is used as shipped except the FSDP trainer: verl's
``TrainingWorker`` initialises NCCL and cannot start without CUDA. :class:`StandInTrainer`
replaces only that part: a verl ``Worker`` that yields what verl's FSDP engine yields on every
rank (``get_per_tensor_param``: every full tensor, by name, in ``state_dict`` order, in bf16),
from the same checkpoint.

Also here: the few words verl's ``nixl`` engine needs to run on a CPU-only build of torch
(:func:`patch_nixl_for_cpu`, imported through ``custom_backend_module``), a :class:`Gate` that
holds the trainers at a tensor (a test kills a worker mid-update, or starts the next update while
one still runs), the memory of a worker, and verl's rollout worker group with its master port
held (:func:`rollout_worker_group`).
"""

from __future__ import annotations

import asyncio
import os
import types
from typing import Any

import ray
import torch
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

from transport.store import PortReservation, reserve_port

#: the module to name in ``custom_backend_module`` to run verl's nixl engine on a CPU-only torch
NIXL_ON_CPU = "transport.integrations.verl.harness"


def _status_bytes(field: str, pid: int | None) -> int:
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/PID/status")


def peak_rss_bytes(pid: int | None = None) -> int:
    """The peak resident memory of a process (VmHWM), in bytes."""
    return _status_bytes("VmHWM", pid)


def rss_bytes(pid: int | None = None) -> int:
    """The resident memory of a process now (VmRSS), in bytes."""
    return _status_bytes("VmRSS", pid)


def patch_nixl_for_cpu() -> None:
    """verl's nixl engine pins its CPU buckets and calls ``torch.cuda.synchronize()``; both fail
    on a torch without CUDA. There, give that module a torch whose ``zeros`` does not pin and
    whose ``cuda.synchronize`` does nothing (its CPU copies are synchronous anyway)."""
    if torch.cuda.is_available():
        return
    try:
        from verl.checkpoint_engine import nixl_checkpoint_engine as mod
    except ImportError:
        return
    if isinstance(mod.torch, types.SimpleNamespace):
        return

    def zeros(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **kwargs)

    cuda = types.SimpleNamespace(synchronize=lambda *a, **k: None)
    proxy = types.SimpleNamespace(
        **{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")}
    )
    proxy.zeros, proxy.cuda = zeros, cuda
    mod.torch = proxy


patch_nixl_for_cpu()


def _flip_low_bits(t: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """A copy of ``t`` with the lowest bit of about ``share`` of its elements flipped."""
    out = t.clone()
    if out.numel():
        low = out.reshape(-1).view(torch.uint8)[:: out.element_size()]  # little-endian
        g = torch.Generator().manual_seed(seed)
        low[torch.rand(low.numel(), generator=g) < share] ^= 1
    return out


@ray.remote
class Gate:
    """Holds whoever calls :meth:`reach` until :meth:`open`; counts who arrived."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self.reached = 0

    async def reach(self) -> None:
        self.reached += 1
        await self._open.wait()

    async def count(self) -> int:
        return self.reached

    async def open(self) -> None:
        self._open.set()


class StandInTrainer(Worker):
    """A trainer rank in verl's harness without FSDP (see the module docstring). Every rank loads
    the checkpoint and yields all of it, as verl's FSDP engine does after its all-gathers. On an
    even ``global_steps`` it yields every weight negated (a test then sees that an update's bytes
    are fresh, not a bucket's leftovers). It hands the engine a plain generator, as verl's worker
    does. ``hold_at`` (set per rank) stops the next update's stream at that tensor until the
    :class:`Gate` opens; the actor serves other calls meanwhile, so that stream is an async
    generator (transport's engine takes either kind). ``flatten_next`` sends one tensor in
    another shape."""

    def __init__(self, model_path: str, config: CheckpointEngineConfig) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
        self.hold: tuple[int, Any] | None = None
        self.flatten: str | None = None
        self.perturb = 0.0
        backend = config.backend
        kwargs = dict(config.engine_kwargs.get(backend, {}))
        if self.rank == 0:
            kwargs["is_master"] = True
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, bucket_size=config.update_weights_bucket_megabytes << 20, **kwargs
        )

    def _tensor(self, i: int, name: str, p: torch.Tensor, sign: int, step: int | None) -> Any:
        if name == self.flatten:
            p = p.reshape(-1)
        if self.perturb:  # other elements each step, the same on every rank
            p = _flip_low_bits(p, self.perturb, seed=i * 1_000_003 + (step or 0))
        return p if sign == 1 else -p

    def _weights(self, step: int | None) -> Any:
        """A plain generator, as verl's worker hands its engine (``get_per_tensor_param``)."""
        sign = -1 if step is not None and step % 2 == 0 else 1
        for i, (name, p) in enumerate(self.model.state_dict().items()):
            yield name, self._tensor(i, name, p, sign, step)

    async def _held_weights(self, step: int | None, index: int, gate: Any) -> Any:
        """The same tensors as an async generator that waits at tensor ``index`` for ``gate``
        (the actor serves other calls meanwhile): only for engines that take async iterators,
        as transport's does; verl's nixl engine iterates with a plain ``for``."""
        sign = -1 if step is not None and step % 2 == 0 else 1
        for i, (name, p) in enumerate(self.model.state_dict().items()):
            if i == index:
                await gate.reach.remote()
            yield name, self._tensor(i, name, p, sign, step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
        weights = self._weights(global_steps)
        if self.hold is not None:
            (index, gate), self.hold = self.hold, None
            weights = self._held_weights(global_steps, index, gate)
        return await self.checkpoint_engine.send_weights(weights, global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hold_at(self, index: int, gate: Any) -> None:
        self.hold = (index, gate)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def perturb_next(self, share: float) -> None:
        """From now on flip the lowest bit of about ``share`` of every tensor's elements, drawn
        from the step, the same ones on every rank (what an RL step does to a few percent of
        bf16 weights); 0: the checkpoint as it is."""
        self.perturb = share

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def flatten_next(self, name: str | None) -> None:
        """Yield tensor ``name`` flattened from now on (None: as it is)."""
        self.flatten = name

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


def rollout_worker_group(
    pool: RayResourcePool, model: HFModelConfig, rollout: RolloutConfig, check: bool
) -> tuple[RayWorkerGroup, list[Any], PortReservation]:
    """verl's ``create_rollout_worker_group`` (its tests/checkpoint_engine/test_utils.py: the
    ``CheckpointEngineWorkerTest`` workers and their ``MockReplica`` replicas) with the group's
    master port held until the caller closes the reservation, after it killed the workers.

    verl picks that port by binding port 0 and closing it; its workers bind it for
    torch.distributed seconds later, after importing verl and vLLM, and on a busy host another
    process may have been given it by then (the rank-0 worker fails with EADDRINUSE)."""
    from tests.checkpoint_engine.test_utils import CheckpointEngineWorkerTest, MockReplica
    from verl.utils.device import get_device_name

    from transport.integrations.verl.engine import node_address  # not at import: see NIXL_ON_CPU

    reservation = reserve_port()
    try:
        group = RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(CheckpointEngineWorkerTest),
                model_config=model,
                rollout_config=rollout,
                check_allclose=check,
            ),
            device_name=get_device_name(),
            master_addr=node_address(),
            master_port=str(reservation.port),
        )
    except BaseException:
        reservation.close()
        raise
    per_replica = (
        rollout.tensor_model_parallel_size
        * rollout.data_parallel_size
        * rollout.pipeline_model_parallel_size
    )
    replicas = []
    for rank in range(group.world_size // per_replica):
        replica = MockReplica(replica_rank=rank, config=rollout, model_config=model)
        asyncio.run(replica.init_hybrid(group))  # takes its slice of the group's workers
        replicas.append(replica)
    return group, replicas, reservation
