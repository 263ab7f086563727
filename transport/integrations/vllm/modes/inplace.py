"""The in-place mode: a version straight into the parameters a vLLM worker computes with, where
as_stored.py says vLLM computes with each of them as stored (its GPU builds, unquantized)."""

from __future__ import annotations

import torch

from transport import TornModelError, TransportError, VersionGoneError
from transport.integrations.vllm.as_stored import live_tensors
from transport.integrations.vllm.modes.base import Held, Worker, WrittenInFinish
from transport.integrations.vllm.shards import WorkerLayout
from transport.weights import WindowedSubscriber


class InPlace(WrittenInFinish):
    """A WindowedSubscriber over the parameters vLLM computes with (no staging memory). Rules: its
    publisher writes only inside ``finish_weight_update`` (no engine step runs meanwhile), the
    version ``receive`` named; the model and the version the worker reports change in that call.
    A version that does not complete there after part of it reached the model (its trainer died
    mid-write) leaves the model torn (:class:`TornModelError`); one that a newer version overtook
    leaves the model whole at that newer version (:attr:`overtaken`)."""

    name = "inplace"

    def __init__(self, worker: Worker, layout: WorkerLayout) -> None:
        super().__init__(worker, layout)
        info = worker.info
        self.subscriber = WindowedSubscriber(
            worker.transport,
            live_tensors(worker.model, layout),
            group=info.group,
            layout=layout.dest,
            source_shapes={n: tuple(x.shape) for n, x in worker.spec.items()},
            delta=info.delta,
        )
        #: the version that overtook the one an update named (it landed whole in its place)
        self.overtaken: int | None = None

    @property
    def group(self) -> str:
        return self.subscriber.group

    @property
    def need(self) -> int:
        return 0

    def finish(self) -> int | None:
        wanted = self.take()
        if wanted is None:
            return None
        assert wanted.version is not None
        sub = self.subscriber
        try:
            sub.receive(wanted.version, wanted.timeout)
        except VersionGoneError:
            self.overtaken = sub.version  # a newer version landed whole in its place
            raise
        except (TransportError, RuntimeError) as e:
            torn = sub.torn
            if torn is None:
                raise  # nothing was written: the model keeps its version
            raise TornModelError(
                f"version {wanted.version} of group {sub.group} did not complete in place "
                f"({e}): the model holds parts of versions {torn} and {sub.version} and "
                "reports version -2 until a version lands whole (the next update)",
                torn,
            ) from e
        if self.worker.device.type == "cuda":
            torch.cuda.synchronize(self.worker.device)
        return wanted.version

    def held(self) -> Held:
        sub = self.subscriber
        return Held(complete=sub.version, incomplete=sub.incomplete)

    def close(self) -> None:
        self.drop()
        self.subscriber.close()
