"""Small models for the vLLM tests, made here (no hub): their folders, the weights of each version
a test publishes (a function of the version number, so every process builds the same bytes),
and transformers' greedy tokens on given weights, the reference vLLM must match (float32).

``kind`` names the model: "llama" (untied embeddings, grouped-query attention), "llama-tied"
(its input and output embeddings one tensor, as Llama 3.2 1B/3B), "qwen2-tied" (q/k/v biases,
grouped-query attention, tied embeddings, as Qwen2.5 0.5B-3B), and mixtures of experts:
"qwen3-moe" (8 experts per layer, top 2, q/k norms, grouped-query attention, as Qwen3-30B-A3B),
"qwen2-moe" (a shared expert with its gate beside 8 routed ones, q/k/v biases, the first layer
dense through ``mlp_only_layers``, as Qwen1.5/Qwen2-MoE; its input and output embeddings one
tensor), "qwen3-moe-padded" (experts of an intermediate size that vLLM's CPU kernel pads).
transformers holds experts fused (``mlp.experts.gate_up_proj``); their saved checkpoints hold one
tensor per expert matrix (:func:`checkpoint_tensors`). A version's values are defined on the
names in memory."""

from __future__ import annotations

from pathlib import Path

import torch

#: prompts as token ids: one longer than a KV block (32), so a stale prefix cache would show
PROMPTS = [list(range(4, 44)), [1, 17, 42, 99, 7, 200, 31]]
NEW_TOKENS = 12


KINDS = ("llama", "llama-tied", "qwen2-tied", "qwen3-moe", "qwen2-moe", "qwen3-moe-padded")
MOE = ("qwen3-moe", "qwen2-moe")
#: the kinds whose input and output embeddings are one tensor
TIED = ("llama-tied", "qwen2-tied", "qwen2-moe")
#: versions from here on are version 1 followed by ``version - STEPS`` small steps, each setting
#: STEP_SHARE of every tensor's elements anew (what delta updates carry)
STEPS = 1000
STEP_SHARE = 0.02


def config(kind: str = "llama", layers: int = 2, hidden: int = 64, vocab: int = 256) -> object:
    from transformers import LlamaConfig, Qwen2Config

    # vLLM's CPU attention needs a head size of at least 32
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 16,
        num_key_value_heads=hidden // 32,
        head_dim=32,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=kind in TIED,
        dtype="float32",
    )
    if kind in (*MOE, "qwen3-moe-padded"):
        from transformers import Qwen2MoeConfig, Qwen3MoeConfig

        # vLLM's CPU experts kernel needs an intermediate size per rank that is a multiple of 32
        common.update(
            num_attention_heads=hidden // 32,
            num_key_value_heads=1,
            num_experts=8,
            num_experts_per_tok=2,
            # padded: an intermediate size vLLM's CPU experts kernel pads (to a multiple of 32)
            moe_intermediate_size=48 if kind.endswith("-padded") else hidden,
            norm_topk_prob=True,
        )
        if kind.startswith("qwen3-moe"):
            return Qwen3MoeConfig(**common)
        common.pop("head_dim")
        return Qwen2MoeConfig(**common, shared_expert_intermediate_size=hidden, mlp_only_layers=[0])
    if kind.startswith("qwen2"):
        # Qwen2 derives the head size (hidden / heads): 2 query heads of 32 share 1 key/value head
        common.update(num_attention_heads=hidden // 32, num_key_value_heads=1)
        common.pop("head_dim")
        return Qwen2Config(**common)
    if kind.startswith("llama"):
        return LlamaConfig(**common)
    raise ValueError(f"unknown test model {kind!r}; the kinds are {KINDS}")


def _new(kind: str) -> object:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config(kind)).to(torch.float32)


def make_model(folder: Path, version: int = 0, kind: str = "llama") -> Path:
    """Save the model ``kind`` with the weights of ``version`` into ``folder`` (safetensors)."""
    model = _new(kind)
    set_version(model.state_dict(), version)
    model.save_pretrained(folder, safe_serialization=True)  # type: ignore[attr-defined]
    return folder


