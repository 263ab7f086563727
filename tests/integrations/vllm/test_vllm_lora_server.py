"""LoRA adapters into a running vLLM server with two tensor-parallel workers (separate
processes), through the adapter routes (transport/integrations/vllm/lora_routes.py) and the
workers' LoRA mode (modes/lora.py). Each worker is written only the slice of A or B its LoRA
layers keep (bytes counted against vLLM's rules computed here from the model's shapes), vLLM's
greedy tokens naming the adapter equal transformers + peft's on the trainer's adapter after each
version, and the base model is neither sent nor changed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.child import ChildError
from helpers.llama import PROMPTS
from helpers.lora_peers import HttpLoraTrainer, Outsider, part_bytes, slice_bytes
from helpers.vllm_server import LORA_ARGS, VllmServer
from transport.store.tcp import TcpStore

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.lora, pytest.mark.slow]

TP = 2
RANK = 8


@dataclass
class Shared:
    server: VllmServer
    store: str
    base: list[list[int]]


@pytest.fixture(scope="module")
def shared(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    logs = tmp_path_factory.mktemp("lora-server")
    store = TcpStore("127.0.0.1", 0, hosting="yes")
    try:
        env = {k: v for n in range(TENANTS) for k, v in tenant(n)[2].items()}
        server = VllmServer(model_dir, logs / "server.log", tp=TP, args=LORA_ARGS, env=env)
        with server:
            yield Shared(server, f"tcp://127.0.0.1:{store.port}?host=no", server.generate())
    finally:
        store.close()


def test_each_tp_worker_takes_its_slices_and_serves_each_version_exactly(shared: Shared) -> None:
    server = shared.server
    with HttpLoraTrainer("policy") as trainer:
        trainer.call("connect", server.url, shared.store, "policy", "default", RANK, timeout=120)
        served = []
        for version in (1, 2, 3):
            got = trainer.call("send", version, timeout=240)
            assert sorted(got["written"].values()) == [slice_bytes(RANK, TP)] * TP, got
            assert server.generate("policy") == got["peft"], f"version {version}"
            assert server.generate() == shared.base, "the base model changed"
            served.append(got["peft"])
        assert served[0] != shared.base and len({str(s) for s in served}) == 3
        states = server.transport_state()
        adapters = [s["adapters"]["default/policy"] for s in states]
        assert [a["version"] for a in adapters] == [3] * TP, adapters
        assert all(a["registered"] for a in adapters), adapters
        assert [a["version_bytes"] for a in adapters] == [slice_bytes(RANK, TP)] * TP


def tenant(k: int) -> tuple[str, str, dict[str, str]]:
    """Tenant ``k``'s adapter name, namespace and environment (its own secret)."""
    namespace = f"tenant-{k}"
    return f"t{k}", namespace, {f"TRANSPORT_SECRET_TENANT_{k}": f"secret-of-tenant-{k}"}


TENANTS = 8


def test_eight_tenants_update_at_once_and_each_is_served_its_own(shared: Shared) -> None:
    server = shared.server
    trainers: list[HttpLoraTrainer] = []
    try:
        for k in range(TENANTS):  # one at a time: their starts do not starve the tests beside
            trainers.append(t := HttpLoraTrainer(f"tenant{k}", tenant(k)[2]))
            adapter, namespace, _ = tenant(k)
            t.call("connect", server.url, shared.store, adapter, namespace, RANK, k, timeout=120)
        alone = trainers[0].call("send", 1, timeout=240)
        for version in (2, 3):
            for t in trainers:
                t.begin("send", version, False)
            got = [t.end("send", 600) for t in trainers]
            tokens = [server.generate(tenant(k)[0]) for k in range(TENANTS)]
            for k, t in enumerate(trainers):
                want = t.call("peft_tokens", version, timeout=120)
                assert tokens[k] == want, f"tenant {k}, version {version}"
            assert len({str(t) for t in tokens}) == TENANTS, "two tenants served alike"
        seconds = sorted(g["seconds"] for g in got)
        print(
            f"\none tenant alone: {alone['seconds']:.2f} s per update; eight at once: median "
            f"{seconds[TENANTS // 2]:.2f} s, slowest {seconds[-1]:.2f} s"
        )
        # removed while the server serves: refused by name; the others unchanged
        trainers[3].call("remove", timeout=120)
        with pytest.raises(RuntimeError, match="404"):
            server.generate(tenant(3)[0])
        assert server.generate(tenant(4)[0]) == tokens[4]
        states = server.transport_state()
        assert all("tenant-3/t3" not in s["adapters"] for s in states)
        assert all(s["adapters"]["tenant-4/t4"]["version"] == 3 for s in states)
    finally:
        for t in trainers:
            t.stop()


def test_a_tenant_without_the_secret_cannot_write_replace_or_read_anothers_adapter(
    shared: Shared,
) -> None:
    server = shared.server
    adapter, namespace, env = tenant(0)
    with HttpLoraTrainer("victim", env) as victim, Outsider("outsider") as outsider:
        victim.call("connect", server.url, shared.store, adapter, namespace, RANK, 0, timeout=120)
        served = victim.call("send", 5, timeout=240)["peft"]
        tried = outsider.call(
            "attack",
            server.url,
            shared.store,
            adapter,
            namespace,
            "a-wrong-guess-of-the-secret",
            timeout=300,
        )
        print("\n" + "\n".join(f"{k}: {v}" for k, v in tried.items()))
        assert not any(v.startswith("reached") for v in tried.values()), tried
        assert tried["install"].startswith("403") and tried["remove"].startswith("403"), tried
        assert "409" in tried["name"], tried
        assert server.generate(adapter) == served, "the victim's adapter changed"
        states = server.transport_state()
        assert all(s["adapters"][f"{namespace}/{adapter}"]["version"] == 5 for s in states)
        assert all(s["adapters"][f"{namespace}/{adapter}"]["rank"] == RANK for s in states)


