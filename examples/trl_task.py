"""The task of examples/trl_grpo.py (and of the TRL tests): a small Llama learns to answer 7.

Its words are the digits 0-9 (a tokenizer made here: no hub); a prompt is three consecutive
digits ("3 4 5"), and a completion earns a point for each "7" among its first
:data:`COMPLETION` tokens. A model with random weights scores about 1 in 16 per token; GRPO
lifts that within ten steps, and only if every sync reaches vLLM: the completions it learns
from are vLLM's, sampled from the last weights it received.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: token ids: 0 pad, 1 begin, 2 end, then the digits 0-9
PAD, BOS, EOS, DIGIT0 = 0, 1, 2, 3
#: the model's vocabulary (the tokenizer's 13 words and 3 unused ids)
VOCAB = 16
#: the tokens a completion may have (a full one scores 1)
COMPLETION = 8
#: the token the reward asks for
SEVEN = DIGIT0 + 7


def make_model(folder: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (grouped-query attention, float32) with random weights and its digits
    tokenizer, saved in ``folder`` for vLLM and TRL."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS} | {str(d): DIGIT0 + d for d in range(10)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    # a chat turn is its text; a reply is parsed as plain text up to the end token
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.response_template = {
        "defaults": {"role": "assistant"},
        "fields": {"content": {"close_pattern": r"\s*</s>\s*|$", "content": "text"}},
    }
    fast.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention needs a head size of at least 32
        max_position_embeddings=128,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def prompts(n: int = 10) -> list[list[dict[str, str]]]:
    """``n`` conversational prompts, each three consecutive digits."""
    return [
        [{"role": "user", "content": " ".join(str((s + j) % 10) for j in range(3))}]
        for s in range(n)
    ]


def sevens_reward(completion_ids: list[list[int]], **kwargs: object) -> list[float]:
    """TRL's reward function: the share of :data:`COMPLETION` tokens that are "7"."""
    return [sum(t == SEVEN for t in ids[:COMPLETION]) / COMPLETION for ids in completion_ids]


#: prompts of the greedy check: vLLM's tokens against transformers' on the trainer's weights
CHECK_PROMPTS = [[DIGIT0 + 3, DIGIT0 + 4, DIGIT0 + 5], [DIGIT0 + 8, DIGIT0 + 9, DIGIT0]]


def reference(folder: Path, trained: object) -> object:
    """A copy of the trainer's model as it is now, in plain transformers (eager attention:
    the trainer's own runs TRL's packed attention), for greedy checks; a peft model's copy
    carries its adapter's current values."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    if hasattr(trained, "peft_config"):
        from peft import get_peft_model, set_peft_model_state_dict
        from peft.utils import get_peft_model_state_dict

        ref = get_peft_model(ref, trained.peft_config["default"])
        set_peft_model_state_dict(ref, get_peft_model_state_dict(trained))  # type: ignore[arg-type]
    else:
        ref.load_state_dict({n: t.detach().clone() for n, t in trained.state_dict().items()})  # type: ignore[attr-defined]
    return ref.eval()


def greedy(model: object, prompts: list[list[int]] = CHECK_PROMPTS) -> list[list[int]]:
    """transformers' greedy :data:`COMPLETION` tokens after each prompt (no end-token stop)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(  # type: ignore[attr-defined]
                torch.tensor([p]),
                max_new_tokens=COMPLETION,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def token_logprobs(
    model: object, prompts: list[list[int]], completions: list[list[int]]
) -> list[list[float]]:
    """transformers' log-probability of each completion token after its prompt (one forward
    of each prompt and completion)."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions, strict=True):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]  # type: ignore[operator]
            logp = torch.log_softmax(logits.float(), -1)
            out.append(logp.gather(1, torch.tensor(c)[:, None])[:, 0].tolist())
    return out
