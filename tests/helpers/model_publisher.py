"""A trainer process holding one of the small test models in transformers (helpers.llama) and
publishing its versions to a group with a ShardedPublisher of one rank (each worker gets only
what it declares), under the names in memory (experts fused) or the names its saved checkpoint
holds (one tensor per expert matrix, what a trainer exporting checkpoints sends)."""

from __future__ import annotations

import os
from typing import Any

from helpers.child import ChildProcess, serve
from helpers.llama import checkpoint_tensors, hf_model, set_version


def _child(conn: Any, name: str, store: str, kind: str, group: str, names: str, parts: int) -> None:
    import transport
    from transport.integrations.vllm.modes.streamed import part_group
    from transport.weights import ShardedPublisher, SourceLayout

    try:
        t = transport.Transport(name, store=store, timeout=30)
        model: Any = hf_model(0, kind=kind)
        state = {n: p.detach() for n, p in model.named_parameters()}
        sent = state if names == "model" else checkpoint_tensors(model, state)
        layout = SourceLayout.single(sent)
        # a streamed version's further parts are groups of their own (integrations/vllm/streamed)
        groups = [group] + [part_group(group, k) for k in range(1, parts)]
        pubs = [ShardedPublisher(t, sent, layout, 0, group=g) for g in groups]
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (t.generation, os.getpid())))

    def publish(version: int, timeout: float = 30.0) -> tuple[dict[str, str], dict[str, str]]:
        """Every part's group; each worker's worst status over the parts, every reason."""
        set_version(state, version)
        if sent is not state:
            for n, x in checkpoint_tensors(model, state).items():
                sent[n].copy_(x)
        status: dict[str, str] = {}
        reasons: dict[str, str] = {}
        for h in [p.publish(version, timeout=timeout) for p in pubs]:
            r = h.wait(timeout + 30)
            for peer, said in r.status.items():
                status[peer] = said if status.get(peer, "done") == "done" else status[peer]
            reasons.update(r.reasons)
        return status, reasons

    def traffic() -> dict[str, int]:
        return {n: x.written for n, x in t.traffic().items()}

    handlers = {"publish": publish, "traffic": traffic, "count": lambda: len(sent)}
    serve(conn, handlers, lambda: ([p.close() for p in pubs], t.close()))


class ModelPublisher(ChildProcess):
    """Publishes versions (helpers.llama.set_version) of the test model ``kind`` to ``group``,
    its tensors named ``names`` ("model" or "checkpoint"); ``parts``: the groups of a streamed
    version it publishes too. Commands: ``publish(version, timeout)`` -> (status, reasons),
    ``traffic`` (bytes written to each peer so far), ``count`` (how many tensors it
    publishes)."""

    FROM_VLLM_SERVER = True  # builds its model with transformers (helpers.child)

    def __init__(
        self,
        name: str,
        store_url: str,
        kind: str,
        group: str,
        names: str = "model",
        parts: int = 1,
    ) -> None:
        super().__init__(name, _child, (store_url, kind, group, names, parts), 90)


def _rank_child(
    conn: Any, name: str, store: str, kind: str, group: str, world: int, rank: int
) -> None:
    import transport
    from transport.weights import ShardedPublisher, SourceLayout

    try:
        t = transport.Transport(name, store=store, timeout=30)
        model: Any = hf_model(0, kind=kind)
        full = {n: p.detach() for n, p in model.named_parameters()}
        # expert-parallel training: each rank holds a range of whole experts (the fused 3-D
        # tensors split along dim 0), every other tensor replicated
        dims = {n: 0 if x.dim() == 3 else None for n, x in full.items()}
        layout = SourceLayout.split(world, {n: (x.shape, x.dtype) for n, x in full.items()}, dims)

        def mine() -> dict[str, Any]:
            return {
                n: full[n][tuple(slice(lo, hi) for lo, hi in s.held[rank].box(s.shape))].clone()
                for n, s in layout.tensors.items()
            }

        shards = mine()
        pub = ShardedPublisher(t, shards, layout, rank, group=group)
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (t.generation, os.getpid())))

    def publish(version: int, timeout: float = 30.0) -> tuple[dict[str, str], dict[str, str]]:
        set_version(full, version)  # the whole model's values of that version, then our part
        for n, x in mine().items():
            shards[n].copy_(x)
        r = pub.publish(version, timeout=timeout).wait(timeout + 30)
        return dict(r.status), dict(r.reasons)

    def traffic() -> dict[str, int]:
        return {n: x.written for n, x in t.traffic().items()}

    serve(conn, {"publish": publish, "traffic": traffic}, lambda: (pub.close(), t.close()))


class ExpertParallelRank(ChildProcess):
    """Rank ``rank`` of a ``world``-rank expert-parallel trainer of the test model ``kind``: it
    holds its range of whole experts and every other tensor, and publishes with a
    ShardedPublisher (no gather). Commands: ``publish(version, timeout)`` -> (status,
    reasons), ``traffic``."""

    FROM_VLLM_SERVER = True  # builds its model with transformers (helpers.child)

    def __init__(self, name: str, store_url: str, kind: str, group: str, world: int, rank: int):
        super().__init__(name, _rank_child, (store_url, kind, group, world, rank), 90, False)
