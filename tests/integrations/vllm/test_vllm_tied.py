"""Models whose input and output embeddings are one tensor (``tie_word_embeddings``: Llama 3.2
1B/3B, Qwen2.5 0.5B-3B), served by vLLM (CPU build, offline engine) and updated through the
``transport`` backend: the checkpoint holds the embedding once, and vLLM's output head, which
shares it, must take every version too. After each update vLLM's greedy tokens equal
transformers' on the same weights; an update that leaves a layer unloaded fails loudly."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.child import ChildError
from helpers.vllm_peers import LlamaPublisher, VllmProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300), pytest.mark.slow]


@pytest.mark.parametrize("kind", ["qwen2-tied", "llama-tied"])
def test_tied_embeddings_take_every_version(kind, store, model_dir_of, reference):
    folder: Path = model_dir_of(kind)
    with VllmProcess("vllm", folder) as vllm:
        assert vllm.call("generate") == reference(0, kind=kind)
        vllm.call("init", {"store": store.url, "group": kind, "timeout": 30})
        with LlamaPublisher("trainer", store.url, folder, group=kind) as trainer:
            for version in (1, 2, 3):
                status, reasons = trainer.call("publish", version, 30.0)
                assert set(status.values()) == {"done"}, reasons
                assert vllm.call("update", {"version": version}) == str(version)
                assert vllm.call("generate") == reference(version, kind=kind), f"v{version}"


@pytest.mark.parametrize("mode", ["sharded", "whole"])
def test_an_update_that_leaves_a_layer_unloaded_fails_and_says_so(
    store, model_dir_of, reference, mode
):
    """As a vLLM whose loader skipped a layer would (the output head, tied to the embedding,
    takes nothing: in the sharded mode its direct load, in the whole mode vLLM's loader): the
    update fails naming the layer, the worker reports no whole version (-2) and vLLM's reported
    version is not moved to it; the next update that reaches every layer makes the model whole
    again."""
    kind = "qwen2-tied"
    folder: Path = model_dir_of(kind)
    group = f"torn-{mode}"
    with VllmProcess("vllm", folder) as vllm:
        vllm.call("init", {"store": store.url, "group": group, "timeout": 30, "mode": mode})
        with LlamaPublisher(
            "trainer", store.url, folder, group=group, plain=mode == "whole"
        ) as trainer:
            trainer.call("publish", 1, 30.0)
            assert vllm.call("update", {"version": 1}) == "1"
            vllm.call("skip_tied", True)
            trainer.call("publish", 2, 30.0)
            with pytest.raises(ChildError, match=r"did not reach every layer.*lm_head"):
                vllm.call("update", {"version": 2})
            assert vllm.call("engine_state")[0]["loaded"] == -2
            assert vllm.call("weight_version") == "1"  # never moved to the torn version
            vllm.call("skip_tied", False)
            trainer.call("publish", 3, 30.0)
            assert vllm.call("update", {"version": 3}) == "3"
            assert vllm.call("engine_state")[0]["loaded"] == 3
            assert vllm.call("generate") == reference(3, kind=kind)
