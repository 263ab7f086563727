"""Processes of the LoRA tests: a vLLM engine with LoRA on (offline ``LLM``; at TP = 2 its two
workers are processes of their own) beside a peft trainer whose adapter it receives through
transport, and the reference: transformers + peft greedy tokens on the trainer's adapter."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from helpers.child import ChildProcess, serve
from helpers.llama import NEW_TOKENS, PROMPTS, greedy, hf_model
from helpers.vllm_peers import VLLM_ENV, llm_kwargs

#: every linear module of the small Llama: what "all linear layers" targets
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(rank: int, alpha: float, targets: list[str] = TARGETS) -> Any:
    """The small Llama of version 0 (the weights vLLM serves) with a peft LoRA adapter."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    return get_peft_model(hf_model(0), config).eval()


def set_adapter(model: Any, version: int, salt: int = 0) -> None:
    """The adapter's A and B of ``version`` (drawn from the version and ``salt``, a tenant's
    number: every process alike), big enough to change the model's greedy tokens."""
    g = torch.Generator().manual_seed(7000 + 1000 * salt + version)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _lora_child(conn: Any, name: str, model_dir: str, store_url: str, tp: int, rank: int) -> None:
    """vLLM (TP = ``tp``, LoRA ranks up to 16) and, in the same driver process, a peft trainer of
    rank ``rank`` publishing adapter ``policy`` through an AdapterTrainer. Commands:
    ``send(version)`` -> {"vllm": vLLM's tokens naming the adapter, "peft": transformers + peft
    tokens on the trainer's adapter, "base": vLLM's tokens without it, "written": bytes the
    trainer wrote to each worker meanwhile}; ``state`` -> each worker's engine state."""
    os.environ.update(VLLM_ENV)
    try:
        from vllm import LLM, SamplingParams

        from transport.integrations.vllm import register
        from transport.integrations.vllm.lora_trainer import AdapterTrainer, AdapterTrainerInfo
        from transport.integrations.vllm.trainer import OfflineClient

        register()
        kwargs = llm_kwargs(model_dir)
        if tp > 1:
            kwargs["tensor_parallel_size"] = tp
            kwargs["distributed_executor_backend"] = "mp"
        llm = LLM(**kwargs, enable_lora=True, max_lora_rank=16, max_loras=2, max_cpu_loras=4)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        model = peft_model(rank, 2.0 * rank)
        info = AdapterTrainerInfo(store=store_url, adapter="policy", timeout=60)
        trainer = AdapterTrainer(model, OfflineClient(llm), info)
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (0, os.getpid())))

    def generate(lora: Any) -> list[list[int]]:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def send(version: int) -> dict[str, Any]:
        set_adapter(model, version)
        t = trainer.transport
        assert t is not None
        before = {n: x.written for n, x in t.traffic().items()}
        trainer.send(version)
        written = {n: x.written - before.get(n, 0) for n, x in t.traffic().items()}
        return {
            "vllm": generate(trainer.lora_request()),
            "peft": greedy(model),
            "base": generate(None),
            "written": {n: w for n, w in written.items() if w},
        }

    def state() -> list[dict[str, Any]]:
        return llm.collective_rpc(_state)

    serve(conn, {"send": send, "state": state}, trainer.close)


def _state(worker: Any) -> dict[str, Any]:
    import dataclasses

    engine = getattr(worker, "worker", worker).weight_transfer_engine
    return dataclasses.asdict(engine.state())


