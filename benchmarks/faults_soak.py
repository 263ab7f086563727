"""A soak of weight sync under faults: a trainer publishes 8 fp32 tensors (``--numel`` elements
each; by default 1 Mi, 32 MiB a version) every 0.2 s to 4 staging subscribers (gen-0..gen-3)
while a seeded fault schedule SIGKILLs and restarts subscribers, SIGSTOPs them for 4-6 s and
restarts Redis empty; the last ``--calm`` seconds have no faults. Each subscriber applies every
version it can and checks every element, bit for bit, against what that version must hold
(element i of tensor k at version N is the int32 bit pattern ``base + (N + phase) // 50``, base
and phase hashes of i and k: 2% of the elements change per version). Printed: versions published
and checked, mismatches, each subscriber's newest version against the trainer's, the longest
stretch a subscriber went without a new version (a state that heals only at a later fault shows
here), the convergence time after the last fault, the publishes after recovery that waited out
their deadline, and the exclusion reasons.

    python benchmarks/faults_soak.py --duration 60 --calm 20 --seed 1 --log /tmp/soak/1.jsonl
    python benchmarks/faults_soak.py --store embedded --fanout direct --no-delta --json r.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import random
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import torch

NAMES = [f"gen-{i}" for i in range(4)]
TENSORS, NUMEL, EVERY = 8, 1 << 20, 50  # 8 x 4 MiB fp32; an element changes every 50 versions
TIMEOUT, PERIOD = 5.0, 0.2  # publish deadline, publish pacing
CHECK = "full: every element of every tensor ({} x {} fp32), bit for bit, per apply"


class Expected:
    """What version N holds: tensor k's element i is ``base + (N + phase) // EVERY`` (int32 bits
    of a normal float: never NaN), ``base`` and ``phase`` hashes of i and k."""

    def __init__(self, numel: int) -> None:
        self.base, self.phase = [], []
        for k in range(TENSORS):
            h = (torch.arange(numel, dtype=torch.int64) * 2654435761 + k * 40503) & 0xFFFFFFFF
            self.base.append((((h >> 4) & 0xFFFFFFF) + (1 << 24)).to(torch.int32))
            self.phase.append(((h >> 11) % EVERY).to(torch.int32))

    def write(self, k: int, n: int, out: torch.Tensor) -> torch.Tensor:
        torch.add(self.phase[k], n, out=out)
        return out.div_(EVERY, rounding_mode="floor").add_(self.base[k])

    def mismatches(self, tensors: list[torch.Tensor], n: int, scratch: torch.Tensor) -> int:
        """Elements of ``tensors`` (fp32) that differ from version ``n`` (0: every bit right)."""
        bad = 0
        for k, t in enumerate(tensors):
            live = t.view(torch.int32)
            if not torch.equal(self.write(k, n, scratch), live):
                bad += int(scratch.ne(live).sum())
        return bad


def make_tensors(numel: int) -> dict[str, torch.Tensor]:
    return {f"layers.{k}.w": torch.zeros(numel) for k in range(TENSORS)}


def subscriber(a: argparse.Namespace) -> int:
    """A subscriber process: apply, check, append a JSON line per version to ``a.out``."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the trainer's thread
    if os.getppid() != a.parent:
        return 1
    torch.set_num_threads(1)
    import transport
    from transport import TransferTimeout

    fd = os.open(a.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # a write per line: kill-safe

    def report(**kw: Any) -> None:  # "t" is absolute: CLOCK_MONOTONIC is system-wide
        os.write(fd, json.dumps({"t": time.monotonic(), "pid": os.getpid(), **kw}).encode() + b"\n")

    exp, scratch = Expected(a.numel), torch.empty(a.numel, dtype=torch.int32)
    tensors = make_tensors(a.numel)
    t = sub = None
    while sub is None and time.monotonic() < a.until:  # the store may be down: start again
        try:
            secret = os.environ["SOAK_SECRET"]
            t = transport.Transport(a.name, store=a.store_url, namespace=a.namespace, secret=secret)
            sub = transport.WeightSubscriber(t, tensors, delta=a.delta, mode="staging")
        except Exception as e:
            report(error=f"start: {type(e).__name__}: {e}"[:300])
            if t is not None:
                t.close()
            t = None
            time.sleep(0.5)  # a retry's pause
    if sub is None or t is None:
        return 1
    report(ready=True)
    if a.ready_fd >= 0:
        os.write(a.ready_fd, b"ready\n")
        os.close(a.ready_fd)
    applied, live = -1, list(tensors.values())
    while time.monotonic() < a.until and os.getppid() == a.parent:
        try:
            sub.wait_for_version(applied + 1, timeout=0.5)
            v = sub.apply()
        except TransferTimeout:
            continue
        except Exception as e:
            report(error=f"{type(e).__name__}: {e}"[:300])
            time.sleep(0.5)  # a retry's pause
            continue
        if v > applied:
            bad = exp.mismatches(live, v, scratch)
            report(v=v, ok=bad == 0, bad_elements=bad)
            applied = v
    sub.close()
    t.close()
    return 0


class Redis:
    """A redis-server on 127.0.0.1 without persistence: ``stop`` then ``start`` empties it."""

    def __init__(self, folder: str) -> None:
        from transport.store import reserve_port

        self.held = reserve_port("127.0.0.1")  # the port it restarts on, for this run
        self.port = self.held.port
        self.folder, self.url = folder, f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, timeout: float = 15.0) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", self.folder]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        ready = threading.Event()

        def read(pipe: IO[bytes]) -> None:  # until "Ready", then drain
            for line in pipe:
                if b"Ready to accept connections" in line:
                    ready.set()

        threading.Thread(target=read, args=(self.proc.stdout,), daemon=True).start()
        if not ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"redis-server on port {self.port} did not start in {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # as a crash: nothing is saved anyway
            self.proc.wait(10)


