"""What an idle ``transport`` backend costs a vLLM server: its decode throughput while every worker
holds a live subscriber of the trainer's weight group that receives nothing, against the same
server with the backend's engine torn down, in interleaved rounds on one server.

    bash examples/setup_vllm.sh
    .venv/bin/python benchmarks/vllm_idle.py [--rounds 6] [--idle-seconds 60] [--json FILE]

With ``--idle-seconds S``, after the rounds, each condition once more with no request for S
seconds: the share of a core the worker used, and the share and the wake-ups of our threads.

One vLLM server (its CPU build here, as the examples run it: a small random Llama saved locally,
float32, ``--enforce-eager``, a short ``--max-model-len``, no tokenizer, no prefix caching) starts
with ``--weight-transfer-config '{"backend": "transport"}'`` (``VllmServer``), and this process
joins it as the trainer (``TransportTrainer``, the store hosted here). Each round measures both
conditions, in the order A B, then B A in the next round, and so on (drift cancels):

* ``idle``: the trainer sends a version (``send_weights``: the workers join the weight group
  first if they left it, then load the version); then nothing is sent while the decode is timed.
  Every worker holds its Transport and its subscriber, joined and idle (checked through
  ``collective_rpc transport_state``: each worker names its peer and holds that version).
* ``without``: the same server after vLLM's ``POST /shutdown_weight_transfer_engine`` (each
  worker's ``TransportEngine.shutdown``: it leaves the group and closes its Transport; checked:
  no worker names a peer; the threads of ours left in the worker are counted in each round). The
  trainer's engine (in this process, not the server's) stays as it is in both conditions.

So condition 2 is the server with the engine torn down, not a second server without the
backend: vLLM's own route releases the trainer connection while inference goes on, and the
next ``send_weights`` joins the workers again.

Throughput of a round: ``--requests`` requests to ``/v1/completions``, one after the other, each
a batch of ``--batch`` prompts of ``--prompt-len`` token ids that each generate exactly
``--tokens`` tokens (``ignore_eos``, ``min_tokens``); generated tokens over the requests' wall
time. After each switch one short request runs untimed, then the round waits until the workers'
transport engines sleep (polled; without them, after the same window). Reported per condition:
the median tokens/s, its spread, the ratio idle / without of the medians (goal: at least 0.99)
and the median of the rounds' own ratios; the wake-ups per second (voluntary context switches)
of the worker process's threads over the timed window, all of them and ours (``transport-*``),
read in the worker (``thread_wakeups`` through a worker extension of this file); and the CPU
that other processes of the machine used meanwhile (``other cores``), which are not ours to
stop.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from transport.cli.bench._util import CpuMeter
from transport.integrations.vllm.extension import TransportState

CONDITIONS = ("idle", "without")
GOAL = 0.99  # idle over without: at least this
OURS = "transport-"  # the prefix of every thread the library starts
ENGINE = "transport-engine-"  # the progress engine's thread (one per Transport)
#: a worker is measured once its engine sleeps: at most this many wake-ups of the engine threads
#: over QUIET_S seconds (asleep it wakes once a second at most; after activity it polls for
#: 0.2 s, backing off from 50 us), polled every POLL_S, within QUIET_DEADLINE_S
QUIET_WAKEUPS, QUIET_S, POLL_S, QUIET_DEADLINE_S = 2, 0.3, 0.05, 30.0


class IdleState(TransportState):
    """The workers' extension here: the engine state (``transport_state``) and the wake-ups of
    each thread of the worker's process so far."""

    def idle_wakeups(self) -> dict[str, Any]:
        from transport.cli.bench._util import thread_wakeups

        return {"pid": os.getpid(), "wakeups": thread_wakeups(), "cpu": thread_cpu()}