def part_bytes(rank: int, tp: int, worker: int, world: int, trainer_rank: int) -> int:
    """Bytes trainer rank ``trainer_rank`` of ``world`` (holding each A and B's rows as
    ``torch.chunk`` splits them: FSDP's rule) writes worker ``worker`` of ``tp`` per version: the
    part of that worker's slices (vLLM's rules, as :func:`slice_bytes`) that it holds."""

    def share(n: int, parts: int, k: int) -> tuple[int, int]:
        step = -(-n // parts)
        return min(k * step, n), min((k + 1) * step, n)

    def overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
        return max(0, min(a[1], b[1]) - max(a[0], b[0]))

    total = 0
    for name, p in hf_model(0).named_parameters():  # type: ignore[attr-defined]
        short = name.rsplit(".", 2)[-2]
        if short not in TARGETS:
            continue
        out, inputs = p.shape
        row = short in ("o_proj", "down_proj")
        # A: rank x inputs (row layers keep their inputs' share); B: outputs x rank
        a_rows, a_cols = (0, rank), share(inputs, tp, worker) if row else (0, inputs)
        b_rows, b_cols = (0, out) if row else share(out, tp, worker), (0, rank)
        mine_a, mine_b = share(rank, world, trainer_rank), share(out, world, trainer_rank)
        total += overlap(a_rows, mine_a) * (a_cols[1] - a_cols[0])
        total += overlap(b_rows, mine_b) * (b_cols[1] - b_cols[0])
    return 4 * total


def slice_bytes(rank: int, tp: int) -> int:
    """Bytes of one adapter version a worker keeps at tensor parallelism ``tp``, from the model's
    shapes and vLLM's rules: column-parallel layers (q, k, v, gate, up) keep A whole and their
    outputs' share of B, row-parallel ones (o, down) their inputs' share of A and B whole."""
    total = 0
    for name, p in hf_model(0).named_parameters():  # type: ignore[attr-defined]
        short = name.rsplit(".", 2)[-2]
        if short not in TARGETS:
            continue
        rows, cols = p.shape
        a, b = rank * cols, rows * rank
        if short in ("o_proj", "down_proj"):
            a //= tp
        else:
            b //= tp
        total += 4 * (a + b)
    return total


class LoraEngine(ChildProcess):
    """:func:`_lora_child` in a child process."""

    FROM_VLLM_SERVER = True  # forks from the server that imported vLLM (helpers.child)

    def __init__(
        self, name: str, model_dir: str, store_url: str, tp: int = 1, rank: int = 8
    ) -> None:
        super().__init__(name, _lora_child, (model_dir, store_url, tp, rank), 240)


def _http_lora_child(conn: Any, name: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    # one thread: eight of these share two cores with the server's workers, whose transports
    # must keep their heartbeats (spinning OpenMP threads starved them for seconds)
    torch.set_num_threads(1)
    try:  # the imports first (seconds): the test starts this child while the server starts
        from transport.integrations.vllm.lora_trainer import AdapterTrainer, AdapterTrainerInfo
        from transport.integrations.vllm.trainer import HTTPClient
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (0, os.getpid())))
    held: dict[str, Any] = {}

    def connect(
        url: str,
        store: str,
        adapter: str,
        namespace: str,
        rank: int,
        salt: int = 0,
        trainer_rank: int = 0,
        world: int = 1,
    ) -> None:
        """A trainer of a rank-``rank`` adapter; ``trainer_rank`` of ``world``: one rank of a
        trainer whose adapter is sharded (each holds the whole model here and publishes only
        its shards)."""
        held["salt"] = salt
        held["model"] = model = peft_model(rank, 2.0 * rank)
        # the trainer's peer name is its adapter's (the default): a restarted trainer takes over
        info = AdapterTrainerInfo(
            store=store,
            adapter=adapter,
            namespace=namespace,
            timeout=60,
            rank=trainer_rank,
            world=world,
        )
        held["trainer"] = AdapterTrainer(model, HTTPClient(url), info)

    def send(version: int, reference: bool = True) -> dict[str, Any]:
        """Install ``version``; transformers + peft's tokens on it (unless not ``reference``:
        then ask ``peft_tokens`` after), the bytes written to each worker meanwhile, and the
        seconds the send took."""
        trainer = held["trainer"]
        set_adapter(held["model"], version, held["salt"])
        before = {n: x.written for n, x in trainer.transport.traffic().items()}
        t0 = time.perf_counter()
        trainer.send(version)
        seconds = time.perf_counter() - t0
        after = trainer.transport.traffic()
        written = {n: x.written - before.get(n, 0) for n, x in after.items()}
        return {
            "peft": greedy(held["model"]) if reference else None,
            "written": {n: w for n, w in written.items() if w},
            "seconds": seconds,
        }

    def peft_tokens(version: int, prompt: list[int] | None = None, n: int = 0) -> Any:
        """transformers + peft's tokens on the adapter of ``version`` (the trainer's is set to
        it): of every prompt, or ``n`` tokens of ``prompt``."""
        set_adapter(held["model"], version, held["salt"])
        if prompt is None:
            return greedy(held["model"])
        return _greedy_n(held["model"], prompt, n)

    def close() -> None:
        if "trainer" in held:
            held["trainer"].close()

    handlers = {
        "connect": connect,
        "send": send,
        "peft_tokens": peft_tokens,
        "remove": lambda: held["trainer"].remove(),
    }
    serve(conn, handlers, close)


