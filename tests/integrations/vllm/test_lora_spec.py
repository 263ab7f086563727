"""What a LoRA adapter is on the wire (transport/integrations/vllm/lora_spec.py) and what the
adapter routes accept (lora_routes.py): names and shapes from a peft model, configs refused
naming the rule, the proof of a namespace's secret, requests from outside refused with a status
that names the rule."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch

from transport import RouteError
from transport.integrations.vllm.lora_routes import MODEL_NAMESPACE_ENV, AdapterCall, AdapterRoutes
from transport.integrations.vllm.lora_spec import (
    AdapterConfig,
    adapter_id,
    check_proof,
    from_peft,
    lora_spec,
    proof,
)

#: the adapter's wire needs peft and transformers, its init route vLLM's info types: the first
#: environment's (the test command's second one has none of them)
pytestmark = [pytest.mark.unit, pytest.mark.vllm, pytest.mark.lora]


def small_peft(rank: int = 4, targets: list[str] | None = None) -> object:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    lora = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets or ["q_proj", "v_proj", "down_proj"]
    )
    return get_peft_model(LlamaForCausalLM(cfg), lora)


def test_a_peft_adapter_is_named_and_shaped_as_the_base_checkpoint_says() -> None:
    model = small_peft()
    config, tensors = from_peft(model)
    assert config == AdapterConfig(4, 8.0, ("down_proj", "q_proj", "v_proj"))
    base = {n: p for n, p in model.get_base_model().state_dict().items() if "lora_" not in n}
    base = {n.replace(".base_layer", ""): p for n, p in base.items()}
    spec = lora_spec(base, config, torch.float32)
    assert list(spec) == sorted(spec, key=list(spec).index)  # the base checkpoint's order
    assert set(spec) == set(tensors)
    for name, meta in spec.items():
        assert tuple(meta.shape) == tuple(tensors[name].shape), name
    assert spec["model.layers.0.self_attn.v_proj.lora_A.weight"].shape == (4, 32)
    assert spec["model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, 4)
    # the published tensors are the parameters themselves (read at each publish)
    p = dict(model.named_parameters())[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    ]
    assert tensors["model.layers.0.self_attn.q_proj.lora_B.weight"].data_ptr() == p.data_ptr()


def test_configs_and_targets_an_adapter_cannot_carry_are_refused_naming_why() -> None:
    for rank in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rank is an int >= 1"):
            AdapterConfig(rank, 1.0, ("q_proj",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="alpha is a finite number"):
        AdapterConfig(4, float("nan"), ("q_proj",))
    with pytest.raises(ValueError, match="targets names at least one module"):
        AdapterConfig(4, 1.0, ())
    base = {"model.layers.0.self_attn.q_proj.weight": torch.empty(8, 8, device="meta")}
    with pytest.raises(ValueError, match=r"target modules \['lm_head'\] match no linear module"):
        lora_spec(base, AdapterConfig(4, 1.0, ("lm_head", "q_proj")), torch.float32)
    with pytest.raises(ValueError, match="holds no peft adapter 'other'"):
        from_peft(small_peft(), "other")
    assert AdapterConfig(8, 16.0, ("q_proj",)).differences(AdapterConfig(4, 16.0, ("q_proj",))) == [
        "rank 4 -> 8"
    ]


def test_adapter_ids_are_stable_distinct_per_namespace_and_above_vllms_own() -> None:
    a, b = adapter_id("tenant-1", "policy"), adapter_id("tenant-2", "policy")
    assert a == adapter_id("tenant-1", "policy") and a != b
    assert min(a, b) >= 2**30 and max(a, b) < 2**31


def test_a_proof_holds_only_for_its_secret_and_fields() -> None:
    good = proof("secret-of-tenant", "install", "ns", "policy", 3)
    check_proof("secret-of-tenant", good, "x", "install", "ns", "policy", 3)
    for secret, fields in (
        ("another-secret!", ("install", "ns", "policy", 3)),  # the proof under another secret
        ("secret-of-tenant", ("install", "ns", "policy", 4)),  # another version
        ("secret-of-tenant", ("remove", "ns", "policy", 3)),  # another action
    ):
        with pytest.raises(PermissionError, match="does not prove it"):
            check_proof(secret, good, "x", *fields)
    for given in ("", "00" * 32, None):
        with pytest.raises(PermissionError, match="its namespace has a secret"):
            check_proof("secret-of-tenant", given, "x", "install", "ns", "policy", 3)  # type: ignore[arg-type]
    check_proof(None, "", "x", "anything")  # no secret: nothing to prove


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "a JSON object"),
        (b'{"namespace": "ns"}', "adapter and namespace are non-empty strings"),
        (b'{"adapter": "a", "version": -1}', r"version is an int >= 0"),
        (b'{"adapter": "a", "version": true}', r"version is an int >= 0"),
        (b'{"adapter": "a", "timeout": 0}', "timeout is a number of seconds > 0"),
        (b'{"adapter": "a", "proof": 7}', "proof is a string"),
        (b'{"adapter": "a", "as_model": "yes"}', "as_model is true or false"),
    ],
)
def test_the_routes_refuse_a_malformed_request_naming_the_rule(body: bytes, rule: str) -> None:
    with pytest.raises(RouteError, match=rule) as e:
        AdapterCall.parse("install", body)
    assert e.value.status == 400


def test_the_routes_answer_only_their_own_paths_and_bound_what_they_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    passed: list[str] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        passed.append(scope["path"])

    async def call(path: str, method: str, body: bytes) -> tuple[int, dict]:
        sent: list[dict] = []
        chunks = [
            {"body": body[i : i + 1000], "more_body": i + 1000 < len(body)}
            for i in range(0, max(len(body), 1), 1000)
        ]

        async def receive() -> dict:
            return chunks.pop(0)

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "path": path, "method": method}
        await AdapterRoutes(app)(scope, receive, send)
        if not sent:
            return 0, {}
        return sent[0]["status"], json.loads(sent[1]["body"])

    assert asyncio.run(call("/v1/completions", "POST", b"{}")) == (0, {})
    assert passed == ["/v1/completions"]
    status, answer = asyncio.run(call("/transport/adapters/other", "POST", b"{}"))
    assert status == 404 and "/transport/adapters/{init,install,remove}" in answer["error"]
    status, answer = asyncio.run(call("/transport/adapters/install", "GET", b"{}"))
    assert status == 404
    status, answer = asyncio.run(call("/transport/adapters/install", "POST", b"x" * 10_000))
    assert status == 413 and "larger than 4096 bytes" in answer["error"]
    monkeypatch.setenv("TRANSPORT_SECRET_TENANT_9", "secret-of-tenant-9")
    body = json.dumps({"adapter": "a", "namespace": "tenant-9", "version": 1}).encode()
    status, answer = asyncio.run(call("/transport/adapters/install", "POST", body))
    assert status == 403 and "does not prove it" in answer["error"]
    init = {
        "store": "tcp://127.0.0.1:1",
        "namespace": "tenant-9",
        "group": "adapter.a",
        "adapter": "a",
        "rank": 4,
        "alpha": 8.0,
        "targets": ["q_proj"],
    }
    status, answer = asyncio.run(
        call("/transport/adapters/init", "POST", json.dumps(init).encode())
    )
    assert status == 403 and "the init of adapter 'a'" in answer["error"]
    init["rank"] = 0
    status, answer = asyncio.run(
        call("/transport/adapters/init", "POST", json.dumps(init).encode())
    )
    assert status == 400 and "rank is an int >= 1" in answer["error"]
    status, answer = asyncio.run(
        call("/transport/adapters/init", "POST", b'{"store": "x", "bogus": 1}')
    )
    assert status == 400 and "unknown fields ['bogus']" in answer["error"]


def test_serving_an_adapter_under_the_models_name_is_proven_and_one_namespaces_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRANSPORT_SECRET_TENANT_A", "secret-of-tenant-a")
    body = {"adapter": "policy", "namespace": "tenant-a", "version": 3}
    plain = AdapterCall.parse("install", json.dumps(body).encode())
    as_model = AdapterCall.parse("install", json.dumps({**body, "as_model": True}).encode())
    # the proof of a plain install does not let a replay take the model's name
    signed = proof("secret-of-tenant-a", *plain.fields())
    dataclasses.replace(plain, proof=signed).check()
    with pytest.raises(RouteError, match="does not prove it") as e:
        dataclasses.replace(as_model, proof=signed).check()
    assert e.value.status == 403
    dataclasses.replace(as_model, proof=proof("secret-of-tenant-a", *as_model.fields())).check()
    # a tenant's namespace may not take every tenant's base model
    monkeypatch.delenv(MODEL_NAMESPACE_ENV, raising=False)
    plain.check_model_namespace()
    with pytest.raises(RouteError, match="only namespace 'default' may serve") as e:
        as_model.check_model_namespace()
    assert e.value.status == 403
    monkeypatch.setenv(MODEL_NAMESPACE_ENV, "tenant-a")
    as_model.check_model_namespace()
