"""TRL's AsyncGRPOTrainer against a real vLLM server (the CPU build), syncing through transport:
the job of tests/integrations/trl/test_trl.py, run as a script (TRL spawns its rollout process,
which imports the reward from examples/trl_task.py) and answered with a JSON report.

    python tests/helpers/trl_job.py --work DIR --report FILE [--steps 10] [--lora-steps 10]

One server (LoRA on, transport's adapter routes) serves three phases in turn:

* ``lora``: a run of ``lora_steps`` optimizer steps (default: ``steps``) training a LoRA
  adapter; only the adapter is synced (served under the model's name). Before every step:
  vLLM's greedy tokens and transformers' on the trainer's current weights, the adapter's bytes
  each worker receives.
  The adapter is removed at the end (the model's name serves the base model again).
* ``full``: the same run syncing the whole model, plus a last step before whose sync the server
  is killed: TRL's ``train()`` must raise the transfer's error. Before every step, as above,
  plus the weights of each version; every sample the trainer takes is recorded with the
  version TRL tagged it with and vLLM's log-probabilities of its tokens, and after the run each
  is matched against transformers' log-probabilities under every version. The transfer pauses
  vLLM with mode ``wait`` (running requests finish first: no sample mixes two versions).
* ``restart``: a server restarted on the same port takes the transfer's next sync whole.

With ``--baseline`` it also times vLLM's own file round trip in the same run, three times each:
the adapter saved by peft and loaded with ``/v1/load_lora_adapter``, the model saved in
safetensors and reloaded with ``reload_weights`` (each until a request is served by it), and
three more syncs of the model through transport (benchmarks/trl_sync.py reports them).

Each phase records the rewards TRL logged, the sync times, and the memory (RSS) of the trainer
and of the server's processes before the first and the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import torch  # noqa: E402
import trl_grpo  # noqa: E402
import trl_task  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from transport.store import PortReservation, reserve_port  # noqa: E402

#: the ports this job hosts a server on by number, held until it ends
HELD: list[PortReservation] = []

#: samples whose log-probabilities are matched against every version (the first ones taken)
MATCHED = 240
#: a sample's vLLM log-probabilities match a version's when no token differs by more
TOLERANCE = 2e-3


class Recorder:
    """Stands in for the trainer's rollout queue (``trainer.rollout_queue``): passes every
    sample on and keeps the first :data:`MATCHED`."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.samples: list[dict[str, Any]] = []

    def get(self, *args: Any, **kwargs: Any) -> Any:
        sample = self.queue.get(*args, **kwargs)
        if len(self.samples) < MATCHED:
            self.samples.append(
                {
                    "input_ids": [int(x) for x in sample.input_ids],
                    "mask": [int(x) for x in sample.completion_mask],
                    "old": [float(x) for x in sample.old_log_probs],
                    "tag": int(sample.model_version),
                }
            )
        return sample

    def qsize(self) -> int:
        return int(self.queue.qsize())


def recording_client(url: str, timeout: float, mode: str) -> Any:
    """The transfer's PausingClient, recording each of its calls to the server in ``calls`` as
    it returns (a pause made inside ``start_weight_update`` comes before it)."""
    from transport.integrations.trl.transfer import PausingClient

    class Recording(PausingClient):
        calls: list[str] = []

        def _record(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            self.calls.append(name)
            return result

    for name in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
        "pause",
        "resume",
    ):
        original = getattr(PausingClient, name)

        def method(self: Any, *a: Any, _name: str = name, _fn: Any = original, **k: Any) -> Any:
            return self._record(_name, _fn, self, *a, **k)

        setattr(Recording, name, method)
    client = Recording(url, timeout, mode)
    client.calls = []
    return client


class Probe(TrainerCallback):
    """Before every optimizer step (every sync before it has landed): vLLM's greedy tokens
    against transformers' on the trainer's weights, the version vLLM reports, the memory; in
    a full run, the weights of the version just synced. ``kill_after``: kill the server at the
    end of that step, before TRL's sync."""

    def __init__(self, server: Any, folder: Path, transfer: Any, kill_after: int | None) -> None:
        self.server, self.folder, self.transfer = server, folder, transfer
        self.kill_after = kill_after
        self.checks: list[dict[str, Any]] = []
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.memory: list[dict[str, int]] = []
        self.killed_at: float | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        model = kw["model"]
        check = served_check(self.server, trl_task.reference(self.folder, model))
        served = self.server.get("weight_info")["weight_version"]
        workers = self.server.post("collective_rpc", {"method": "transport_state"})["results"]
        self.checks.append(
            {
                "step": state.global_step,
                "version": self.transfer.version,
                "served": served,
                **check,
                "adapters": workers[0].get("adapters", {}),
                "model_version": workers[0]["version"],
            }
        )
        if not hasattr(model, "peft_config"):
            self.weights[self.transfer.version] = {
                n: t.detach().clone() for n, t in model.state_dict().items()
            }
        self.memory.append({"trainer": _rss([os.getpid()]), "server": _server_rss(self.server)})

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.kill_after is not None and state.global_step == self.kill_after:
            self.server.kill()
            self.killed_at = time.monotonic()