def set_version(state: dict[str, torch.Tensor], version: int) -> None:
    """Fill ``state`` (checkpoint names) with the weights of ``version``, in place. A tensor that
    two names share (tied embeddings) is filled once, under its first name in sorted order that
    a checkpoint keeps: the same values whether ``state`` lists it once (a checkpoint) or twice
    (a model's state dict). Versions from :data:`STEPS` on are version 1 with small steps."""
    _fill(state, 1 if version >= STEPS else version, 1.0)
    for step in range(STEPS + 1, version + 1):
        _fill(state, step, STEP_SHARE)


def _fill(state: dict[str, torch.Tensor], seed: int, share: float) -> None:
    """Set ``share`` of every tensor's elements (all of them, or a sample) to values drawn from
    ``seed``."""
    g = torch.Generator().manual_seed(1000 + seed)
    seen: set[int] = set()
    with torch.no_grad():
        for name in sorted(state, key=lambda n: (n == "lm_head.weight", n)):
            t = state[name]
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            if share >= 1.0:
                noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
                t.copy_(noise * 0.2 if t.dim() >= 2 else 1.0 + 0.1 * noise)
                continue
            flat = t.view(-1)
            n = max(1, int(flat.numel() * share))
            idx = torch.randint(0, flat.numel(), (n,), generator=g).unique()
            noise = torch.randn(idx.numel(), generator=g, dtype=torch.float32)
            flat[idx] = (noise * 0.2 if t.dim() >= 2 else 1.0 + 0.1 * noise).to(t.dtype)


def checkpoint_tensors(model: object, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the names in memory of ``model``) under the names its saved checkpoint holds
    (transformers' own conversion: one tensor per expert matrix), as contiguous copies."""
    from transformers.core_model_loading import revert_weight_conversion

    saved = revert_weight_conversion(model, dict(state))
    return {n: t.contiguous().clone() for n, t in saved.items()}


def hf_model(version: int, through: torch.dtype | None = None, kind: str = "llama") -> object:
    """The float32 model ``kind`` of ``version``; ``through``: its weights rounded to that dtype
    first (what a float32 model holds after loading a trainer's bfloat16 weights)."""
    model = _new(kind).eval()  # type: ignore[attr-defined]
    state = model.state_dict()
    set_version(state, version)
    if through is not None:
        with torch.no_grad():
            for t in state.values():
                t.copy_(t.to(through))
    return model


def greedy(model: object, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (NEW_TOKENS tokens, no EOS stop)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(  # type: ignore[attr-defined]
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def kept_bytes(kind: str, tp: int = 2) -> tuple[int, int]:
    """(bytes of one version a tensor-parallel worker keeps, of which replicated): from the
    checkpoint's tensors and tensor parallelism's rules (a tensor split in ``tp``, or whole on
    every rank: 1-D norms, key/value heads when there are fewer than ranks, and the routers of
    a mixture of experts; every expert's matrices split along their intermediate size)."""
    cfg = config(kind)
    kv_split = cfg.num_key_value_heads % tp == 0  # type: ignore[attr-defined]
    total = replicated = 0
    for name, t in hf_model(0, kind=kind).named_parameters():  # type: ignore[attr-defined]
        whole = (
            t.dim() == 1
            and "_proj" not in name
            or (("k_proj" in name or "v_proj" in name) and not kv_split)
            or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))  # routers
        )
        n = t.numel() * t.element_size()
        total += n if whole else n // tp
        replicated += n if whole else 0
    return total, replicated


def fused_expert_names(kind: str) -> list[str]:
    """The names of the fused gate/up experts tensors of the test model ``kind`` (one per MoE
    layer; a dense layer has none)."""
    return [
        n
        for n, _ in hf_model(0, kind=kind).named_parameters()
        if n.endswith("experts.gate_up_proj")
    ]  # type: ignore[attr-defined]


def expert_bytes(kind: str) -> int:
    """Bytes of the routed experts (transformers' fused 3-D tensors)."""
    model = hf_model(0, kind=kind)
    return sum(t.numel() * t.element_size() for t in model.parameters() if t.dim() == 3)  # type: ignore[attr-defined]


def model_bytes(kind: str) -> int:
    """Bytes of every parameter of the test model ``kind``."""
    return sum(t.numel() * t.element_size() for t in hf_model(0, kind=kind).parameters())  # type: ignore[attr-defined]
