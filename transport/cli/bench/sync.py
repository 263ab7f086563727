"""``transport bench sync``: one trainer publishes a synthetic model's weights to N generators.

ours: ``WeightPublisher.publish(v).wait()`` to every ``WeightSubscriber`` (ours-chain, ours-tree:
generators relay); raw-nixl: the same tensors written into every generator's live tensors, one
transfer each, all posted then polled; gloo-bcast / nccl-bcast: a broadcast per tensor and an
ack; memcpy: the state dict copied once per generator. Raw NIXL and ours alternate step by step;
every system is verified once (each generator checks every tensor; ours after ``apply()``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import torch

import transport
from transport import CliError
from transport.cli.bench import _report, _util
from transport.cli.bench._runner import Ratio, Record, Results, Timing, Turn, Workload
from transport.cli.bench._session import Session
from transport.cli.bench._systems import Dist, Group, Memcpy, RawLink, RawNixl, Route, System
from transport.cli.bench._util import as_bytes, check_all, fill_all, fmt_time, human_bytes
from transport.weights import flat_like
from transport.weights.delta import as_ints, width_of
from transport.weights.group import MAX_DEGREE
from transport.weights.publishing import FANOUTS

GROUP = "bench"
ROLES_IN_LAYER = ["q", "k", "v", "o", "up", "down", "norm1", "norm2"]
WEIGHTS = [1.0, 1.0, 1.0, 1.0, 4.0, 4.0, 1 / 256, 1 / 256]
TARGETS = {"ours/raw": 1.25, "gloo/ours": 1.5}


@dataclass(frozen=True)
class SyncCase:
    """The one configuration: ``tensors`` of ``bytes`` in all to each of the ``generators``."""

    generators: int
    tensors: int
    bytes: int

    def copies(self) -> int:
        return self.generators


def _dtype(name: str) -> torch.dtype:
    if not isinstance(dt := getattr(torch, name, None), torch.dtype):
        raise CliError(
            f"unknown dtype {name!r}; use torch's names, e.g. float32, bfloat16, float16, int8"
        )
    return dt


def make_layout(params: int, tensors: int, dtypes: list[str]) -> list[tuple[str, int, str]]:
    """A transformer-like state dict: per layer q, k, v, o (1 unit each), up, down (4 each) and two
    small norms; ``params`` elements in ``tensors`` tensors, each a multiple of 64 elements."""
    w = [WEIGHTS[i % len(WEIGHTS)] for i in range(tensors)]
    total = sum(w)
    sizes = [max(64, int(params * x / total) // 64 * 64) for x in w]
    sizes[max(range(tensors), key=lambda i: w[i])] += params - sum(sizes)
    roles = len(ROLES_IN_LAYER)
    return [
        (f"layers.{i // roles}.{ROLES_IN_LAYER[i % roles]}", n, dtypes[i % len(dtypes)])
        for i, n in enumerate(sizes)
    ]


def make_moe_layout(
    params: int, experts: int, layers: int, dtypes: list[str]
) -> list[tuple[str, int, str]]:
    """A mixture of experts as a trainer holds it in Hugging Face layout (Qwen3-MoE's names and
    proportions: one tensor per expert matrix, expert intermediate 3/8 of hidden, four query
    heads per key-value head, a vocabulary of 16 x hidden), its hidden size chosen so that it
    holds about ``params`` elements."""
    per_hidden_sq = layers * (2.5 + experts * 3 * 3 / 8) + 2 * 16
    hidden = max(16, int((params / per_hidden_sq) ** 0.5) // 16 * 16)
    inter, kv, vocab = max(8, hidden * 3 // 8 // 8 * 8), hidden // 4, 16 * hidden
    shapes = [("model.embed_tokens.weight", vocab * hidden)]
    for i in range(layers):
        at = f"model.layers.{i}"
        shapes += [
            (f"{at}.input_layernorm.weight", hidden),
            (f"{at}.self_attn.q_proj.weight", hidden * hidden),
            (f"{at}.self_attn.k_proj.weight", kv * hidden),
            (f"{at}.self_attn.v_proj.weight", kv * hidden),
            (f"{at}.self_attn.o_proj.weight", hidden * hidden),
            (f"{at}.self_attn.q_norm.weight", 64),
            (f"{at}.self_attn.k_norm.weight", 64),
            (f"{at}.post_attention_layernorm.weight", hidden),
            (f"{at}.mlp.gate.weight", experts * hidden),
        ]
        for e in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                shapes.append((f"{at}.mlp.experts.{e}.{proj}.weight", inter * hidden))
    shapes += [("model.norm.weight", hidden), ("lm_head.weight", vocab * hidden)]
    return [(n, k, dtypes[i % len(dtypes)]) for i, (n, k) in enumerate(shapes)]


def make_tensors(layout: list[tuple[str, int, str]], flat: bool = False) -> dict[str, torch.Tensor]:
    """Ones of the ``layout``: separately allocated, or (``flat``) views into one buffer."""
    out = {name: torch.ones(n, dtype=_dtype(d)) for name, n, d in layout}
    if flat:
        views = flat_like(out)
        for t in views.values():
            t.fill_(1)
        out = views
    return out


class Publish(System):
    """Ours: the trainer's WeightPublisher publishes the next version with one ``fanout`` and waits
    until every generator has it (a version that misses one is a CliError). Verified after each
    generator's ``apply()``, whose time it records."""

    family = "ours"

    def __init__(self, w: SyncWorkload, fanout: str) -> None:
        super().__init__("ours" if fanout == "direct" else f"ours-{fanout}")
        self.w, self.fanout, self.applies = w, fanout, list[float]()

    def step(self) -> None:
        w = self.w
        if w.pub.delta is not False:
            w.pub.delta = False
        w.pub.fanout, w.version = self.fanout, w.version + 1
        r = w.pub.publish(w.version, timeout=w.timeout).wait(w.timeout)
        if len(r.done) != w.generators:
            raise CliError(
                f"version {w.version} did not reach every generator: {r.status} {r.reasons}"
            )

    def verify(self, seed: int) -> bool:
        s = self.w.s
        s.ask(s.readers, "zero", spec={}, dist=False)
        fill_all(self.w.sd_list, seed)
        self.step()
        replies = s.ask(s.readers, "check", spec={"version": self.w.version}, seed=seed, dist=False)
        self.applies = [m["apply_s"] for m in replies if m.get("apply_s") is not None]
        return all(m["ok"] for m in replies)

    def extra(self) -> dict[str, Any]:
        apply = {"apply_s": statistics.median(self.applies)} if self.applies else {}
        sends = self.w.trainer_sends(self.fanout)
        return {"fanout": self.fanout, "trainer_bytes": self.w.nbytes * sends, **apply}


