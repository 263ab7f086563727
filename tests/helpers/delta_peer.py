"""A subscriber of a weight group in a child process for the delta tests: it reports the bytes it
holds as digests (one per tensor), so a test compares every byte with the trainer's without
moving them; ``delta`` is its ``WeightSubscriber(delta=...)``.

:func:`model` makes the tensors of a small transformer as people serve them (tied embeddings,
grouped-query attention with biases, fused q/k/v and gate/up, experts fused, norms in float32,
an fp8 copy with its scales); :func:`step` changes a share of their elements the way a training
step in bfloat16 does (most elements keep their bits)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from helpers import internals
from helpers.child import ChildProcess, serve

Spec = dict[str, tuple[tuple[int, ...], str]]


def model_spec(layers: int = 2, hidden: int = 256, experts: int = 4, vocab: int = 4096) -> Spec:
    """Names, shapes and dtypes of a small mixture of experts with grouped-query attention."""
    heads, kv, head = 8, 2, hidden // 8
    ffn = 2 * hidden
    spec: Spec = {"model.embed_tokens.weight": ((vocab, hidden), "bfloat16")}  # tied: no lm_head
    for i in range(layers):
        p = f"model.layers.{i}"
        spec[f"{p}.self_attn.qkv_proj.weight"] = (((heads + 2 * kv) * head, hidden), "bfloat16")
        spec[f"{p}.self_attn.qkv_proj.bias"] = (((heads + 2 * kv) * head,), "bfloat16")
        spec[f"{p}.self_attn.o_proj.weight"] = ((hidden, heads * head), "bfloat16")
        spec[f"{p}.mlp.gate.weight"] = ((experts, hidden), "bfloat16")
        spec[f"{p}.mlp.experts.w13_weight"] = ((experts, 2 * ffn, hidden), "bfloat16")
        spec[f"{p}.mlp.experts.w2_weight"] = ((experts, hidden, ffn), "bfloat16")
        spec[f"{p}.input_layernorm.weight"] = ((hidden,), "float32")
        spec[f"{p}.post_attention_layernorm.weight"] = ((hidden,), "float32")
        spec[f"{p}.mlp.shared.weight_fp8"] = ((hidden, ffn), "float8_e4m3fn")
        spec[f"{p}.mlp.shared.weight_scale"] = ((hidden // 128, ffn // 128), "float32")
    spec["model.norm.weight"] = ((hidden,), "float32")
    spec["step"] = ((1,), "int64")
    return spec


def model(spec: Spec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in spec.items():
        t = torch.randn(shape, generator=g) * 0.02
        out[name] = t.to(getattr(torch, dtype)) if dtype != "int64" else t.long()
    return out


def step(tensors: dict[str, torch.Tensor], share: float, seed: int) -> None:
    """Change about ``share`` of the elements of every tensor (and the step counter) in place:
    each chosen element moves by one unit of its last place or more, as an optimizer step does.
    The choice is drawn on the CPU, so tensors on any device change the same elements."""
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name == "step":
            t += 1
            continue
        chosen = (torch.rand(t.shape, generator=g) < share).to(t.device)
        moved = (t.float() * 1.01 + 1e-3).to(t.dtype)
        t.copy_(torch.where(chosen, moved, t))


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Per tensor, a digest of its bytes (on any device)."""
    return {
        n: hashlib.sha256(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()[
            :32
        ]
        for n, t in tensors.items()
    }


def _child(
    conn: Any,
    name: str,
    store: str,
    spec: Spec,
    group: str,
    delta: Any,
    mode: str,
    slots: int,
    secret: bytes | None,
) -> None:
    import transport

    landed: list[int] = []  # the versions that completed here, in order (on_update)
    try:
        t = transport.Transport(name, store=store, timeout=30, secret=secret)
        zeros = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (s, d) in spec.items()}
        if mode == "window":
            sub: Any = transport.weights.WindowedSubscriber(t, zeros, group=group, delta=delta)
        else:
            extra = {"slots": slots} if mode == "staging" else {}
            sub = transport.WeightSubscriber(
                t, zeros, group=group, delta=delta, mode=mode, on_update=landed.append, **extra
            )
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (t.generation, os.getpid())))
    release: list[Any] = []

    def applied(version: int, timeout: float) -> dict[str, Any]:
        """Wait for ``version``, apply it, and say what the live tensors hold."""
        sub.wait_for_version(version, timeout)
        before = digests(sub.live)
        got = sub.apply()
        return {
            "version": got,
            "before": before,
            "live": digests(sub.live),
            "patched": sub.deltas.patched,
            "refused": sub.deltas.refused,
        }

    def received(version: int, timeout: float) -> dict[str, Any]:
        """A windowed subscriber: receive ``version`` in its window; what the live tensors hold
        before and after."""
        before = digests(sub.live)
        got = sub.receive(version, timeout)
        return {"version": got, "before": before, "live": digests(sub.live), "torn": sub.torn}

    handlers = {
        "applied": applied,
        "received": received,
        "live": lambda: digests(sub.live),
        "counts": lambda: (sub.deltas.patched, sub.deltas.refused),
        "state": lambda: {"version": sub.version, "applied": sub.applied_version},
        "landed": lambda: list(landed),
        # a relay that holds the forwards asked of it; a subscriber that holds its changes
        "hold_forwards": lambda: release.append(internals.hold_forwards(sub)),
        "hold_patches": lambda: release.append(internals.hold_patches(sub)),
        # its record is not put back in a store that lost it (it goes on beating)
        "hold_record": lambda: release.append(internals.hold_record_restore(t)),
        # its group entry is not put back in a store that lost it
        "hold_entry": lambda: release.append(internals.hold_entry_checks(sub)),
        "unknown_senders": lambda: internals.unknown_senders(sub),
        # its connections to peers that restarted stay (it has not noticed the restart yet)
        "hold_restart_drops": lambda: release.append(internals.hold_restart_drops(t)),
        "release": lambda: release.pop()(),
    }
    serve(conn, handlers, lambda: (sub.close(), t.close()))


class DeltaSubscriber(ChildProcess):
    """A child with a ``WeightSubscriber(delta=delta, mode=mode)`` of ``group`` over zeroed
    tensors of ``spec`` (``mode="window"``: a WindowedSubscriber). Commands: ``applied(version,
    timeout)`` (digests before and after apply(), and the counts of versions patched and patches
    refused), ``received(version, timeout)`` (a window's receive), ``live`` (digests),
    ``counts``, ``state`` (version and applied version), ``landed`` (the versions completed here,
    in order), ``hold_forwards`` (its relay keeps the
    forwards asked of it), ``hold_patches`` (it neither applies nor answers changes),
    ``hold_record`` (its record is not put back in a store that lost it),
    ``hold_restart_drops`` (it keeps its connections to peers that restarted), ``hold_entry``
    (its group entry is not put back in a store that lost it), ``unknown_senders`` (those whose
    messages it holds until the store knows them) and ``release`` (of the last hold)."""

    def __init__(
        self,
        name: str,
        store_url: str,
        spec: Spec,
        group: str = "policy",
        delta: Any = True,
        wait: bool = True,
        mode: str = "staging",
        slots: int = 2,
        secret: bytes | None = None,
    ) -> None:
        args = (store_url, spec, group, delta, mode, slots, secret)
        super().__init__(name, _child, args, 60, wait)