class Soak:
    """The trainer's side: the subscriber processes (spawned by the main thread only: their
    PR_SET_PDEATHSIG follows the thread that forks), the fault schedule, the event log."""

    def __init__(self, a: argparse.Namespace, store_url: str, files: str) -> None:
        self.a, self.store_url, self.files = a, store_url, files
        self.t0 = time.monotonic()
        # subscribers end by themselves past this
        self.until = self.t0 + 180 + a.duration + a.converge_by + 60
        self.secret, self.namespace = secrets.token_hex(16), f"soak-{os.getpid()}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.faults: list[dict[str, Any]] = []
        git = ["git", "-C", str(Path(__file__).parent), "describe", "--always", "--dirty"]
        self.commit = subprocess.run(git, capture_output=True, text=True, timeout=10).stdout.strip()
        for old in [Path(f"{files}/{n}.jsonl") for n in NAMES] + [Path(a.log or os.devnull)]:
            if old.is_file():
                old.unlink()  # a kept folder or log of an earlier run

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def event(self, **kw: Any) -> dict[str, Any]:
        rec = {"t": self.now(), **kw}
        with self.lock, open(self.a.log or os.devnull, "a") as log:
            log.write(json.dumps(rec) + "\n")
        return rec

    def spawn(self, name: str, ready_fd: int = -1) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, __file__, "--role", "sub", "--name", name, "--parent"]
        cmd += [str(os.getpid()), "--store-url", self.store_url, "--namespace", self.namespace]
        cmd += ["--until", repr(self.until), "--out", f"{self.files}/{name}.jsonl"]
        cmd += ["--ready-fd", str(ready_fd), "--delta" if self.a.delta else "--no-delta"]
        cmd += ["--numel", str(self.a.numel)]
        env = {**os.environ, "SOAK_SECRET": self.secret, "OMP_NUM_THREADS": "1"}
        with open(f"{self.files}/{name}.log", "ab") as err:
            p = subprocess.Popen(
                cmd, stdout=err, stderr=err, env=env, pass_fds=(ready_fd,) * (ready_fd >= 0)
            )
        with self.lock:
            self.procs[name] = p
        return p

    def start_all(self, timeout: float = 180.0) -> None:
        """Start every subscriber and wait until each has joined the group."""
        waiting = set()
        for name in NAMES:
            r, w = os.pipe()
            self.spawn(name, w)
            os.close(w)
            waiting.add(r)
        end = time.monotonic() + timeout
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [], max(0.0, end - time.monotonic()))
            if not ready:
                raise RuntimeError(f"subscribers not ready within {timeout} s (see their logs)")
            for r in ready:
                if not os.read(r, 64):
                    raise RuntimeError("a subscriber ended before it was ready (see its log)")
                waiting.discard(r)
                os.close(r)

    def fault(self, kind: str, name: str, rng: random.Random, redis: Redis | None) -> None:
        rec: dict[str, Any] = {"fault": kind} | ({} if kind == "redis" else {"sub": name})
        p = self.procs[name]
        if kind == "stop":
            rec["seconds"] = round(rng.uniform(4.0, 6.0), 2)
        elif kind == "redis":
            rec["down_s"] = round(rng.uniform(0.0, 2.0), 2)
        begin = self.event(event="fault-begin", **rec, pid=p.pid if "sub" in rec else None)["t"]
        try:
            if kind == "kill":
                p.send_signal(signal.SIGKILL)
                p.wait(10)
                self.stop.wait(1.0)
                rec["new_pid"] = self.spawn(name).pid
            elif kind == "stop":
                p.send_signal(signal.SIGSTOP)
                self.stop.wait(rec["seconds"])
                p.send_signal(signal.SIGCONT)
            elif redis is not None:
                redis.stop()
                self.stop.wait(rec["down_s"])
                redis.start()
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        self.faults.append(self.event(event="fault-end", **rec, begin=begin, end=self.now()))

    def fault_loop(self, redis: Redis | None) -> None:
        """Faults one after another, 2-6 s apart, the last ending before the calm."""
        rng = random.Random(self.a.seed)
        kinds = ["kill", "stop"] + ["redis"] * (redis is not None)
        if self.stop.wait(self.a.warmup):
            return
        while not self.stop.wait(rng.uniform(2.0, 6.0)):
            if self.now() + 6.5 > self.a.duration - self.a.calm:
                return
            self.fault(rng.choice(kinds), rng.choice(NAMES), rng, redis)

    def kill_all(self) -> None:
        with self.lock:
            procs = list(self.procs.values())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)

    def reports(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for name in NAMES:
            path, out[name] = Path(self.files) / f"{name}.jsonl", []
            for line in path.read_text().splitlines() if path.exists() else []:
                with contextlib.suppress(ValueError):  # the half line of a killed process
                    out[name].append(json.loads(line))
                    out[name][-1]["t"] = round(out[name][-1]["t"] - self.t0, 3)
        return out

    def all_hold(self, version: int) -> bool:
        """Whether every subscriber has applied ``version`` or a newer one."""
        reps = self.reports()
        return all(any(r.get("v", -1) >= version for r in reps[n]) for n in NAMES)

    def converged(self, pubs: list[dict[str, Any]]) -> bool:
        """Whether every subscriber holds a version published after the last fault ended."""
        end = max((f["end"] for f in self.faults), default=0.0)
        after = [p["v"] for p in pubs if "error" not in p and p["t"] >= end]
        return bool(after) and self.all_hold(after[0])

    def settle(self, last: int, timeout: float = 5.0) -> None:
        """Give the subscribers up to ``timeout`` s to apply and check version ``last``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            reps = self.reports()
            if all(any(r.get("v", -1) >= last for r in reps[n]) for n in NAMES):
                return
            time.sleep(0.2)  # their reports are files: no event to wait on


def publish_loop(soak: Soak, pub: Any, tensors: list[torch.Tensor], out: list[Any]) -> None:
    exp, ints = Expected(soak.a.numel), [x.view(torch.int32) for x in tensors]
    n, tick = 0, time.monotonic()

    def more() -> bool:  # past the duration only while a subscriber has not caught up
        if soak.now() < soak.a.duration:
            return True
        return soak.now() < soak.a.duration + soak.a.converge_by and not soak.converged(out)

    while more() and not soak.stop.is_set():
        n += 1
        for k, x in enumerate(ints):
            exp.write(k, n, x)
        rec: dict[str, Any] = {"v": n, "t": soak.now()}
        start = time.monotonic()
        try:
            r = pub.publish(n, timeout=TIMEOUT).wait(TIMEOUT + 10)
            rec |= {
                "status": r.status,
                "reasons": r.reasons,
                "via": r.via,
                "patched": sorted(r.patched),
            }
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
            soak.event(event="publish-error", v=n, error=rec["error"])
        rec["dur"] = round(time.monotonic() - start, 3)
        rec["deadline"] = "error" not in rec and rec["dur"] >= TIMEOUT - 0.1
        out.append(rec)
        tick = max(tick + PERIOD, time.monotonic())
        soak.stop.wait(max(0.0, tick - time.monotonic()))  # pacing


def short(reason: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "#", reason)[:80]


def summarize(soak: Soak, pubs: list[dict[str, Any]]) -> dict[str, Any]:
    reps, faults = soak.reports(), soak.faults
    ok = [p for p in pubs if "error" not in p]
    last_v = ok[-1]["v"] if ok else 0
    checks = [r for rs in reps.values() for r in rs if "v" in r]
    fault_end = max((f["end"] for f in faults), default=0.0)
    after = [p for p in ok if p["t"] >= fault_end]
    first = after[0]["v"] if after else None
    conv: float | None = None
    if first is not None:  # when every subscriber first held a version published after it
        held = [
            min((r["t"] for r in reps[n] if r.get("v", -1) >= first), default=None) for n in NAMES
        ]
        conv = None if None in held else round(max(t for t in held if t is not None) - fault_end, 3)
    calm = after if conv is None else [p for p in ok if p["t"] >= fault_end + conv]
    hist: collections.Counter[str] = collections.Counter()
    for p in ok:
        hist.update(f"{p['status'][n]}: {short(why)}" for n, why in p["reasons"].items())
    subs: dict[str, Any] = {}
    for n in NAMES:
        applied = [r for r in reps[n] if "v" in r]
        reasons = collections.Counter(short(p["reasons"][n]) for p in after if n in p["reasons"])
        times = [r["t"] for r in applied]
        subs[n] = {
            # the longest stretch without a new version (a kill or a freeze costs about 6 s)
            "longest_gap_s": max(
                (b - a for a, b in zip(times, times[1:], strict=False)), default=None
            ),
            "newest_applied": applied[-1]["v"] if applied else None,
            "behind": last_v - applied[-1]["v"] if applied else None,
            "incarnations": len({r["pid"] for r in reps[n]}),
            "last_ready_s": max((r["t"] for r in reps[n] if "ready" in r), default=None),
            "checks": len(applied),
            "bad": sum(not r["ok"] for r in applied),
            "errors": [r["error"] for r in reps[n] if "error" in r][-3:],
            "status_after_last_fault": collections.Counter(
                p["status"].get(n, "absent") for p in after
            ),
            "reasons_after_last_fault": dict(reasons.most_common(5)),
        }
    return {
        "args": {k: v for k, v in vars(soak.a).items() if k in ARGS},
        "commit": soak.commit,
        "check": CHECK.format(TENSORS, soak.a.numel),
        "published": len(ok),
        "publish_errors": len(pubs) - len(ok),
        "last_version": last_v,
        "rate": len(ok) / max(soak.a.duration, pubs[-1]["t"] if pubs else 0.0, 1e-9),
        "deadline_outs": sum(p["deadline"] for p in pubs),
        "checked": len(checks),
        "bad": sum(not r["ok"] for r in checks),
        "faults": collections.Counter(f["fault"] for f in faults),
        "last_fault_end_s": fault_end,
        "first_version_after": first,
        "convergence_s": "never" if conv is None else conv,
        "longest_gap_s": max((x["longest_gap_s"] or 0.0 for x in subs.values()), default=0.0),
        "deadline_outs_after_recovery": sum(p["deadline"] for p in calm),
        "publishes_after_recovery": len(calm),
        "subscribers": subs,
        "reasons": dict(hist.most_common()),
        "publishes": pubs,
        "fault_log": faults,
    }


def print_report(r: dict[str, Any]) -> None:
    lines = [
        f"\n== faults soak {r['args']} at {r['commit']}\ncheck: {r['check']}",
        f"published {r['published']} versions (last {r['last_version']}, {r['rate']:.2f}/s), "
        f"{r['publish_errors']} publishes raised, {r['deadline_outs']} waited out the deadline",
        f"faults {dict(r['faults'])}, the last ended at {r['last_fault_end_s']:.1f} s",
        f"checked {r['checked']} versions at subscribers: {r['bad']} bad",
        f"convergence after the last fault: {r['convergence_s']} s (every subscriber at version "
        f">= {r['first_version_after']}); after recovery {r['deadline_outs_after_recovery']} of "
        f"{r['publishes_after_recovery']} publishes waited out their deadline",
        f"the longest stretch a subscriber went without a new version: {r['longest_gap_s']:.1f} s",
    ]
    for n, s in r["subscribers"].items():
        lines.append(
            f"  {n}: newest applied {s['newest_applied']} (behind {s['behind']}), "
            f"{s['incarnations']} incarnation(s), the last ready at {s['last_ready_s']} s, "
            f"{s['checks']} checks, {s['bad']} bad, longest gap {s['longest_gap_s']} s; after "
            f"the last fault {dict(s['status_after_last_fault'])}"
        )
        lines += [f"    {c:5d}  {why}" for why, c in s["reasons_after_last_fault"].items()]
        lines += [f"    error: {e[:120]}" for e in s["errors"]]
    lines.append("exclusion and loss reasons, whole run (first 80 chars, digits as #):")
    print("\n".join(lines + [f"  {c:5d}  {why}" for why, c in r["reasons"].items()]))


def trainer(a: argparse.Namespace) -> int:
    import transport
    from transport.store.tcp import TcpStore

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="faults-soak-")
    files = a.child_logs or tmp  # subscribers' reports and stderr
    Path(files).mkdir(parents=True, exist_ok=True)
    redis = store = t = pub = soak = thread = None
    pubs: list[dict[str, Any]] = []
    try:
        if a.store == "redis":
            redis = Redis(tmp)
            url: Any = redis.url
            child_url = redis.url
        else:  # the trainer hosts the embedded store; subscribers join it
            store = TcpStore("127.0.0.1", 0, hosting="yes")
            url, child_url = store, f"tcp://127.0.0.1:{store.port}?host=no"
        soak = Soak(a, child_url, files)
        t = transport.Transport("trainer", store=url, namespace=soak.namespace, secret=soak.secret)
        tensors = make_tensors(a.numel)
        pub = transport.WeightPublisher(t, tensors, delta=a.delta, fanout=a.fanout)
        soak.start_all()
        soak.t0 = time.monotonic()  # the run's clock starts once every subscriber has joined
        soak.event(event="start", args={k: v for k, v in vars(a).items() if k in ARGS})
        args = (soak, pub, list(tensors.values()), pubs)
        thread = threading.Thread(target=publish_loop, args=args, name="publish", daemon=True)
        thread.start()
        soak.fault_loop(redis)  # in the main thread, which spawns every subscriber
        thread.join(a.duration + a.converge_by + 60)
        soak.settle(max((p["v"] for p in pubs if "error" not in p), default=0))
        rep = summarize(soak, pubs)
    finally:
        if soak is not None:
            soak.stop.set()
            if thread is not None:
                thread.join(30)
            soak.kill_all()
        for closing in (pub, t, store):
            if closing is not None:
                closing.close()
        if redis is not None:
            redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print_report(rep)
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=1, default=str))
    return 0 if rep["bad"] == 0 and rep["convergence_s"] != "never" else 1


ARGS = ("fanout", "delta", "store", "seed", "duration", "calm", "warmup", "converge_by", "numel")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fanout", choices=["direct", "chain", "tree"], default="chain")
    ap.add_argument("--delta", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--store", choices=["redis", "embedded"], default="redis")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of publishing")
    ap.add_argument("--calm", type=float, default=20.0, help="seconds without faults at the end")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds before the first fault")
    ap.add_argument(
        "--numel",
        type=int,
        default=NUMEL,
        help=f"elements of each of the {TENSORS} fp32 tensors of a version (default: 4 MiB each)",
    )
    ap.add_argument(
        "--converge-by",
        type=float,
        default=0.0,
        help="publish past --duration, for at most this many more seconds, until every "
        "subscriber holds a version published after the last fault (a restart on a loaded "
        "machine may take longer than the calm; 0: stop at --duration)",
    )
    ap.add_argument("--log", default=None, help="JSON lines: faults and publish errors")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--child-logs", default=None, help="keep subscribers' reports, stderr here")
    ap.add_argument("--role", choices=["trainer", "sub"], default="trainer")
    for flag in ("--name", "--store-url", "--namespace", "--out"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    for flag, kind in (("--until", float), ("--parent", int), ("--ready-fd", int)):
        ap.add_argument(flag, type=kind, default=-1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "sub":
        return subscriber(a)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup in finally
    return trainer(a)


if __name__ == "__main__":
    sys.exit(main())
