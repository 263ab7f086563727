"""verl's checkpoint engine ``"transport"``: one-sided bucket streaming over this library.

Set ``actor_rollout_ref.rollout.checkpoint_engine.backend=transport`` and
``checkpoint_engine.custom_backend_module=transport.integrations.verl``; verl imports the module
on every worker, which registers :class:`TransportCheckpointEngine`. Options go under
``checkpoint_engine.engine_kwargs.transport`` (see the class).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from transport import Transport
from transport.integrations.setup import connect
from transport.store import TcpStore
from transport.weights.buckets import (
    SLOTS,
    Assembler,
    BucketReceiver,
    BucketSender,
    EngineInfo,
    Inbox,
    PieceCopies,
    UpdatePlan,
    build_plans,
)
from transport.weights.delta import DeltaPolicy

log = logging.getLogger(__name__)


def node_address() -> str:
    """This node's address as Ray knows it (loopback outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except ImportError:
        pass
    return "127.0.0.1"


@CheckpointEngineRegistry.register("transport")
class TransportCheckpointEngine(CheckpointEngine):
    """A verl checkpoint engine on this library: peers meet through the store, trainer ranks
    write buckets one-sided into the rollout workers' two slots, receivers yield each tensor as
    soon as its bucket landed (see sender.py, receiver.py and topology.py for the protocol).

    It owns one Transport (made at the first update, kept across updates: connections and
    registrations are paid once), the inbox of its control messages, and its buckets: a rollout
    worker's two slots (``2 * bucket_size``), a trainer rank's send buffers (two when it is the
    only rank, else one: the other ranks' buckets give it time). Options
    (``engine_kwargs.transport``):

    * ``store``: the store URL every engine joins (default ``$TRANSPORT_STORE``; without either,
      trainer rank 0, ``is_master``, hosts an embedded store for the job: the job's store dies
      with that process, so give a Redis URL where a trainer may restart).
    * ``namespace`` (``"verl"``), ``timeout`` (seconds a bucket or a free slot may take: 300),
    * ``relay_degree``: children per relay; 0 writes every rollout worker from the trainer
      ranks; None (default) is 0 up to 4 rollout workers and 4 above.
    * ``device``: where buckets live (default ``cuda`` when there is one, else ``cpu``).
    * ``keep_buckets``: keep the buckets between updates (default: on the CPU yes, on a GPU no,
      so that the memory goes back to the KV cache).
    * ``delta``: keep a copy of what this engine sent or received (on ``device``: the model's
      bytes once, a trainer rank those of the buckets it fills), so that once every engine of
      the job holds the same update, each bucket travels as the changes of its tensors against
      it (weights/buckets/changes.py; a bucket whose changes exceed half its data goes raw).
      ``"auto"``: as ``true``, but a trainer rank diffs only while its updates as changes cost
      it less than raw ones did (weights/delta/policy.py: it rests, without copies, and looks
      again after 4, 8 ... 256 updates); a rollout worker takes ``"auto"`` as ``true``. Every
      engine of the job must set it (default off).

    The secret, if the namespace has one, comes from ``$TRANSPORT_SECRET``; every engine of the
    job needs the same. Rules: ``prepare`` -> ``build_topology`` -> ``init_process_group`` ->
    ``send_weights`` (trainer) or ``receive_weights`` (rollout) -> ``finalize``, once per update;
    ``init_process_group`` of the next update supersedes one still running on this engine (verl's
    manager moves on at the first error while other ranks still send): that one stops at its
    next step, and ``init_process_group`` returns once its puts in flight settled. A rollout
    worker frees its slots for an update only once every engine that writes it began that
    update, so no byte of an earlier one lands in it even when an orchestrator starts sending
    before every engine's ``init_process_group`` returned (verl's manager waits for all); a tensor yielded by ``receive_weights`` is a view of a bucket, valid until the next tensor
    of another bucket is asked for (clone it to keep it).
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        store: str | None = None,
        namespace: str = "verl",
        timeout: float = 300.0,
        relay_degree: int | None = None,
        device: str | None = None,
        keep_buckets: bool | None = None,
        delta: bool | str = False,
    ) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 4096:
            raise ValueError(
                f"transport checkpoint engine: the bucket size is {bucket_size!r} bytes; it must "
                "be at least 4096 (set checkpoint_engine.update_weights_bucket_megabytes >= 1)"
            )
        if relay_degree is not None and (
            not isinstance(relay_degree, int) or not 0 <= relay_degree <= 64
        ):
            raise ValueError(
                f"transport checkpoint engine: relay_degree is None or 0 to 64, got {relay_degree!r}"
            )
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(
                f"transport checkpoint engine: timeout must be > 0 seconds, got {timeout!r}"
            )
        if not (isinstance(delta, bool) or delta == "auto"):
            raise ValueError(
                f"transport checkpoint engine: delta is true, false or auto, got {delta!r}"
            )
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.store_url = store or os.environ.get("TRANSPORT_STORE") or None
        self.namespace = namespace
        self.timeout = float(timeout)
        self.relay_degree = relay_degree
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.keep_buckets = (
            self.device.type == "cpu" if keep_buckets is None else bool(keep_buckets)
        )
        self.name = f"verl-{secrets.token_hex(6)}"
        self.transport: Transport | None = None
        self.inbox: Inbox | None = None
        self.plan: UpdatePlan | None = None
        self.assembler = Assembler(self.device)
        self._hosted: TcpStore | None = None
        self._buffers: list[torch.Tensor] = []
        self._slots: torch.Tensor | None = None
        self.copies = PieceCopies() if delta else None
        self.policy = DeltaPolicy(delta == "auto") if delta else None  # a trainer rank's
        self._scratch: torch.Tensor | None = None  # a delta bucket laid out raw (rollout)

    # -- the store and the Transport ----------------------------------------------------------

    def _join(self, url: str) -> Transport:
        if self.transport is None:
            self.transport = connect(
                self.name,
                store=url,
                namespace=self.namespace,
                hint="check engine_kwargs.transport.store or $TRANSPORT_STORE, and that trainer "
                "rank 0 is up when it hosts the store",
            )
            self.inbox = Inbox(self.transport)
        return self.transport

    def prepare(self) -> EngineInfo:  # type: ignore[override]
        """This engine's introduction; trainer rank 0 hosts the job's store when none is given."""
        if self.store_url is None and self.is_master and self._hosted is None:
            self._hosted = TcpStore(node_address(), 0, hosting="yes")
            self.store_url = f"tcp://{node_address()}:{self._hosted.port}?host=no"
        if self.store_url is not None:
            self._join(self.store_url)  # an unreachable store fails here, naming it
        return EngineInfo(
            self.name,
            self.store_url if (self.is_master or self.store_url) else None,
            self.bucket_size,
            self.relay_degree,
            self.copies is not None,
            "" if self.copies is None else self.copies.token,
        )

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        trainers, rollouts = build_plans(actor_wg_world_size, rollout_world_size, list(metadata))
        return {"plan": list(trainers)}, {"plan": list(rollouts)}

    def init_process_group(self, plan: UpdatePlan) -> None:  # type: ignore[override]
        """Join the store (first update), allocate this role's buckets, start the update."""
        if not isinstance(plan, UpdatePlan):
            raise TypeError(
                f"init_process_group takes the UpdatePlan of build_topology, got {type(plan).__name__}"
            )
        t = self._join(plan.store)
        assert self.inbox is not None
        if plan.role == "trainer":
            count = 2 if len(plan.trainers) == 1 else 1
            if len(self._buffers) != count:
                self._buffers = [
                    torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device)
                    for _ in range(count)
                ]
                for buf in self._buffers:
                    t.register(buf)
        elif self._slots is None:
            self._slots = torch.zeros(2 * self.bucket_size, dtype=torch.uint8, device=self.device)
            t.expose(SLOTS, self._slots, access="w")
        self.plan = plan
        # supersedes one still running here, then tells the peers this engine writes
        self.inbox.begin(plan.token, self.timeout, writes=plan.targets)

    def finalize(self) -> None:
        """End the update; without ``keep_buckets``, give the buckets' memory back."""
        self.plan = None
        if self.keep_buckets or self.transport is None:
            return
        if self._slots is not None:
            self.transport.unexpose(SLOTS)
            self._slots = None
        self._buffers = []

    # -- the update -----------------------------------------------------------------------------

    def _plan_for(self, role: str) -> UpdatePlan:
        if self.plan is None or self.transport is None or self.inbox is None:
            raise RuntimeError("transport checkpoint engine: init_process_group must come first")
        if self.plan.role != role:
            raise RuntimeError(
                f"transport checkpoint engine {self.name} is a {self.plan.role} in this update; "
                f"only a {role} may call this"
            )
        return self.plan

    @torch.no_grad()
    async def send_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        global_steps: int | None = None,
    ) -> dict[str, float]:
        """Stream ``weights`` (every rank consumes all of them) into the rollout workers."""
        plan = self._plan_for("trainer")
        assert self.transport is not None and self.inbox is not None
        sender = BucketSender(
            self.transport, self.inbox, plan, self._buffers, self.timeout, self.copies, self.policy
        )
        report = await sender.send(weights)
        if report.dropped:
            log.warning(
                "update %s (step %s): rank %d dropped %s",
                plan.token,
                global_steps,
                plan.rank,
                report.dropped,
            )
        return report.metrics(plan.rank)

    @torch.no_grad()
    async def receive_weights(  # type: ignore[override]
        self, global_steps: int | None = None
    ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Each tensor of the update as soon as its bucket landed (a view of the bucket)."""
        plan = self._plan_for("rollout")
        assert self.transport is not None and self.inbox is not None and self._slots is not None
        if self.copies is not None and self._scratch is None:
            self._scratch = torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device)
        receiver = BucketReceiver(
            self.transport,
            self.inbox,
            plan,
            self._slots,
            self.assembler,
            self.timeout,
            self.copies,
            self._scratch,
        )
        async for item in receiver.receive():
            yield item

    def close(self) -> None:
        """Leave the store and free everything (the engine is unusable afterwards)."""
        if self.inbox is not None:
            self.inbox.close()
        if self.transport is not None:
            self.transport.close()
        if self._hosted is not None:
            self._hosted.close()
        self.transport = self.inbox = None
        self._hosted = None
