"""One full weight update of a vLLM server (start to finish, measured at the trainer) through the
``transport`` backend in its two modes, against what a user without it does on one machine and
against the floor, at each tensor-parallel size (one server per TP), in one run:

* ``sharded``: ``transport``'s default: each worker receives only its TP slice of each parameter,
  in vLLM's format; the trainer publishes into the workers' staging memory, then vLLM's start /
  update / finish (``TransportTrainer.send_weights``);
* ``whole``: the same with ``mode="whole"`` (the behaviour before the sharded mode): every worker
  receives every checkpoint tensor whole and vLLM's loader shards it;
* ``shm``: the trainer saves a safetensors checkpoint to shared memory (/dev/shm) and vLLM
  reloads it (``reload_weights`` through ``/collective_rpc``);
* ``floor``: vLLM's own loader from tensors already in its memory: the whole mode's update of a
  version that already landed (start / update / finish with no transfer). The same in the sharded
  mode (``sharded_load``: our direct loaders, then vLLM's post-processing) is reported too.
* ``streamed``: the sharded layout with room for half a copy of it (``staging_gb``): each version
  comes in parts through two buckets, loaded into vLLM's reload inside its finish call;
* ``inplace`` (with ``--as-stored``): each worker's slice written straight into the parameters
  vLLM computes with, inside its finish call; the server then computes with its parameters as
  stored, as vLLM's GPU builds do (its CPU build packs them for oneDNN, where in place is
  refused), so every mode of that run is measured on such a server.

A worker holds one weight group, so on each server the modes take turns in blocks (whole,
sharded, streamed, whole, ... with ``--blocks 2``), each block with a trainer engine of its own in a
namespace of its own; the switch (the workers leave one group and join the next) and two
versions after it (one into each staging slot: their first touch) are not timed. Within a block
the rounds interleave the mode, its load-only update and ``shm``; ``shm``, measured in every
block, shows whether the blocks of the two modes ran alike. Other processes on the machine are
not ours to stop: the CPU they used during each timed interval is recorded (``other cores``).

Per TP and mode: the bytes the trainer wrote to each worker per version (``Transport.traffic``,
counted as transfers complete), each worker's ``version_bytes`` and ``staging_bytes`` (its
engine state: ``collective_rpc transport_state``), each worker's resident set before its engine
joined and after the first two versions (after a garbage collection in the worker), and the
trainer's.

    bash examples/setup_vllm.sh
    .venv/bin/python benchmarks/vllm_update.py --rounds 5 --worker-spin-s 0.001 \
        --json benchmarks/results-vllm.json

The server runs vLLM's CPU build here, each worker a separate process on a core of its own,
float32. With as many TP workers as cores (TP=2 on two), add ``--worker-spin-s 0.001``: vLLM's
workers spin for 1 s after each message on the cores that the trainer, vLLM's engine and
server need, and every call of an update then waits about a second.
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
from typing import Any, cast

import torch

from transport.cli.bench._util import CpuMeter, group_pids
from transport.cli.bench.sync import mutate
from transport.integrations.vllm.extension import TransportState

MiB = 1 << 20
MODES = ("whole", "sharded", "streamed")  # in this order on each server: see the docstring
#: on a server that computes with its parameters as stored (--as-stored)
AS_STORED_MODES = (*MODES, "inplace")
#: a folder that, on vLLM's PYTHONPATH, makes its CPU build compute with parameters as stored
AS_STORED_PATH = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "as_stored"


def load_key(mode: str) -> str | None:
    """The load-only update measured next to ``mode`` (none in place: nothing to load)."""
    return {"whole": "floor", "sharded": "sharded_load"}.get(mode)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def mib(n: float) -> float:
    return round(n / MiB, 1)


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


class BenchState(TransportState):
    """The workers' extension here: the engine state, and a garbage collection before each
    resident-set reading (a subscriber the worker closed, when it left one group for the other,
    keeps its staging memory until Python's cyclic collector runs)."""

    def collect_garbage(self) -> int:
        import gc

        return gc.collect()

    def reader_spin(self, seconds: float) -> int:
        """How long this worker's readers of vLLM's message queues spin after a message before
        they sleep (vLLM: 1 s); returns how many readers it changed."""
        import gc

        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        found = [o for o in gc.get_objects() if isinstance(o, SpinCondition) and o.is_reader]
        for o in found:
            o.busy_loop_s = seconds
        return len(found)


def run_tp(tp: int, args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """One server of ``tp`` workers: blocks of the whole mode and the sharded mode in turn."""
    from safetensors.torch import save_file
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from transport.integrations.vllm.server import VllmServer
    from transport.integrations.vllm.trainer import (
        HTTPClient,
        TransportTrainer,
        TransportTrainerInitInfo,
    )

    model, state, shm, store = ctx["model"], ctx["state"], ctx["shm"], ctx["store"]
    cores = os.cpu_count() or 1
    here = str(Path(__file__).resolve().parent)
    server_args = (
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--block-size",
        "32",
        "--skip-tokenizer-init",
        "--worker-extension-cls",
        f"{Path(__file__).stem}.BenchState",
    )
    paths = [here, str(AS_STORED_PATH) if args.as_stored else "", os.environ.get("PYTHONPATH")]
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(k % cores) for k in range(tp)),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, paths)),
    }
    modes: tuple[str, ...] = AS_STORED_MODES if args.as_stored else MODES
    if args.delta:  # the sharded mode with delta=True, next to it
        modes = tuple(
            m for mode in modes for m in (mode, "sharded-delta")[: 2 if mode == "sharded" else 1]
        )
    if args.modes:
        modes = tuple(m for m in modes if m in args.modes.split(","))
    t_start = time.perf_counter()
    server = VllmServer(
        ctx["work"] / "model",
        ctx["work"] / f"vllm-tp{tp}.log",
        tp=tp,
        args=server_args,
        env=env,
        start_timeout=600,
    )
    print(f"TP={tp}: server up in {time.perf_counter() - t_start:.0f} s", flush=True)

    def rpc(method: str) -> list[Any]:
        return list(server.post("collective_rpc", {"method": method})["results"])

    def group_rss() -> dict[int, int]:
        rpc("collect_garbage")
        return {pid: rss(pid) for pid in group_pids(server.proc.pid)}

    def timed(m: dict[str, Any], key: str, fn: Any, *fargs: Any) -> None:
        c0, t0 = meter.ticks(), time.perf_counter()
        fn(*fargs)
        dt = time.perf_counter() - t0
        m["times_s"][key].append(dt)
        m["other_cores"][key].append(meter.foreign(c0, meter.ticks(), dt))

    def floor(v: int) -> None:  # the version again: already in the workers' memory
        server.post("start_weight_update")
        server.post("update_weights", {"update_info": {"version": v}})
        server.post("finish_weight_update", {"weight_version": str(v)})

    def via_shm() -> None:
        save_file(state, str(shm / "model.safetensors"))
        server.post(
            "collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(shm)}}
        )

    out: dict[str, Any] = {"tp": tp, "modes": {}}
    # streamed: room for half a copy of a worker's slice (the model over tp, the norms aside),
    # and at least two buckets of its largest tensor (a model of one small layer has few tensors)
    sizes = [x.numel() * x.element_size() for x in state.values()]
    half = max(sum(sizes) / tp / 2, 4 * max(sizes)) / 2**30
    engine = None
    try:
        if args.worker_spin_s is not None:
            out["worker_spin_s"] = args.worker_spin_s
            out["spinning_readers_changed"] = server.post(
                "collective_rpc", {"method": "reader_spin", "args": [args.worker_spin_s]}
            )["results"]
        meter = CpuMeter(server.proc.pid)
        baseline = group_rss()
        for mode in modes:
            keys = [k for k in (mode, load_key(mode), "shm") if k is not None]
            out["modes"][mode] = {
                "times_s": {k: [] for k in keys},
                "other_cores": {k: [] for k in keys},
                "loading_s": [],
                "publish_s": [],
                "first_two_s": [],
                "blocks": [],
            }
        v = 0
        for block in range(args.blocks):
            for mode in modes:
                m = out["modes"][mode]
                before = group_rss()
                trainer_before = rss(os.getpid())
                new = WeightTransferTrainerFactory.trainer_init(  # a TransportTrainer
                    TransportTrainerInitInfo(
                        store.url,
                        namespace=f"vllm-bench-tp{tp}-{mode}-{block}",
                        name=f"trainer-{mode}",
                        rank=0,
                        timeout=300,
                        mode=mode.removesuffix("-delta"),
                        staging_gb=half if mode == "streamed" else None,
                        delta=mode.endswith("-delta"),
                    ),
                    client=HTTPClient(server.url),
                    source=ModuleSource(model),
                )
                if engine is not None:  # the workers left its group for the new one
                    engine.shutdown()
                engine = cast(TransportTrainer, new)
                t = engine.transport
                assert t is not None
                first = []
                for _ in range(2):  # one version into each staging slot: their first touch
                    v += 1
                    t0 = time.perf_counter()
                    engine.send_weights(v)
                    first.append(time.perf_counter() - t0)
                m["first_two_s"].append(first)
                st = rpc("transport_state")
                peers = [s["peer"] for s in st]
                pids = [int(p.rsplit("-", 2)[1]) for p in peers]  # vllm-HOST-PID-rRANK
                after = group_rss()
                m["trainer_rss_growth_mib"] = mib(rss(os.getpid()) - trainer_before)
                written: dict[str, list[int]] = {p: [] for p in peers}

                for r in range(args.rounds):
                    v += 1
                    with torch.no_grad():
                        if args.delta:  # the lowest bit of that share flipped, others each round
                            mutate(list(state.values()), args.delta, v)
                        else:  # every element moved a little
                            for x in state.values():
                                x.add_(1e-3)
                    sent0 = t.traffic()
                    timed(m, mode, engine.send_weights, v)
                    sent1 = t.traffic()
                    for p in peers:
                        w0 = sent0[p].written if p in sent0 else 0
                        written[p].append(sent1[p].written - w0)
                    assert engine.last_times is not None
                    m["loading_s"].append(engine.last_times.update_s)
                    m["publish_s"].append(engine.last_times.publish_s)
                    only_load = load_key(mode)
                    if only_load is not None:
                        timed(m, only_load, floor, v)
                    timed(m, "shm", via_shm)
                    print(
                        f"TP={tp} block {block} {mode} round {r}: "
                        + ", ".join(f"{k} {x[-1] * 1e3:.0f} ms" for k, x in m["times_s"].items()),
                        flush=True,
                    )
                m["blocks"].append(
                    [
                        {
                            "peer": s["peer"],
                            "mode": s["mode"],
                            "written_per_version": sorted(set(written[s["peer"]])),
                            "version_bytes": s["version_bytes"],
                            "staging_bytes": s["staging_bytes"],
                            "fallback": s["fallback"],
                            "rss_server_start_mib": mib(baseline.get(pid, 0)),
                            "rss_before_join_mib": mib(before.get(pid, 0)),
                            "rss_after_two_versions_mib": mib(after[pid]),
                        }
                        for s, pid in zip(st, pids, strict=True)
                    ]
                )
        for m in out["modes"].values():
            m["time_stats_s"] = {k: spread(x) for k, x in m["times_s"].items()}
            m["other_cores_median"] = {k: statistics.median(x) for k, x in m["other_cores"].items()}
            m["loading_median_s"] = statistics.median(m["loading_s"])
            m["publish_median_s"] = statistics.median(m["publish_s"])
            m["workers"] = m["blocks"][0]  # the first join of the mode (its resident set)
        return out
    finally:
        if engine is not None:
            engine.shutdown()
        server.kill()  # its process group: the API server, the engine core, every worker