def served_check(server: Any, ref: Any) -> dict[str, Any]:
    """vLLM's greedy tokens after :data:`trl_task.CHECK_PROMPTS` against transformers' on
    ``ref`` (the trainer's weights now), and the largest gap between their log-probabilities
    of vLLM's tokens (``logprob_err``); for a peft model also the largest gap between the
    adapter's and the base model's (``base_gap``): an adapter that moved tells itself from
    none there even where both choose the same tokens."""
    want = trl_task.greedy(ref)
    served = server.complete_scored(trl_task.CHECK_PROMPTS, trl_task.COMPLETION)
    got = [c.tokens for c in served]
    mine = trl_task.token_logprobs(ref, trl_task.CHECK_PROMPTS, got)
    out = {
        "equal": got == want,
        "got": got,
        "want": want,
        "logprob_err": _largest_gap([c.logprobs for c in served], mine),
    }
    if hasattr(ref, "disable_adapter"):
        with ref.disable_adapter():
            base = trl_task.token_logprobs(ref, trl_task.CHECK_PROMPTS, got)
        out["base_gap"] = _largest_gap(mine, base)
    return out


def _largest_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def _rss(pids: list[int]) -> int:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


def _server_rss(server: Any) -> int:
    import psutil

    root = psutil.Process(server.proc.pid)
    return _rss([root.pid, *(c.pid for c in root.children(recursive=True))])


def run(
    server: Any, folder: Path, work: Path, steps: int, lora: bool, kill_after: int | None
) -> dict[str, Any]:
    """One TRL run of ``steps`` optimizer steps; its report."""
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from transport.integrations.trl import TransportWeightTransfer
    from transport.integrations.trl.cpu import cpu_trainer

    held = reserve_port()  # until the job ends: the store is hosted there by number
    HELD.append(held)
    store = f"tcp://127.0.0.1:{held.port}"
    name = "lora" if lora else "full"
    transfer = TransportWeightTransfer(
        server.url,
        store=store,
        adapter="policy" if lora else None,
        timeout=60,
        client=recording_client(server.url, 90, "wait"),
    )
    probe = Probe(server, folder, transfer, kill_after)
    lr = 5e-2 if lora else 1e-2
    with cpu_trainer():
        trainer = AsyncGRPOTrainer(
            model=str(folder),
            reward_funcs=trl_task.sevens_reward,
            # a half (full) or a quarter (LoRA: its reward is not checked) of the example's
            # batch: the job shares two cores with the rest of the suite
            args=trl_grpo.grpo_config(
                work / f"out-{name}", server.url, steps, lr, accumulation=1 if lora else 2, queue=32
            ),
            train_dataset=Dataset.from_dict({"prompt": trl_task.prompts() * 100}),
            weight_transfer=transfer,
            callbacks=[transfer, probe] if lora else [probe],
            peft_config=trl_grpo.lora_config() if lora else None,
        )
    recorder = Recorder(trainer.rollout_queue)
    trainer.rollout_queue = recorder
    report: dict[str, Any] = {"error": None}
    t0 = time.monotonic()
    try:
        trainer.train()
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
        if probe.killed_at is not None:
            report["error_after_kill_s"] = time.monotonic() - probe.killed_at
    report["train_s"] = time.monotonic() - t0
    if report["error"] is None:  # the last sync (after the last step) against the last weights
        report["final"] = served_check(server, trl_task.reference(folder, trainer.model))
    report["rewards"] = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    report["step_s"] = [h["perf/step_s"] for h in trainer.state.log_history if "perf/step_s" in h]
    report["syncs"] = [
        {"version": s.version, "seconds": s.seconds, "publish_s": s.publish_s, "load_s": s.load_s}
        for s in transfer.history
    ]
    report["checks"] = probe.checks
    report["calls"] = list(transfer.client.calls)
    report["memory"] = probe.memory
    report["adapter_bytes"] = sum(
        p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if "lora_" in n
    )
    report["model_bytes"] = sum(
        p.numel() * p.element_size()
        for n, p in trainer.model.named_parameters()
        if "lora_" not in n
    )
    if not lora:
        report["samples"] = match(recorder.samples, probe.weights, folder)
    report["trainer"] = trainer
    report["transfer"] = transfer
    return report