class HttpLoraTrainer(ChildProcess):
    """A peft trainer publishing one adapter to a vLLM server through AdapterTrainer and
    HTTPClient. ``env`` is set in the child first (a namespace's secret). Commands:
    ``connect(url, store, adapter, namespace, rank)``, ``send(version)`` -> {"peft": reference
    tokens, "written": bytes per worker}, ``peft_tokens(version)``, ``remove``."""

    FROM_VLLM_SERVER = True  # forks from the server that imported vLLM (helpers.child)

    def __init__(self, name: str, env: dict[str, str] | None = None, wait: bool = True) -> None:
        super().__init__(name, _http_lora_child, (env or {},), 120, wait)


def _greedy_n(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return ids[0, len(prompt) :].tolist()


def _outsider_child(conn: Any, name: str, env: dict[str, str]) -> None:
    """A process without a tenant's secret that tries to reach the tenant's adapter."""
    os.environ.update(env)
    try:
        import requests

        from transport import Transport, TransportError
        from transport.integrations.vllm.lora_routes import PREFIX
        from transport.integrations.vllm.lora_trainer import AdapterTrainer, AdapterTrainerInfo
        from transport.integrations.vllm.trainer import HTTPClient
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (0, os.getpid())))

    def attack(url: str, store: str, victim: str, namespace: str, secret: str) -> dict[str, str]:
        """Each way in, with what stopped it (a test fails on any "reached")."""
        out: dict[str, str] = {}
        model = peft_model(16, 32.0)  # a config of its own: an init would replace the victim's
        set_adapter(model, 1, 99)
        # 1. the victim's adapter, from the victim's namespace, with a wrong secret
        os.environ[f"TRANSPORT_SECRET_{namespace.upper().replace('-', '_')}"] = secret
        info = AdapterTrainerInfo(store=store, adapter=victim, namespace=namespace, timeout=10)
        try:
            trainer = AdapterTrainer(model, HTTPClient(url), info)
        except Exception as e:
            out["init"] = f"refused: {type(e).__name__}: {e}"
        else:
            try:
                trainer.send(1)
                out["init"] = "reached"
            except Exception as e:
                out["init"] = f"publish refused: {type(e).__name__}: {e}"
            finally:
                trainer.close()
        # 2. the routes, without the proof
        for action in ("install", "remove"):
            body = {"adapter": victim, "namespace": namespace, "version": 1, "timeout": 10}
            r = requests.post(f"{url}{PREFIX}{action}", json=body, timeout=60)
            out[action] = "reached" if r.status_code == 200 else f"{r.status_code} {r.text}"
        # 3. the victim's name, from a namespace of its own (whose secret it holds)
        info = AdapterTrainerInfo(store=store, adapter=victim, namespace="outsider", timeout=30)
        own = AdapterTrainer(model, HTTPClient(url), info)  # its own namespace: it may
        try:
            own.send(1)
            out["name"] = "reached"
        except Exception as e:
            out["name"] = f"refused: {type(e).__name__}: {e}"
        finally:
            own.close()
        # 4. reading: the victim's namespace shows it nothing
        t = Transport("outsider-reader", store=store, namespace=namespace, secret=secret)
        try:
            seen = [p.name for p in t.peers() if p.name != t.name]
            out["read"] = f"reached {seen}" if seen else "no peer visible"
        except TransportError as e:
            out["read"] = f"refused: {type(e).__name__}: {e}"
        finally:
            t.close()
        return out

    serve(conn, {"attack": attack}, lambda: None)


class Outsider(ChildProcess):
    """:func:`_outsider_child`: ``attack(url, store, victim, namespace, wrong_secret)``."""

    FROM_VLLM_SERVER = True  # forks from the server that imported vLLM (helpers.child)

    def __init__(self, name: str, env: dict[str, str] | None = None) -> None:
        super().__init__(name, _outsider_child, (env or {},), 120)