def ratios(res: dict[str, Any]) -> dict[str, float]:
    def med(m: dict[str, Any], k: str) -> float:
        return float(m["time_stats_s"][k]["median"])

    def per_worker(m: dict[str, Any], k: str) -> float:
        return statistics.mean(max(x[k]) if isinstance(x[k], list) else x[k] for x in m["workers"])

    s, d = res["modes"].get("sharded"), res["modes"].get("sharded-delta")
    delta = (
        {}
        if s is None or d is None
        else {
            "sharded_over_delta_time": med(s, "sharded") / med(d, "sharded-delta"),
            "sharded_over_delta_written": per_worker(s, "written_per_version")
            / per_worker(d, "written_per_version"),
        }
    )
    if "whole" not in res["modes"] or s is None:
        return delta  # a run of --modes without them
    w = res["modes"]["whole"]

    inplace = res["modes"].get("inplace")
    extra = (
        {}
        if inplace is None
        else {
            "shm_over_inplace_time": med(inplace, "shm") / med(inplace, "inplace"),
            "inplace_over_floor_time": med(inplace, "inplace") / med(w, "floor"),
            "sharded_over_inplace_time": med(s, "sharded") / med(inplace, "inplace"),
            "inplace_over_sharded_written": per_worker(inplace, "written_per_version")
            / per_worker(s, "written_per_version"),
        }
    )
    streamed = res["modes"].get("streamed")
    if streamed is not None:
        extra |= {
            "shm_over_streamed_time": med(streamed, "shm") / med(streamed, "streamed"),
            "streamed_over_floor_time": med(streamed, "streamed") / med(w, "floor"),
            "streamed_over_sharded_time": med(streamed, "streamed") / med(s, "sharded"),
            "sharded_over_streamed_staging": per_worker(s, "staging_bytes")
            / per_worker(streamed, "staging_bytes"),
        }
    return (
        delta
        | extra
        | {
            "whole_over_sharded_time": med(w, "whole") / med(s, "sharded"),
            "shm_over_sharded_time": med(s, "shm") / med(s, "sharded"),
            "sharded_over_floor_time": med(s, "sharded") / med(w, "floor"),
            "shm_over_whole_time": med(w, "shm") / med(w, "whole"),
            "whole_over_floor_time": med(w, "whole") / med(w, "floor"),
            "shm_sharded_blocks_over_whole_blocks": med(s, "shm") / med(w, "shm"),
            "whole_over_sharded_written": per_worker(w, "written_per_version")
            / per_worker(s, "written_per_version"),
            "whole_over_sharded_staging": per_worker(w, "staging_bytes")
            / per_worker(s, "staging_bytes"),
        }
    )