def stream_tokens(url: str, model: str, prompt: list[int], max_tokens: int) -> Iterator[list[int]]:
    """A streamed greedy completion: the token ids of each chunk as it arrives."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    import requests  # vLLM's environment has it; the torch 2.15 one only collects this file

    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    yield list(choice.get("token_ids") or [])


def test_a_request_running_when_a_version_lands_finishes_on_the_version_it_started_with(
    shared: Shared,
) -> None:
    """The install waits for the requests running (vLLM's pause, mode wait): a long completion
    that has its first token when the next version is sent is served by its first version to
    the end."""
    server, prompt, n = shared.server, PROMPTS[0], 80
    with HttpLoraTrainer("inflight") as trainer:
        trainer.call("connect", server.url, shared.store, "inflight", "default", RANK, 20)
        trainer.call("send", 1, False, timeout=240)
        old = trainer.call("peft_tokens", 1, prompt, n, timeout=120)
        new = trainer.call("peft_tokens", 2, prompt, n, timeout=120)
        assert old != new
        chunks = stream_tokens(server.url, "inflight", prompt, n)
        tokens = next(chunks)  # the request runs
        assert tokens, "the first chunk carries the first token"
        trainer.begin("send", 2, False)
        for chunk in chunks:
            tokens += chunk
        trainer.end("send", 240)
        assert tokens == old
        assert server.generate("inflight") == trainer.call("peft_tokens", 2, timeout=120)


def test_a_trainer_killed_mid_publish_leaves_a_whole_version_served_and_named(
    shared: Shared,
) -> None:
    server = shared.server
    with HttpLoraTrainer("first") as first, HttpLoraTrainer("second") as second:
        first.call("connect", server.url, shared.store, "killed", "default", RANK, 30)
        first.call("send", 1, False, timeout=240)
        first.begin("send", 2, False)
        first.kill()
        second.call("connect", server.url, shared.store, "killed", "default", RANK, 30)
        refs = {v: second.call("peft_tokens", v, timeout=120) for v in (1, 2, 3)}
        states = server.transport_state()
        versions = {s["adapters"]["default/killed"]["version"] for s in states}
        assert len(versions) == 1, states  # every worker the same version
        (served,) = versions
        assert served in (1, 2) and server.generate("killed") == refs[served], served
        # the trainer restarted: its next version lands whole
        second.call("send", 3, False, timeout=240)
        assert server.generate("killed") == refs[3]


def test_a_new_rank_is_taken_and_one_beyond_vllms_limit_is_refused_naming_it(
    shared: Shared,
) -> None:
    server = shared.server
    with HttpLoraTrainer("rank8") as small, HttpLoraTrainer("rank16") as large:
        small.call("connect", server.url, shared.store, "grows", "default", RANK, 40)
        small.call("send", 1, False, timeout=240)
        assert server.generate("grows") == small.call("peft_tokens", 1, timeout=120)
        large.call("connect", server.url, shared.store, "grows", "default", 16, 41)
        large.call("send", 2, False, timeout=240)
        assert server.generate("grows") == large.call("peft_tokens", 2, timeout=120)
        states = server.transport_state()
        assert {s["adapters"]["default/grows"]["rank"] for s in states} == {16}
    with HttpLoraTrainer("rank32") as too_large:
        too_large.call("connect", server.url, shared.store, "grows", "default", 32, 42)
        with pytest.raises(ChildError, match="max_lora_rank 16"):
            too_large.call("send", 3, False, timeout=240)
    states = server.transport_state()
    assert {s["adapters"]["default/grows"]["version"] for s in states} == {2}


def test_a_sharded_trainer_writes_each_worker_only_its_part_of_its_slices(shared: Shared) -> None:
    """An adapter sharded over two trainer ranks (FSDP's rule: each A and B split along its
    first dim) is published without a gather: each rank writes each TP worker only the part of
    that worker's slices it holds, and rank 0 has vLLM install the version."""
    server, world = shared.server, 2
    with HttpLoraTrainer("shard0") as r0, HttpLoraTrainer("shard1") as r1:
        for k, r in enumerate((r0, r1)):
            args = (server.url, shared.store, "sharded", "default", RANK, 50, k, world)
            r.call("connect", *args, timeout=120)
        for version in (1, 2):
            for r in (r0, r1):
                r.begin("send", version, False)
            got = [r.end("send", 240) for r in (r0, r1)]
            for k, g in enumerate(got):
                want = {w: part_bytes(RANK, TP, w, world, k) for w in range(TP)}
                by_worker = {
                    int(n.split("-r")[-1].split("-")[0]): b for n, b in g["written"].items()
                }
                assert by_worker == {w: b for w, b in want.items() if b}, (k, g["written"], want)
            assert server.generate("sharded") == r0.call("peft_tokens", version, timeout=120)
        total = sum(part_bytes(RANK, TP, 0, world, k) for k in range(world))
        assert total == slice_bytes(RANK, TP)  # the two ranks' parts make each worker's slices