def match(
    samples: list[dict[str, Any]], weights: dict[int, dict[str, torch.Tensor]], folder: Path
) -> list[dict[str, Any]]:
    """Each sample's tag and the versions whose log-probabilities of its completion tokens
    are vLLM's (within TOLERANCE): one forward of every sample per version, padded on the
    right (a causal model's earlier positions do not see the padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    out: list[dict[str, Any]] = [{"tag": s["tag"], "matches": [], "closest": {}} for s in samples]
    if not samples:
        return out
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), width), trl_task.PAD)
    for k, s in enumerate(samples):
        ids[k, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
    for version, state in sorted(weights.items()):
        model.load_state_dict(state)
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
        mine = logp.gather(2, ids[:, 1:, None])[..., 0]
        for k, (s, o) in enumerate(zip(samples, out, strict=True)):
            at = [i for i, m in enumerate(s["mask"]) if m and i > 0]
            diff = max(abs(float(mine[k, i - 1]) - s["old"][i]) for i in at) if at else 0.0
            o["closest"][version] = diff
            if diff <= TOLERANCE:
                o["matches"].append(version)
    return out


def file_adapter_s(server: Any, model: Any, work: Path) -> list[float]:
    """Seconds of the adapter's file round trip: peft's save, vLLM's load, one request."""
    import requests

    out = []
    for k in range(3):
        t0 = time.perf_counter()
        model.save_pretrained(work / f"adapter-{k}")
        body = {"lora_name": f"file-{k}", "lora_path": str(work / f"adapter-{k}")}
        requests.post(
            f"{server.url}/v1/load_lora_adapter", json=body, timeout=120
        ).raise_for_status()
        server.complete(trl_task.CHECK_PROMPTS[:1], 1, model=f"file-{k}")
        out.append(time.perf_counter() - t0)
    return out


def file_model_s(server: Any, model: Any, work: Path) -> list[float]:
    """Seconds of the model's file round trip: safetensors, vLLM's reload_weights, a request."""
    from safetensors.torch import save_file

    out = []
    for k in range(3):
        folder = work / f"weights-{k}"
        folder.mkdir()
        t0 = time.perf_counter()
        state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"))
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        server.post("collective_rpc", rpc)
        server.complete(trl_task.CHECK_PROMPTS[:1], 1)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--lora-steps", type=int, default=None, help="the LoRA run's (default: --steps)"
    )
    ap.add_argument("--baseline", action="store_true", help="time the file round trips too")
    args = ap.parse_args()
    from transport.integrations.vllm.server import VllmServer

    work = args.work or Path(tempfile.mkdtemp(prefix="trl-job-"))
    folder = trl_task.make_model(work / "model")
    server_args = trl_grpo.SERVER_ARGS + trl_grpo.LORA_SERVER_ARGS
    report: dict[str, Any] = {}
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"} if args.baseline else None
    port = reserve_port("127.0.0.1")  # the server's, restarted on it below; held until main ends
    server = VllmServer(folder, work / "vllm.log", args=server_args, port=port.port, env=env)
    try:
        lora_steps = args.steps if args.lora_steps is None else args.lora_steps
        lora = run(server, folder, work, lora_steps, lora=True, kill_after=None)
        transfer, trainer = lora.pop("transfer"), lora.pop("trainer")
        if args.baseline:
            lora["file_s"] = file_adapter_s(server, trainer.model, work)
        transfer.client.remove_adapter("default", "policy")
        report["lora"] = lora
        full = run(server, folder, work, args.steps + 1, lora=False, kill_after=args.steps + 1)
        transfer, trainer = full.pop("transfer"), full.pop("trainer")
        report["full"] = full
        server.kill()
        t0 = time.monotonic()
        server = VllmServer(folder, work / "vllm.log", args=server_args, port=port.port, env=env)
        restart: dict[str, Any] = {"start_s": time.monotonic() - t0}
        before = server.complete(trl_task.CHECK_PROMPTS, trl_task.COMPLETION)
        transfer.send_weights(iter(trainer.model.named_parameters()))
        restart["before"] = before
        restart["got"] = server.complete(trl_task.CHECK_PROMPTS, trl_task.COMPLETION)
        restart["want"] = trl_task.greedy(trl_task.reference(folder, trainer.model))
        restart["served"] = server.get("weight_info")["weight_version"]
        restart["version"] = transfer.version
        if args.baseline:
            ours = []
            for _ in range(3):
                t0 = time.perf_counter()
                transfer.send_weights(iter(trainer.model.named_parameters()))
                server.complete(trl_task.CHECK_PROMPTS[:1], 1)
                ours.append(time.perf_counter() - t0)
            restart["transport_s"] = ours
            restart["file_s"] = file_model_s(server, trainer.model, work)
        transfer.destroy()
        report["restart"] = restart
    finally:
        server.kill()
        report["server_log"] = server.tail(30)
        args.report.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