def thread_cpu() -> dict[str, float]:
    """The CPU seconds (user and system) of each thread of this process so far, by its Python
    name (``native-<id>`` for threads of none); the process's total under ``"*"``."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {"*": sum(os.times()[:2])}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[names.get(int(tid), f"native-{tid}")] = (int(fields[11]) + int(fields[12])) / tick
    return out


def spread(xs: list[float]) -> dict[str, float]:
    med = statistics.median(xs)
    return {"median": med, "min": min(xs), "max": max(xs), "rel_range": (max(xs) - min(xs)) / med}


def wakeup_rates(
    before: list[dict[str, Any]], after: list[dict[str, Any]], seconds: float
) -> dict[str, Any]:
    """Wake-ups per second over a window, summed over the workers: of all their threads, of
    ours, the busiest threads and each of ours (a thread that started in the window counts from
    zero)."""
    per: dict[str, float] = {}
    ours = 0
    for b, a in zip(before, after, strict=True):
        if a["pid"] != b["pid"]:
            raise RuntimeError(f"a vLLM worker was replaced ({b['pid']} -> {a['pid']})")
        for name, count in a["wakeups"].items():
            per[name] = per.get(name, 0.0) + (count - b["wakeups"].get(name, 0)) / seconds
        ours += sum(1 for n in a["wakeups"] if n.startswith(OURS))
    mine = {n: v for n, v in per.items() if n.startswith(OURS)}
    return {
        "all_per_s": sum(per.values()),
        "ours_per_s": sum(mine.values()),
        "our_threads": ours,
        "threads": sum(len(a["wakeups"]) for a in after),
        "top_per_s": dict(sorted(per.items(), key=lambda x: -x[1])[:6]),
        "ours_by_thread_per_s": mine,
    }


def idle_cpu(before: list[dict], after: list[dict], seconds: float) -> dict[str, Any]:
    """The share of a core the workers used over ``seconds`` with no request (the first
    worker's: one per server here), all of it and that of our threads (``transport-*``)."""
    b, a = before[0], after[0]
    ours = [n for n in a["cpu"] if n.startswith(OURS)]
    woke = sum(a["wakeups"].get(n, 0) - b["wakeups"].get(n, 0) for n in ours)
    return {
        "seconds": seconds,
        "worker_cores": (a["cpu"]["*"] - b["cpu"]["*"]) / seconds,
        "ours_cores": sum(a["cpu"][n] - b["cpu"].get(n, 0.0) for n in ours) / seconds,
        "ours_wakeups_per_s": woke / seconds,
        "ours_by_thread_cores": {n: (a["cpu"][n] - b["cpu"].get(n, 0.0)) / seconds for n in ours},
    }


def make_model(folder: Path, args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=max_len(args),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def max_len(args: argparse.Namespace) -> int:
    """The server's ``--max-model-len``: a prompt and its tokens, in whole blocks of 32."""
    return -(-(args.prompt_len + args.tokens) // 32) * 32


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from transport.integrations.vllm import register
    from transport.integrations.vllm.server import VllmServer
    from transport.integrations.vllm.trainer import (
        HTTPClient,
        TransportTrainer,
        TransportTrainerInitInfo,
    )
    from transport.store.tcp import TcpStore

    register()  # the trainer runs no vLLM engine: register the backend's trainer side here
    model = make_model(work / "model", args)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model: {nbytes / 2**20:.0f} MiB float32", flush=True)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=g).tolist()
    server_args = (
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(max_len(args)),
        "--block-size",
        "32",
        "--skip-tokenizer-init",
        "--no-enable-prefix-caching",  # each request prefills the same: a version resets it
        "--worker-extension-cls",
        f"{Path(__file__).stem}.IdleState",
    )
    paths = [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")]
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    t0 = time.perf_counter()
    server = VllmServer(
        work / "model", work / "vllm.log", args=server_args, env=env, start_timeout=600
    )
    up_s = time.perf_counter() - t0
    print(f"server up in {up_s:.0f} s", flush=True)
    store = None
    engine: TransportTrainer | None = None
    try:
        store = TcpStore("127.0.0.1", 0, hosting="yes")

        def rpc(method: str) -> list[Any]:
            return list(server.post("collective_rpc", {"method": method})["results"])

        def decode(batch: list[list[int]], tokens: int) -> tuple[int, float]:
            """Generated tokens and the wall seconds of one request."""
            body = {
                "model": server.model,
                "prompt": batch,
                "max_tokens": tokens,
                "min_tokens": tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            t = time.perf_counter()
            answer = server.post("v1/completions", body)
            dt = time.perf_counter() - t
            got = int(answer["usage"]["completion_tokens"])
            if got != len(batch) * tokens:
                raise RuntimeError(f"{got} tokens generated, {len(batch) * tokens} asked")
            return got, dt

        engine = WeightTransferTrainerFactory.trainer_init(  # a TransportTrainer
            TransportTrainerInitInfo(store.url, namespace="vllm-idle", rank=0, timeout=120),
            client=HTTPClient(server.url),
            source=ModuleSource(model),
        )
        assert isinstance(engine, TransportTrainer)
        version = 0

        def switch(condition: str) -> float:
            """Put the server in ``condition`` and check that it is; the seconds it took."""
            nonlocal version
            t = time.perf_counter()
            if condition == "idle":
                version += 1
                assert engine is not None
                engine.send_weights(version)  # joins the group again if the workers left it
                states = rpc("transport_state")
                if not all(s["peer"] and s["version"] == version for s in states):
                    raise RuntimeError(f"workers not idle in the group at {version}: {states}")
            else:
                server.post("shutdown_weight_transfer_engine")
                states = rpc("transport_state")
                if any(s["peer"] for s in states):
                    raise RuntimeError(f"a worker kept its transport engine: {states}")
            dt = time.perf_counter() - t
            decode(prompts[:1], min(8, args.tokens))  # untimed: the first request after it
            return dt

        def engine_wakeups() -> int:
            """The wake-ups of the workers' transport engine threads so far."""
            return sum(
                n
                for w in rpc("idle_wakeups")
                for name, n in w["wakeups"].items()
                if name.startswith(ENGINE)
            )

        def wait_quiet() -> float:
            """Wait until the workers' transport engines sleep (after activity they poll for a
            while, progress_engine.ACTIVE_S): at most QUIET_WAKEUPS wake-ups over QUIET_S, the
            condition polled every POLL_S until QUIET_DEADLINE_S; the seconds it took (none of
            ours: at once after QUIET_S, as in both conditions)."""
            t0 = time.perf_counter()
            marks = [(t0, engine_wakeups())]
            while True:
                now, count = time.perf_counter(), engine_wakeups()
                marks.append((now, count))
                while len(marks) > 2 and now - marks[1][0] >= QUIET_S:
                    marks.pop(0)
                if now - marks[0][0] >= QUIET_S and count - marks[0][1] <= QUIET_WAKEUPS:
                    return now - t0
                if now - t0 > QUIET_DEADLINE_S:
                    raise RuntimeError(
                        f"the workers' transport engines did not settle in {QUIET_DEADLINE_S} s: "
                        f"{count - marks[0][1]} wake-ups in the last {now - marks[0][0]:.2f} s"
                    )
                time.sleep(POLL_S)  # a poll interval: the condition above is what is waited on

        switch("idle")  # the first join and first version (their first touch), untimed
        decode(prompts, args.tokens)  # warm-up
        meter = CpuMeter(server.proc.pid)
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = CONDITIONS if r % 2 == 0 else CONDITIONS[::-1]
            for condition in order:
                switch_s = switch(condition)
                quiet_s = wait_quiet()
                w0, c0 = rpc("idle_wakeups"), meter.ticks()
                t = time.perf_counter()
                tokens = seconds = 0.0
                for _ in range(args.requests):
                    n, dt = decode(prompts, args.tokens)
                    tokens, seconds = tokens + n, seconds + dt
                window = time.perf_counter() - t
                c1, w1 = meter.ticks(), rpc("idle_wakeups")
                rec: dict[str, Any] = {
                    "round": r,
                    "condition": condition,
                    "switch_s": switch_s,
                    "quiet_s": quiet_s,
                    "tokens": int(tokens),
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "other_cores": meter.foreign(c0, c1, window),
                    # the rpc's own wake-ups fall in the window too: alike in both conditions
                    "wakeups": wakeup_rates(w0, w1, time.perf_counter() - t),
                }
                rounds.append(rec)
                print(
                    f"round {r} {condition:7s}: {rec['tokens_per_s']:7.1f} tok/s "
                    f"({seconds:.2f} s), other cores {rec['other_cores']:.2f}, wake-ups/s "
                    f"{rec['wakeups']['all_per_s']:.0f} (ours {rec['wakeups']['ours_per_s']:.1f} "
                    f"in {rec['wakeups']['our_threads']} threads); switch {switch_s:.2f} s, "
                    f"quiet after {quiet_s:.2f} s",
                    flush=True,
                )
        idle: dict[str, Any] = {}
        if args.idle_seconds > 0:
            for condition in CONDITIONS:
                switch(condition)
                wait_quiet()
                before, t = rpc("idle_wakeups"), time.perf_counter()
                time.sleep(args.idle_seconds)  # the window measured: nothing runs meanwhile
                after, window = rpc("idle_wakeups"), time.perf_counter() - t
                idle[condition] = idle_cpu(before, after, window)
                print(
                    f"idle {args.idle_seconds:g} s, {condition:7s}: the worker used "
                    f"{100 * idle[condition]['worker_cores']:.2f}% of a core, our threads "
                    f"{100 * idle[condition]['ours_cores']:.3f}% "
                    f"({idle[condition]['ours_wakeups_per_s']:.1f} wake-ups a second)",
                    flush=True,
                )
        return {"server_up_s": up_s, "model_mib": nbytes / 2**20, "rounds": rounds, "idle": idle}
    finally:
        if engine is not None:
            engine.shutdown()
        server.kill()  # its process group: the API server, the engine core, every worker
        if store is not None:
            store.close()


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def of(condition: str, key: str) -> list[float]:
        return [float(x[key]) for x in rounds if x["condition"] == condition]

    def wake(condition: str, key: str) -> float:
        return statistics.median(x["wakeups"][key] for x in rounds if x["condition"] == condition)

    per: dict[str, dict[str, Any]] = {
        c: {
            "tokens_per_s": spread(of(c, "tokens_per_s")),
            "other_cores_median": statistics.median(of(c, "other_cores")),
            "wakeups_per_s_median": wake(c, "all_per_s"),
            "our_wakeups_per_s_median": wake(c, "ours_per_s"),
            "our_threads_median": wake(c, "our_threads"),
        }
        for c in CONDITIONS
    }
    idle, without = of("idle", "tokens_per_s"), of("without", "tokens_per_s")
    paired = [a / b for a, b in zip(idle, without, strict=True)]  # each round's own ratio
    ratio = per["idle"]["tokens_per_s"]["median"] / per["without"]["tokens_per_s"]["median"]
    return {
        "conditions": per,
        "ratio_idle_over_without": ratio,
        "paired_ratios": spread(paired),
        "goal": GOAL,
        "goal_met": ratio >= GOAL,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds of both conditions")
    ap.add_argument("--requests", type=int, default=4, help="timed requests per condition/round")
    ap.add_argument("--batch", type=int, default=8, help="prompts per request")
    ap.add_argument("--prompt-len", type=int, default=16, help="token ids per prompt")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each prompt generates")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument(
        "--idle-seconds",
        type=float,
        default=0.0,
        help="then measure the idle worker's CPU over this window in each condition (0: not)",
    )
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    # a SIGTERM runs the finally blocks too (the server killed, temporary files removed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    t_run = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="vllm-idle-"))
    try:
        res = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(res["rounds"])
    for c, s in summary["conditions"].items():
        t = s["tokens_per_s"]
        print(
            f"{c:7s}: median {t['median']:7.1f} tok/s (min {t['min']:.1f}, max {t['max']:.1f}, "
            f"range {100 * t['rel_range']:.1f}% of the median), other cores "
            f"{s['other_cores_median']:.2f}, worker wake-ups/s {s['wakeups_per_s_median']:.0f} "
            f"(ours {s['our_wakeups_per_s_median']:.1f} in {s['our_threads_median']:.0f} threads)"
        )
    p = summary["paired_ratios"]
    print(
        f"idle / without: {summary['ratio_idle_over_without']:.3f} (medians; per round median "
        f"{p['median']:.3f}, {p['min']:.3f}-{p['max']:.3f}); goal >= {GOAL}: "
        f"{'met' if summary['goal_met'] else 'NOT met'}"
    )
    run_s = time.perf_counter() - t_run
    print(f"run: {run_s:.0f} s (server up in {res['server_up_s']:.0f} s)")
    if args.json:
        results: dict[str, Any] = {
            "argv": sys.argv[1:],
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model_mib": round(res["model_mib"], 1),
            "server_up_s": round(res["server_up_s"], 1),
            "run_s": round(run_s, 1),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "torch": torch.__version__,
            },
            **summary,
            "idle": res["idle"],
            "rounds": res["rounds"],
        }
        try:
            import vllm

            results["machine"]["vllm"] = vllm.__version__
        except Exception:
            pass
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
