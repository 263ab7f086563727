"""Trainer ranks (ShardedPublisher) and generators (WeightSubscriber with a declared layout) in
child processes, for the sharded weight-sync tests.

The model is a small Llama-like state dict (:func:`model_spec`) whose weights of version ``v``
are a function of ``v`` (:func:`full_weights`): every process builds the same bytes, so a
generator checks what arrived against a reference built from the full weights in its own
process (torch's chunk and cat, as vLLM shards and fuses; ``.to(dtype)`` for conversions;
``convert.fp8_blockwise`` for fp8) and reports the tensors that differ. Every call has a
deadline; nothing here sleeps.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from helpers import internals
from helpers.child import ChildProcess, serve

MiB = 1 << 20


def model_spec(hidden: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """name -> shape: q, k, v (half as many heads), o, gate, up, down and a norm per layer."""
    ff, kv = hidden * 11 // 4, hidden // 2
    out: dict[str, tuple[int, ...]] = {"embed": (vocab, hidden)}
    for i in range(layers):
        p = f"l{i}."
        out |= {
            p + "q": (hidden, hidden),
            p + "k": (kv, hidden),
            p + "v": (kv, hidden),
            p + "o": (hidden, hidden),
            p + "gate": (ff, hidden),
            p + "up": (ff, hidden),
            p + "down": (hidden, ff),
            p + "norm": (hidden,),
        }
    return out


def source_dims(spec: dict[str, tuple[int, ...]]) -> dict[str, int | None]:
    """dim 0 shards for most tensors, dim 1 for the row-parallel ones, norms replicated."""
    return {
        n: (None if n.endswith("norm") else 1 if n.endswith((".o", ".down")) else 0) for n in spec
    }


def full_weights(
    spec: dict[str, tuple[int, ...]], version: int, sparse: float = 0.0
) -> dict[str, torch.Tensor]:
    """Version ``version`` of the weights: all new each version, or (``sparse``) version 0
    with steps 1 to ``version`` applied, each changing that share of every tensor's elements
    (every fifth step all of them: a dense version)."""
    g = torch.Generator().manual_seed(1000 + (0 if sparse else version))
    out = {n: torch.randn(s, generator=g) for n, s in spec.items()}
    for step in range(1, version + 1) if sparse else ():
        share = 1.0 if step % 5 == 0 else sparse
        g = torch.Generator().manual_seed(5000 + step)
        for t in out.values():
            flat = t.view(-1)
            n = max(1, int(flat.numel() * share))
            idx = torch.randint(0, flat.numel(), (n,), generator=g).unique()
            flat[idx] += 0.01 * torch.randn(idx.numel(), generator=g)
    return out


def source_layout(spec: dict[str, tuple[int, ...]], world: int, sizes: Any = None) -> Any:
    from transport.weights import SourceLayout

    return SourceLayout.split(
        world, {n: (s, torch.float32) for n, s in spec.items()}, source_dims(spec), sizes
    )


def shard_of(layout: Any, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for n, t in layout.tensors.items():
        box = t.held[rank].box(t.shape)
        out[n] = full[n][tuple(slice(lo, hi) for lo, hi in box)].contiguous()
    return out


def dest_layout(spec: dict[str, tuple[int, ...]], kind: str) -> dict[str, Any] | None:
    """A generator's layout: ``full`` (None: whole tensors by name), ``bf16``, ``fp8`` or
    ``tp<r>of<m>`` (vLLM's: fused qkv_proj and gate_up_proj, column and row shards)."""
    from transport.weights import DestTensor, full_copy, tp_shard

    src = source_layout(spec, 1)
    if kind == "full":
        return None
    if kind == "bf16":
        return {n: DestTensor(d.shape, torch.bfloat16, d.pieces) for n, d in full_copy(src).items()}
    if kind == "fp8":  # every matrix in e4m3 with 128x128 block scales, the norms as they are
        from transport.weights import fp8

        return fp8(full_copy(src), block=(128, 128))
    rank, degree = (int(x) for x in kind[2:].split("of"))
    out = {"embed": tp_shard(src, "embed", ["embed"], 0, degree, rank)}
    for i in range(sum(n.endswith(".q") for n in spec)):
        p = f"l{i}."
        out |= {
            p + "qkv_proj": tp_shard(
                src, p + "qkv_proj", [p + "q", p + "k", p + "v"], 0, degree, rank
            ),
            p + "o_proj": tp_shard(src, p + "o_proj", [p + "o"], 1, degree, rank),
            p + "gate_up_proj": tp_shard(
                src, p + "gate_up_proj", [p + "gate", p + "up"], 0, degree, rank
            ),
            p + "down_proj": tp_shard(src, p + "down_proj", [p + "down"], 1, degree, rank),
            p + "norm": full_copy(src, [p + "norm"])[p + "norm"],
        }
    return out


def reference(
    spec: dict[str, tuple[int, ...]], kind: str, version: int, sparse: float = 0.0
) -> dict[str, torch.Tensor]:
    """What a generator of ``kind`` must hold for ``version``, from the full weights."""
    full = full_weights(spec, version, sparse)
    if kind == "full":
        return full
    if kind == "bf16":
        return {n: t.to(torch.bfloat16) for n, t in full.items()}
    if kind == "fp8":
        from transport.weights.layouts.convert import fp8_blockwise

        out = {}
        for n, t in full.items():
            if t.dim() == 2:
                out[n], out[n + "_scale"] = fp8_blockwise(t, (128, 128))
            else:
                out[n] = t
        return out
    rank, degree = (int(x) for x in kind[2:].split("of"))
    out = {"embed": full["embed"].chunk(degree, 0)[rank]}
    for i in range(sum(n.endswith(".q") for n in spec)):
        p = f"l{i}."

        def part(name: str, dim: int, p: str = p) -> torch.Tensor:
            return full[p + name].chunk(degree, dim)[rank]

        out |= {
            p + "qkv_proj": torch.cat([part("q", 0), part("k", 0), part("v", 0)]),
            p + "o_proj": part("o", 1),
            p + "gate_up_proj": torch.cat([part("gate", 0), part("up", 0)]),
            p + "down_proj": part("down", 1),
            p + "norm": full[p + "norm"],
        }
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape, dtype and bytes (fp8 included)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _rank_child(
    conn: Any,
    name: str,
    store: str,
    spec: Any,
    world: int,
    rank: int,
    sizes: Any,
    kwargs: dict[str, Any],
) -> None:
    import transport
    from transport.weights import ShardedPublisher

    layout = source_layout(spec, world, sizes)
    t = transport.Transport(name, store=store, timeout=30)
    sparse = kwargs.pop("sparse", 0.0)
    shards = shard_of(layout, full_weights(spec, 0, sparse), rank)
    pub = ShardedPublisher(t, shards, layout, rank, group="policy", **kwargs)

    def publish(version: int, timeout: float) -> dict[str, Any]:
        for n, s in shard_of(layout, full_weights(spec, version, sparse), rank).items():
            shards[n].copy_(s)
        r = pub.publish(version, timeout=timeout).wait(timeout + 30)
        return {
            "done": r.done,
            "excluded": r.excluded,
            "lost": r.lost,
            "reasons": r.reasons,
            "patched": r.patched,
        }

    reached = threading.Event()

    def hold_ver() -> None:
        """From now on this rank's ``ver`` never goes: its bytes land, its completion not (a
        test then kills the process mid-version)."""
        internals.hold_completions(t, reached)

    def wait_held(timeout: float) -> bool:
        """Whether a held ``ver`` was reached (all of this rank's bytes landed) within ``timeout``."""
        return reached.wait(timeout)

    def publish_nowait(version: int, timeout: float) -> None:
        for n, s in shard_of(layout, full_weights(spec, version), rank).items():
            shards[n].copy_(s)
        pub.publish(version, timeout=timeout)

    def set_delta(value: Any) -> Any:
        """``pub.delta = value``; returns what it reads back."""
        pub.delta = value
        return pub.delta

    def close() -> None:
        pub.close()
        t.close()

    conn.send(("ok", (t.generation, 0)))
    serve(
        conn,
        {
            "publish": publish,
            "publish_nowait": publish_nowait,
            "hold_ver": hold_ver,
            "wait_held": wait_held,
            "set_delta": set_delta,
        },
        close,
    )


def _gen_child(
    conn: Any, name: str, store: str, spec: Any, kind: str, mode: str, options: dict[str, Any]
) -> None:
    import transport

    layout = dest_layout(spec, kind)
    sparse, delta = options.pop("sparse", 0.0), options.pop("delta", False)
    shapes = reference(spec, kind, 0)
    live = {n: torch.zeros_like(x) for n, x in shapes.items()}
    t = transport.Transport(name, store=store, **{"timeout": 30, **options})
    sub = transport.WeightSubscriber(t, live, group="policy", mode=mode, layout=layout, delta=delta)

    def check(version: int, timeout: float) -> dict[str, Any]:
        """Wait for ``version`` and compare every tensor with the reference: the names that differ."""
        got = sub.wait_for_version(version, timeout)
        if mode == "staging":
            sub.apply()
        want = reference(spec, kind, got, sparse)
        bad = [n for n in want if not same(live[n], want[n])]
        counts = (sub.deltas.patched, sub.deltas.refused)
        return {"version": got, "bad": bad, "incomplete": sub.incomplete, "deltas": counts}

    def held() -> dict[str, Any]:
        """What the live tensors hold now, without waiting: the version and the tensors that
        differ from it."""
        v = sub.apply() if mode == "staging" else sub.version
        want = reference(spec, kind, v, sparse) if v >= 0 else {}
        return {
            "version": v,
            "bad": [n for n in want if not same(live[n], want[n])],
            "incomplete": sub.incomplete,
        }

    def close() -> None:
        sub.close()
        t.close()

    conn.send(("ok", (t.generation, 0)))
    serve(
        conn,
        {
            "check": check,
            "held": held,
            "parts": lambda: internals.rank_parts(sub),
            "upstream_ranks": lambda: internals.upstream_ranks(sub),
            "upstream_reads": lambda: internals.upstream_reads(sub),
        },
        close,
    )


class RankProcess(ChildProcess):
    """Trainer rank ``rank`` of ``world`` in a child: ``publish(version, timeout)`` -> its result."""

    def __init__(
        self,
        name: str,
        store: str,
        spec: Any,
        world: int,
        rank: int,
        sizes: Any = None,
        wait: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(name, _rank_child, (store, spec, world, rank, sizes, kwargs), 120, wait)


class GeneratorProcess(ChildProcess):
    """A generator of layout ``kind`` in a child: ``check(version, timeout)``; ``options`` go
    to its Transport (``secret=``)."""

    def __init__(
        self,
        name: str,
        store: str,
        spec: Any,
        kind: str,
        mode: str = "staging",
        wait: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(name, _gen_child, (store, spec, kind, mode, options), 120, wait)