def mutate(tensors: list[torch.Tensor], share: float, seed: int) -> None:
    """Flip the lowest bit of about ``share`` of the elements of each tensor, at positions drawn
    from ``seed`` (what a training step does to a few percent of bfloat16 weights)."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = as_ints(t, width_of(t))
        k = int(flat.numel() * share)
        if k:
            at = torch.randint(flat.numel(), (k,), generator=g)
            flat[at] ^= 1


class PublishDelta(Publish):
    """Ours with ``delta`` (True: ``ours-delta``, "auto": ``ours-auto``): each sync changes
    ``--delta`` of the elements first, and the version goes to the generators as its changes
    (or, with auto, whichever way it judges faster). Verified on a version that went as changes
    onto one that went whole: every byte against the pattern and the same changes."""

    def __init__(self, w: SyncWorkload, delta: bool | str) -> None:
        System.__init__(self, "ours-delta" if delta is True else "ours-auto")
        self.w, self.fanout, self.applies, self.delta = w, "direct", list[float](), delta
        self.sent: list[int] = []
        self.steps = 0

    def run(self, n: int) -> list[int]:
        """As :meth:`System.run`, each version's changes made before its clock starts (the
        training step's, not the sync's)."""
        clock, out = time.perf_counter_ns, []
        for _ in range(n):
            self.change()
            t0 = clock()
            self.publish()
            out.append(clock() - t0)
        return out

    def step(self) -> None:
        self.change()
        self.publish()

    def change(self) -> None:
        self.steps += 1
        mutate(self.w.sd_list, self.w.delta, seed=1_000_003 * self.steps)

    def publish(self) -> None:
        w = self.w
        if w.pub.delta != self.delta:
            w.pub.delta = self.delta  # the next version goes whole
        w.pub.fanout, w.version = "direct", w.version + 1
        r = w.pub.publish(w.version, timeout=w.timeout).wait(w.timeout)
        if len(r.done) != w.generators:
            raise CliError(
                f"version {w.version} did not reach every generator: {r.status} {r.reasons}"
            )
        whole = w.generators - len(r.patched)
        self.sent.append(sum(r.patched.values()) + whole * w.nbytes)

    def verify(self, seed: int) -> bool:
        s, w = self.w.s, self.w
        s.ask(s.readers, "zero", spec={}, dist=False)
        fill_all(w.sd_list, seed)
        w.pub.delta = self.delta
        Publish.step(self)  # whole: the base
        mutate(w.sd_list, w.delta, seed)
        Publish.step(self)
        spec = {"version": w.version, "mutate": [w.delta, seed]}
        replies = s.ask(s.readers, "check", spec=spec, seed=seed, dist=False)
        return all(m["ok"] for m in replies)

    def extra(self) -> dict[str, Any]:
        sent = statistics.median(self.sent) if self.sent else None
        return {"delta": self.delta, "share": self.w.delta, "trainer_bytes": sent}


@dataclass
class SyncWorkload(Workload):
    """What one ``bench sync`` run measures, fixed by :meth:`from_args`: the state dict (see
    :func:`make_layout`; local readers get its flags), generators, steps, subscriber mode,
    fan-outs, tree degree and baselines. The trainer's state dict, publisher, raw path and
    version counter live from :meth:`setup` to :meth:`close`."""

    params: int
    tensors: int
    dtypes: list[str]
    generators: int
    steps: int
    mode: str
    baselines: list[str]
    timeout: float = 120.0
    pin: bool | None = None  # None: when the host has CPUs enough (bench._util.pin_layout)
    fanouts: list[str] = field(default_factory=lambda: ["direct"])
    degree: int = 2
    layout: list[tuple[str, int, str]] = field(default_factory=list)
    flat: bool = False  # tensors as views into one flat buffer per process (--layout flat)
    experts: int = 0  # a mixture of experts in Hugging Face layout (--experts; 0: dense)
    layers: int = 48
    delta: float = 0.0  # the share of elements each sync changes (--delta; 0: whole only)
    command = "sync"
    main_phase = "ours + raw"
    memcpy_watch = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, peers: list[str] | None) -> SyncWorkload:
        from transport.cli.bench import at_least, count_of, names, parse_baselines

        q = args.quick
        params = _util.parse_size(args.params or ("16M" if q else "256M"), "--params")
        tensors = args.tensors if args.tensors is not None else (50 if q else 300)
        gens = count_of("--generators", args.generators, peers, 2)
        steps = args.steps if args.steps is not None else (3 if q else 10)
        at_least("--tensors", tensors)
        at_least("--steps", steps)
        if not (dtypes := names(args.dtypes)):
            raise CliError("--dtypes is empty; give e.g. float32 or bfloat16,float32")
        for d in dtypes:
            _dtype(d)
        if params < 64 * tensors:
            raise CliError(
                f"--params {args.params} is too small for {tensors} tensors; give at "
                f"least {64 * tensors}"
            )
        fanouts, known = list(dict.fromkeys(names(args.fanout))), ", ".join(FANOUTS)
        if bad := [f for f in fanouts if f not in FANOUTS]:
            raise CliError(f"unknown --fanout {bad[0]!r}; use a comma list of {known}")
        if not fanouts:
            raise CliError(f"--fanout is empty; give e.g. direct,chain ({known})")
        if args.mode == "inplace" and fanouts != ["direct"]:
            raise CliError(
                "relays forward from their staging slots: --fanout chain or tree needs "
                "--mode staging"
            )
        if not 1 <= args.degree <= MAX_DEGREE:
            raise CliError(f"--degree must be from 1 to {MAX_DEGREE}, got {args.degree}")
        if args.experts < 0 or args.layers < 1:
            raise CliError("--experts must be at least 0 and --layers at least 1")
        if not 0 <= args.delta <= 1 or (args.delta and args.mode != "staging"):
            raise CliError(f"--delta is a share from 0 to 1 with --mode staging, got {args.delta}")
        if args.experts:
            layout = make_moe_layout(params, args.experts, args.layers, dtypes)
            tensors = len(layout)
        else:
            layout = make_layout(params, tensors, dtypes)
        return cls(
            params,
            tensors,
            dtypes,
            gens,
            steps,
            args.mode,
            parse_baselines(args.baselines),
            timeout=args.timeout,
            pin=args.pin,
            fanouts=fanouts,
            degree=args.degree,
            layout=layout,
            flat=args.layout == "flat",
            experts=args.experts,
            layers=args.layers,
            delta=args.delta,
        )

    @property
    def readers(self) -> int:  # type: ignore[override]
        return self.generators

    @property
    def ks(self) -> list[int]:  # type: ignore[override]
        return [self.generators]

    @property
    def count(self) -> int:
        """Parameters in the state dict (a mixture of experts holds about ``params``)."""
        return sum(n for _, n, _ in self.layout)

    @property
    def shape(self) -> str:
        if not self.experts:
            return ""
        return f" (a mixture of {self.experts} experts x {self.layers} layers, Hugging Face layout)"

    @property
    def nbytes(self) -> int:
        return sum(n * _dtype(d).itemsize for _, n, d in self.layout)

    def trainer_sends(self, fanout: str) -> int:
        """How many copies of the state dict leave the trainer per sync."""
        n = self.generators
        return n if fanout == "direct" else 1

    def reader_args(self) -> list[str]:
        return [
            "--params",
            str(self.params),
            "--tensors",
            str(self.tensors),
            "--dtypes",
            ",".join(self.dtypes),
            "--mode",
            self.mode,
            "--layout",
            "flat" if self.flat else "separate",
            "--experts",
            str(self.experts),
            "--layers",
            str(self.layers),
            "--delta",
            str(self.delta),
        ]

    def units(self) -> int:
        return 1 + sum(b in self.baselines for b in ("gloo", "nccl", "memcpy"))

    def case(self) -> SyncCase:
        return SyncCase(self.generators, self.tensors, self.nbytes)

    # -- a generator: its live tensors and a WeightSubscriber over them, subscribed at once (the
    # trainer's first contact must find its regions); a check of a ``version`` applies it first

    def prepare_reader(self) -> None:
        self.live = make_tensors(self.layout, self.flat)

    def open_reader(self, t: transport.Transport) -> None:
        self.sub = transport.WeightSubscriber(
            t, self.live, group=GROUP, mode=self.mode, delta=self.delta > 0
        )
        for slot in self.sub.staging if self.mode == "staging" else []:
            # touch them now, not inside a timed step: each slot is one buffer per device
            _util.zero_storages(list(slot.values()))

    def expose(self, t: transport.Transport, m: dict[str, Any]) -> tuple[list[torch.Tensor], dict]:
        return list(self.live.values()), {"addrs": [x.data_ptr() for x in self.live.values()]}

    def check(self, spec: dict[str, Any], seed: int, xs: list[torch.Tensor]) -> dict[str, Any]:
        if "version" not in spec:
            return super().check(spec, seed, xs)
        self.sub.wait_for_version(spec["version"], timeout=60)
        t0 = time.perf_counter()
        applied = self.sub.apply()
        dt = time.perf_counter() - t0
        if "mutate" in spec:  # the pattern with the writer's changes on it
            want = [torch.empty_like(x) for x in self.live.values()]
            fill_all(want, seed)
            mutate(want, *spec["mutate"])
            same = all(
                torch.equal(as_bytes(a), as_bytes(b))
                for a, b in zip(want, self.live.values(), strict=True)
            )
            ok = applied == spec["version"] and same
        else:
            ok = applied == spec["version"] and check_all(list(self.live.values()), seed)
        return {"ok": ok, "apply_s": dt if self.mode == "staging" else None}

    # -- the trainer ----------------------------------------------------------------------------

    def setup(self, s: Session, res: Results) -> None:
        self.s, self.res, self.version, self.path = s, res, 0, None
        self.sd = make_tensors(self.layout, self.flat)
        self.sd_list = list(self.sd.values())
        t0 = time.perf_counter()
        self.pub = transport.WeightPublisher(s.t, self.sd, group=GROUP)
        made = time.perf_counter()
        self.pub.degree = self.degree
        end = time.monotonic() + s.wait
        while len(self.pub.subscribers()) < len(s.readers):
            if problems := self.pub.refresh():
                raise CliError("; ".join(f"{n}: {why}" for n, why in problems.items()))
            if time.monotonic() > end:
                raise CliError(
                    f"the generators did not join group {GROUP!r} within {s.wait:.0f} s "
                    f"(joined: {self.pub.subscribers()})"
                )
            time.sleep(0.02)
        joined = time.perf_counter()
        Publish(self, "direct").step()  # the first: plans for every generator are made here
        self.setup_note(made - t0, joined - made, time.perf_counter() - joined)
        s.ready = s.ask(s.readers, "setup", raw="raw" in self.baselines)
        if "raw" in self.baselines:
            self.raw = RawLink(s, self.sd_list)
            for i, b in enumerate(self.raw.blobs):
                self.raw.connect(i, self.sd_list[0], int(b["addrs"][0]))
            pairs = [(self.sd_list, b["addrs"]) for b in self.raw.blobs]
            self.path = self.raw.path("WRITE", pairs, notif=b"transport-bench-sync")

    def setup_note(self, made: float, joined: float, first: float) -> None:
        """What the setup of this many tensors took, and what it registered and stored."""
        peers = {p.name: p for p in self.s.t.peers()}
        me, gen = peers.get(self.s.t.name), peers.get(self.s.readers[0]) if self.s.readers else None
        sides = [
            f"{who}: {p.regions} regions in {p.registrations} registrations, a record of "
            f"{human_bytes(p.record_bytes)}"
            for who, p in (("trainer", me), ("a generator", gen))
            if p is not None
        ]
        self.res.notes.append(
            f"setup of {self.tensors} tensors: the publisher {fmt_time(made)}, the generators "
            f"joining {fmt_time(joined)}, the first publish (its plans made) {fmt_time(first)}; "
            + "; ".join(sides)
        )

    def close(self) -> None:
        for part in ("path", "raw", "pub", "sub"):  # as far as setup (open_reader) got
            if (x := getattr(self, part, None)) is not None:
                x.close()

    def main_turns(self) -> Iterator[Turn]:
        ours = [Publish(self, f) for f in self.fanouts]
        systems: list[System] = list(ours)
        pairs = [(o.name, "ours") for o in ours if o.name != "ours" and "direct" in self.fanouts]
        if self.path is not None:
            route = Route(self.s, self.s.readers, {}, local=[self.sd_list])
            systems.insert(0, RawNixl("raw-nixl", self.path, route, owns=False))
            pairs = [(o.name, "raw-nixl") for o in ours] + pairs
        timing = Timing(0.0, self.steps, self.steps, 2 if self.mode == "staging" else 1)
        label = f"ours{' + raw' if 'raw' in self.baselines else ''}: {self.steps} syncs"
        yield Turn(label, self.case(), systems, timing, [x.name for x in systems], pairs, False)
        if self.fanouts != ["direct"]:
            sends = ", ".join(f"{f}: {self.trainer_sends(f)}x" for f in self.fanouts)
            self.res.notes.append(
                f"relayed fan-out (ours-chain, ours-tree): the trainer sends "
                f"each version {sends} (tree degree {self.degree}); relays "
                "forward each 32 MiB segment as it lands"
            )
        if self.delta:  # each alone: a mode changed between versions sends the next one whole
            for mode in (True, "auto"):
                delta = PublishDelta(self, mode)
                yield Turn(delta.name, self.case(), [delta], Timing(0.0, self.steps, self.steps))
            self.res.notes.append(
                f"delta: each sync changed {self.delta:.2%} of the elements (their lowest bit); "
                "trainer_bytes: what the trainer wrote per sync (median)"
            )
        if ours[0].applies:
            took = fmt_time(statistics.median(ours[0].applies))
            self.res.notes.append(
                f"ours: a generator's apply() (staging -> live copy, off the "
                f"trainer's path) took {took}"
            )

    def dist_turns(self, group: Group, backend: str) -> Iterator[Turn]:
        xs = [as_bytes(x.to(group.device)) for x in self.sd_list]
        route = Route(self.s, self.s.readers, {}, local=[xs], dist=True)
        system = Dist(f"{backend}-bcast", group, "bcast", xs, route)
        yield Turn(
            f"{backend} broadcast", self.case(), [system], Timing(0.0, self.steps, self.steps)
        )

    def memcpy_turns(self) -> Iterator[Turn]:
        timing = Timing(0.0, self.steps, self.steps)
        yield Turn("memcpy", self.case(), [Memcpy(self.sd_list, self.generators)], timing)
        self.res.notes.append(
            f"memcpy: the state dict copied {self.generators} time(s) in the trainer, one thread"
        )

    # -- the report -----------------------------------------------------------------------------

    def ratios(self, records: list[Record]) -> list[Ratio]:
        """Ours (direct, else the first fan-out) against each other system: time per sync."""
        named = [r for r in records if r.system == "ours"]
        if (ours := next(iter(named or [r for r in records if r.family == "ours"]), None)) is None:
            return []
        fanouts = [ours] + [r for r in records if r.family == "ours" and r is not ours]
        out = []
        for o in (o for o in records if o is not ours):
            if o.family == "ours":  # a relayed fan-out against direct
                x, paired = o.stats.median_s / ours.stats.median_s, o.paired_time_ratio.get("ours")
                out.append(Ratio(ours.system, x, paired, name=f"{o.system}/{ours.system} time"))
            elif o.system == "raw-nixl":
                x, most = ours.stats.median_s / o.stats.median_s, TARGETS["ours/raw"]
                paired = ours.paired_time_ratio.get("raw-nixl")
                out.append(Ratio("raw-nixl", x, paired, most, x <= most, name="ours/raw time"))
            else:  # the broadcast against every fan-out of ours (a relayed one too)
                least = TARGETS["gloo/ours"] if o.system == "gloo-bcast" else None
                for r in fanouts:
                    x = o.stats.median_s / r.stats.median_s
                    ok = None if least is None else x >= least
                    name = f"{o.system}/{r.system} time"
                    out.append(Ratio(o.system, x, None, least, ok, name=name))
        return out

    def report(self, res: Results, ratios: list[Ratio], env: dict[str, Any], out: IO[str]) -> None:
        cpu, gens = env["cpu"], f"{self.generators} generator{'s' if self.generators > 1 else ''}"
        _report.text(
            out,
            f"transport bench sync: {cpu['count']} CPUs ({cpu['model']}); "
            f"{_report.ucx_summary(env['ucx'])}",
            f"\nweight sync: {self.count:,} parameters ({human_bytes(self.nbytes)} of "
            f"{','.join(dict.fromkeys(self.dtypes))}) in {self.tensors} tensors{self.shape} to "
            f"{gens}, {self.mode} mode; median of {self.steps} syncs (GB/s: bytes "
            "delivered to all generators)",
        )
        ours = next((r for r in res.records if r.system == "ours"), None)
        rows = []
        for r in sorted(res.records, key=lambda r: _report.rank(r.system)):
            rel = (
                "-"
                if ours is None or r is ours
                else f"{r.stats.median_s / ours.stats.median_s:.2f}x"
            )
            rows.append([r.system, *_report.cells(r, rel)])
        _report.table(out, "<system|per sync|GB/s|time/ours|p10..p90|steps|ok", [rows])
        if ratios:
            _report.text(out, "\nratios (time per sync; [paired step by step]):")
        for x in ratios:
            rule = "<=" if x.vs == "raw-nixl" else ">="
            verdict = "PASS" if x.passed else "MISS"
            tgt = "" if x.target is None else f"  (target {rule} {x.target})  {verdict}"
            paired = f" [{x.paired:.3f}]" if x.paired is not None else ""
            _report.text(out, f"  {x.name:<22} = {x.ratio:.3f}{paired}{tgt}")

    def plot(self, records: list[Record], path: str, env: dict[str, Any]) -> None:
        fig, ax = _report.pyplot().subplots(figsize=(8, 4.5))
        names, times = [r.system for r in records], [r.stats.median_s for r in records]
        ax.bar(names, times, color=[_report.COLORS.get(n, "tab:blue") for n in names])
        for i, r in enumerate(records):
            ax.text(
                i,
                r.stats.median_s,
                f"{fmt_time(r.stats.median_s)}\n{r.stats.gbps:.2f} GB/s",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_ylim(0, 1.2 * max(times, default=1.0))
        ax.set_ylabel("time per weight sync (s, median)")
        _report.save(
            fig,
            path,
            f"transport bench sync: {human_bytes(self.nbytes)} in "
            f"{self.tensors} tensors to {self.generators} generators ({self.mode})",
        )
