"""A small Llama for the vLLM tests, made here (no hub): its folder, the weights of each version
a test publishes (a function of the version number, so every process builds the same bytes),
and transformers' greedy tokens on given weights, the reference vLLM must match (float32)."""

from __future__ import annotations

from pathlib import Path

import torch

#: prompts as token ids: one longer than a KV block (32), so a stale prefix cache would show
PROMPTS = [list(range(4, 44)), [1, 17, 42, 99, 7, 200, 31]]
NEW_TOKENS = 12


def config(layers: int = 2, hidden: int = 64, vocab: int = 256) -> object:
    from transformers import LlamaConfig

    # vLLM's CPU attention needs a head size of at least 32
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 16, num_key_value_heads=hidden // 32,
        head_dim=32, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip


def make_model(folder: Path, version: int = 0) -> Path:
    """Save the model with the weights of ``version`` into ``folder`` (safetensors)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config()).to(torch.float32)
    set_version(model.state_dict(), version)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def set_version(state: dict[str, torch.Tensor], version: int) -> None:
    """Fill ``state`` (checkpoint names) with the weights of ``version``, in place."""
    g = torch.Generator().manual_seed(1000 + version)
    with torch.no_grad():
        for name in sorted(state):
            t = state[name]
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
            t.copy_(noise * 0.2 if t.dim() >= 2 else 1.0 + 0.1 * noise)


def hf_model(version: int, through: torch.dtype | None = None) -> object:
    """The float32 model of ``version``; ``through``: its weights rounded to that dtype first
    (what a float32 model holds after loading a trainer's bfloat16 weights)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config()).to(torch.float32).eval()
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
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            out.append(ids[0, len(p) :].tolist())
    return out
