"""What a LoRA adapter is on the wire, for the trainer and for vLLM's workers alike: its config
(rank, alpha, target modules), the names and shapes of its tensors, its weight group, and the
LoRA id vLLM serves it under.

An adapter's tensors are named after the base checkpoint's modules, as peft saves them without
its ``base_model.model.`` prefix: ``model.layers.0.self_attn.q_proj.lora_A.weight`` (rank x the
module's inputs) and ``...lora_B.weight`` (the module's outputs x rank), for every linear module
of the base checkpoint whose last name is a target. Both sides compute the same list from the
base checkpoint's spec and the config, so a worker declares what it receives before the first
version and a trainer whose adapter differs is refused, naming the tensor.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: peft's names of an adapter's parameters in a model it wraps
_PEFT = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<ab>lora_[AB])\.[^.]+\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """An adapter's ``rank``, ``alpha`` (the update is ``alpha / rank * B @ A``, or
    ``alpha / sqrt(rank)`` with ``rslora``) and ``targets``, the last names of the base modules
    it adapts (``q_proj``, ``down_proj``...), sorted."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"transport adapter: rank is an int >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"transport adapter: alpha is a finite number, got {self.alpha!r}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(
                f"transport adapter: targets names at least one module, got {self.targets!r}"
            )

    def peft(self) -> dict[str, Any]:
        """The fields of peft's ``adapter_config.json`` that vLLM reads."""
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.targets),
            "use_rslora": self.rslora,
            "bias": "none",
        }

    def differences(self, other: AdapterConfig) -> list[str]:
        """What differs from ``other``, named (empty: nothing)."""
        out = []
        for field in ("rank", "alpha", "targets", "rslora"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                out.append(f"{field} {theirs!r} -> {mine!r}")
        return out


def adapter_group(adapter: str) -> str:
    """The weight group that carries the versions of adapter ``adapter``."""
    return f"adapter.{adapter}"


def adapter_id(namespace: str, adapter: str) -> int:
    """The LoRA id vLLM serves adapter ``adapter`` of ``namespace`` under: the same in every
    worker and for every client, from the names alone; above the ids vLLM gives adapters loaded
    from files (it counts from 1), and checked against the ones a worker holds."""
    return 2**30 + zlib.crc32(f"{namespace}/{adapter}".encode()) % 2**30


def proof(secret: str | None, *fields: Any) -> str:
    """What a trainer sends with a request about an adapter (its init, an install, a removal) to
    show it holds the namespace's secret: an HMAC-SHA256 of the request's fields as JSON ("" for
    a namespace without a secret). vLLM's workers and the adapter routes check it against the
    secret in their own environment."""
    if not secret:
        return ""
    message = json.dumps(list(fields)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def check_proof(secret: str | None, given: str, what: str, *fields: Any) -> None:
    """PermissionError naming ``what`` unless ``given`` is :func:`proof` of ``fields``."""
    want = proof(secret, *fields)
    if want and not hmac.compare_digest(want, given if isinstance(given, str) else ""):
        raise PermissionError(
            f"{what}: its namespace has a secret and the request does not prove it (send it "
            "through the adapter trainer, which holds the namespace's secret)"
        )


def lora_spec(
    base: Mapping[str, torch.Tensor], config: AdapterConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The adapter's tensors (on the meta device), in the base checkpoint's order: A and B of
    every 2-D ``.weight`` of ``base`` whose module's last name is one of the targets. ValueError
    naming a target that matches no module."""
    out: dict[str, torch.Tensor] = {}
    hit: set[str] = set()
    for name, t in base.items():
        module, _, leaf = name.rpartition(".")
        short = module.rpartition(".")[2]
        if leaf != "weight" or t.dim() != 2 or short not in config.targets:
            continue
        hit.add(short)
        rows, cols = t.shape
        out[f"{module}.lora_A.weight"] = torch.empty(config.rank, cols, dtype=dtype, device="meta")
        out[f"{module}.lora_B.weight"] = torch.empty(rows, config.rank, dtype=dtype, device="meta")
    missing = sorted(set(config.targets) - hit)
    if missing:
        raise ValueError(
            f"transport adapter: target modules {missing} match no linear module of the base "
            "model (targets are last names of its modules, such as q_proj or down_proj)"
        )
    return out


def from_peft(
    model: Any, adapter: str = "default"
) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """A peft model's adapter ``adapter``: its config, and its A and B parameters under the
    names of :func:`lora_spec` (the parameters themselves: published in place, read at each
    publish). ValueError naming what peft holds that an adapter here cannot carry."""
    config = getattr(model, "peft_config", {}).get(adapter)
    if config is None:
        raise ValueError(
            f"transport adapter: the model holds no peft adapter {adapter!r} (wrap it with "
            "peft.get_peft_model, or name the adapter)"
        )
    patterns = dict(getattr(config, "rank_pattern", {}) or {}) or dict(
        getattr(config, "alpha_pattern", {}) or {}
    )
    if patterns or getattr(config, "use_dora", False) or getattr(config, "bias", "none") != "none":
        raise ValueError(
            "transport adapter: per-module ranks or alphas, DoRA and adapter biases are not "
            "carried (vLLM's LoRA slots take one rank and alpha, and no bias); train without them"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        m = _PEFT.match(name)
        if m is None or f".{adapter}." not in name:
            continue
        tensors[f"{m['module']}.{m['ab']}.weight"] = p.detach()
    if not tensors:
        raise ValueError(f"transport adapter: peft adapter {adapter!r} has no LoRA parameters")
    targets = sorted({n.rsplit(".", 3)[1] for n in tensors})
    rank = int(config.r)
    return AdapterConfig(
        rank, float(config.lora_alpha), tuple(targets), bool(config.use_rslora)
    ), tensors
