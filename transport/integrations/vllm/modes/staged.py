"""The staged modes: a version lands in staging copies while vLLM serves, and loads inside
``finish_weight_update``. **sharded**: the worker's own parameters in vLLM's format (its TP slice
of every column- and row-parallel weight, its part of fused q/k/v and gate/up), declared as a
layout over the checkpoint tensors (shards.py); **whole**: every checkpoint tensor whole, for
vLLM's loader to fuse and shard."""

from __future__ import annotations

from transport import WeightSubscriber
from transport.integrations.vllm.modes.base import Held, Staging, Worker
from transport.integrations.vllm.modes.loading import load_version
from transport.integrations.vllm.shards import WorkerLayout, spec_of


class Staged(Staging):
    """A staging WeightSubscriber of the group with one or two slots (see :func:`slots`). Rules:
    ``receive`` waits for the version and holds its slot (the publisher does not write a held
    slot), ``finish`` loads it and lets go; with one slot the next version is written only after
    the last one was loaded or dropped."""

    name = "sharded"

    def __init__(self, worker: Worker, layout: WorkerLayout) -> None:
        super().__init__(worker, layout)
        info = worker.info
        self.slots, self.why_slots = slots(info.staging_slots, layout, worker.room.bound, worker)
        self.subscriber = WeightSubscriber(
            worker.transport,
            spec_of(layout),
            group=info.group,
            mode="staging",
            staging_device=worker.staging,
            layout=layout.dest if layout.targets else None,
            source_shapes={n: tuple(x.shape) for n, x in worker.spec.items()},
            slots=self.slots,
            delta=info.delta,
        )

    @property
    def said(self) -> str:
        return "sharded" if self.layout.targets else "whole"

    @property
    def need(self) -> int:
        return self.slots * self.layout.nbytes

    def finish(self) -> int | None:
        snap = self.snapshot
        if snap is None:
            return None
        try:
            load_version(self.worker, self.layout, [snap.tensors], snap.version)
        finally:
            self.drop()
        return snap.version

    def held(self) -> Held:
        sub, snap = self.subscriber, self.snapshot
        storages = {}
        for slot in sub.staging:
            for x in slot.values():
                storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return Held(
            held=None if snap is None else snap.version,
            complete=sub.version,
            incomplete=sub.incomplete,
            slots=len(sub.staging),
            nbytes=sum(storages.values()),
        )

    def close(self) -> None:
        self.drop()
        self.subscriber.close()


def slots(asked: int | None, layout: WorkerLayout, bound: int, worker: Worker) -> tuple[int, str]:
    """How many staging copies of ``layout``'s version a worker keeps, and why; ValueError
    (naming the need) when the bound does not allow what is asked, or even one."""
    one = layout.nbytes
    mode = "sharded" if layout.targets else "whole"
    how = worker.room.how

    def refuse(n: int) -> ValueError:
        return ValueError(
            f"transport init_info: {n} staging slot(s) of the {mode} mode need "
            f"{n * one / 2**30:.3f} GiB ({one / 2**30:.3f} GiB each), more than "
            f"{bound / 2**30:.3f} GiB ({how}); raise staging_gb, use one slot, or serve with "
            "more tensor-parallel ranks"
        )

    if asked is not None:
        if asked * one > bound:
            raise refuse(asked)
        return asked, "asked for by init_info staging_slots"
    if 2 * one <= bound:
        return 2, f"two fit within {bound / 2**30:.3f} GiB ({how})"
    if one <= bound:
        return 1, f"two would need {2 * one / 2**30:.3f} GiB, more than {how}"
    raise refuse(1)