def table(results: dict[str, Any]) -> str:
    head = (
        "| TP | system | median s | min-max s | publish s | other cores | "
        "written/worker MiB | version MiB | staging MiB | worker RSS start -> after MiB |"
    )
    lines = [head, "|" + " --- |" * 10]
    for tp, res in results["tp"].items():
        for mode, m in res["modes"].items():
            ws = m["workers"]

            def cell(f: Any, ws: list[dict[str, Any]] = ws) -> str:
                return " / ".join(f(x) for x in ws)

            rows = [
                (
                    mode,
                    cell(lambda x: f"{mib(max(x['written_per_version']))}"),
                    cell(lambda x: f"{mib(x['version_bytes'])}"),
                    cell(lambda x: f"{mib(x['staging_bytes'])}"),
                    cell(
                        lambda x: (
                            f"{x['rss_server_start_mib']:.0f} -> "
                            f"{x['rss_after_two_versions_mib']:.0f}"
                        )
                    ),
                ),
                (load_key(mode), "0", "", "", ""),
                ("shm", "", "", "", ""),
            ]
            rows = [r for r in rows if r[0] is not None]
            for key, *rest in rows:
                t = m["time_stats_s"][key]
                name = f"shm ({mode} blocks)" if key == "shm" else key
                pub = f"{m['publish_median_s']:.3f}" if key == mode else ""
                lines.append(
                    f"| {tp} | {name} | {t['median']:.3f} | {t['min']:.3f}-{t['max']:.3f} | {pub} | "
                    f"{m['other_cores_median'][key]:.2f} | " + " | ".join(rest) + " |"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per block")
    ap.add_argument("--blocks", type=int, default=2, help="blocks of each mode per server")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, one server each")
    ap.add_argument(
        "--worker-spin-s",
        type=float,
        default=None,
        help="seconds the TP workers' readers of vLLM's message queues spin after a "
        "message before sleeping (vLLM's default: 1 s; with as many workers as "
        "cores their spinning starves every other process of the update)",
    )
    ap.add_argument(
        "--as-stored",
        action="store_true",
        help="servers that compute with their parameters as stored (as vLLM's GPU "
        "builds do), and the in-place mode next to the others",
    )
    ap.add_argument(
        "--model",
        choices=("llama", "qwen3-moe"),
        default="llama",
        help="a dense Llama, or a Qwen3 mixture of experts (transformers holds its experts "
        "fused; vLLM's fused MoE layers take each TP rank's slice)",
    )
    ap.add_argument("--experts", type=int, default=16, help="experts per layer (qwen3-moe)")
    ap.add_argument(
        "--moe-intermediate", type=int, default=256, help="each expert's intermediate size"
    )
    ap.add_argument(
        "--delta",
        type=float,
        default=0.0,
        help="each round flips the lowest bit of this share of the elements (0.022: a step of "
        "AdamW at lr 1e-6 in bf16) instead of moving every one, and the sharded mode runs with "
        "delta=True next to it (sharded-delta)",
    )
    ap.add_argument("--modes", default="", help="comma list: only these modes (default: all)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tps = [int(x) for x in args.tp.split(",")]
    # a SIGTERM runs the finally blocks too (every server killed, temporary files removed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    from transport.integrations.vllm import register
    from transport.store.tcp import TcpStore

    register()
    t_run = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="transport-bench-", dir="/dev/shm"))
    store = None
    try:
        common = dict(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 64,
            num_key_value_heads=args.hidden // 64,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            dtype="float32",
        )
        if args.model == "qwen3-moe":
            config = Qwen3MoeConfig(
                **common,
                head_dim=64,
                num_experts=args.experts,
                num_experts_per_tok=2,
                moe_intermediate_size=args.moe_intermediate,
                norm_topk_prob=True,
            )
        else:
            config = LlamaConfig(**common)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        state = {n: p.detach() for n, p in model.named_parameters()}
        nbytes = sum(x.numel() * x.element_size() for x in state.values())
        model.save_pretrained(work / "model", safe_serialization=True)
        shutil.copy(work / "model" / "config.json", shm / "config.json")
        print(f"model: {len(state)} tensors, {nbytes / MiB:.0f} MiB float32", flush=True)
        # the store outlives every trainer engine (its keys live in the process that hosts it)
        store = TcpStore("127.0.0.1", 0, hosting="yes")
        ctx = {"model": model, "state": state, "shm": shm, "store": store, "work": work}
        results: dict[str, Any] = {
            "model": {
                "kind": args.model,
                "mib": mib(nbytes),
                "tensors": len(state),
                "hidden": args.hidden,
                "layers": args.layers,
                "vocab": args.vocab,
                "dtype": "float32",
                **(
                    {"experts": args.experts, "moe_intermediate": args.moe_intermediate}
                    if args.model == "qwen3-moe"
                    else {}
                ),
            },
            "argv": sys.argv[1:],
            "rounds_per_block": args.rounds,
            "blocks": args.blocks,
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "torch": torch.__version__,
            },
            "tp": {},
        }
        try:
            import vllm

            results["machine"]["vllm"] = vllm.__version__
        except Exception:
            pass
        for tp in tps:
            res = run_tp(tp, args, ctx)
            res["ratios"] = ratios(res)
            results["tp"][str(tp)] = res
        results["run_s"] = round(time.perf_counter() - t_run, 1)
        print(table(results))
        for tp, res in results["tp"].items():
            print(f"TP={tp}: " + ", ".join(f"{k} {x:.2f}" for k, x in res["ratios"].items()))
        print(f"run: {results['run_s']:.0f} s")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
