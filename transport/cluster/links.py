"""How a cluster's links are shaped: rate, delay, loss, reordering and duplication, with what the
kernel offers.

``tc netem`` does all five, where the kernel has it (``sch_netem``). Kernels built small (some
VMs and containers) lack it; there a rate is a token bucket (``tbf``), loss, reordering and
duplication are nftables rules that pick a share of the packets at random (``numgen random``),
and a delay cannot be made: asking for one fails at once, naming the missing module. Each link
is shaped on both of its ends, so what a host sends and what it receives each see the shape
once.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from transport.errors import ClusterError

_RATE = re.compile(r"\A(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)\Z")
_DELAY = re.compile(r"\A\d+(\.\d+)?(us|ms|s)\Z")
_PERCENT = re.compile(r"\A\d+(\.\d+)?\Z")
_BITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
#: the rate of htb's default class where the link has none
_UNSHAPED = "100gbit"
_FORMAT = "RATE[,DELAY[,LOSS%[,REORDER%[,DUP%]]]]"
#: the nftables table a host's loss lives in (family inet: the host's input and output)
LOSS_TABLE = "transport_loss"
#: the nftables tables that reorder and duplicate what an interface sends (family netdev, a
#: chain per interface, named after it, on its egress hook)
REORDER_TABLE, DUPLICATE_TABLE = "transport_reorder", "transport_duplicate"
#: the slow lane that packets held back take (without netem): a held 1500-byte packet waits
#: 1.2 ms for it, a 64 KiB burst of TCP's offload 50 ms
HOLD_RATE = "10mbit"
#: how many bytes a second may be held back, and in a burst: the lane never queues more than
#: about 80 KB, so nothing waits in it past about 120 ms (TCP's least retransmission timeout is
#: 200 ms), and it adds at most this to the link's rate
HOLD_BUDGET = "64 kbytes/second burst 16 kbytes"
#: the mark of a packet that was duplicated, so that its copy is not duplicated again (the copy
#: goes through the egress hook once more)
DUPLICATED = "0x7470"


@dataclass(frozen=True)
class Link:
    """How one link is shaped, the same both ways: ``rate`` (tc's units: ``2gbit``), ``delay``
    (``100us``), ``loss`` (percent of packets dropped), ``reorder`` (percent of packets taken
    out of order) and ``duplicate`` (percent of packets sent twice); None leaves that unshaped.

    Without netem, a packet taken out of order is held back in a slow lane (:data:`HOLD_RATE`:
    about 1 ms for a full-size packet) while later ones overtake it; at most
    :data:`HOLD_BUDGET` is held, so on a busy link fewer than ``reorder`` percent are, and the
    link keeps its rate. With netem, it is netem's own ``reorder``: that share is sent at once,
    ahead of the others, which wait the link's delay (1 ms where the link has none: netem
    reorders only delayed packets)."""

    rate: str | None = None
    delay: str | None = None
    loss: float | None = None
    reorder: float | None = None
    duplicate: float | None = None

    def __post_init__(self) -> None:
        if self.rate is not None and not _RATE.match(self.rate):
            raise ValueError(
                f"link rate {self.rate!r} is not a tc rate (for example 2gbit, 500mbit)"
            )
        if self.delay is not None and not _DELAY.match(self.delay):
            raise ValueError(f"link delay {self.delay!r} is not a tc time (for example 100us, 2ms)")
        for name in ("loss", "reorder", "duplicate"):
            share = getattr(self, name)
            if share is not None and not 0 <= share < 100:
                raise ValueError(
                    f"link {name} must be a percentage, at least 0 and under 100; got {share!r}"
                )

    @classmethod
    def parse(cls, text: str) -> Link:
        """``"2gbit,100us"``, ``"2gbit,100us,5%"`` or ``"1gbit,,1%,20%,5%"`` (rate, delay,
        loss, reorder, duplicate; any part may be left empty, a percent sign is optional)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) > 5:
            raise ValueError(f"a link is {_FORMAT}, got {text!r}")
        parts += [""] * (5 - len(parts))
        shares = []
        for name, part in zip(("loss", "reorder", "duplicate"), parts[2:], strict=True):
            number = part.removesuffix("%")
            if number and not _PERCENT.match(number):
                raise ValueError(
                    f"a link is {_FORMAT} (such as 1gbit,,1%,20%): its {name} {part!r} is not "
                    "a percentage"
                )
            shares.append(float(number) if number else None)
        try:
            return cls(parts[0] or None, parts[1] or None, *shares)
        except ValueError as e:
            raise ValueError(f"a link is {_FORMAT} (such as 2gbit,100us): {e}") from e

    @property
    def bits_per_s(self) -> float | None:
        """The rate in bits per second (None: unshaped)."""
        return _bits_per_s(self.rate)

    def __str__(self) -> str:
        shown = [self.rate or "unshaped", self.delay or "no delay"]
        for share, what in (
            (self.loss, "loss"),
            (self.reorder, "reordered"),
            (self.duplicate, "duplicated"),
        ):
            shown += [f"{share:g}% {what}"] if share else []
        return ", ".join(shown)


class Shaper:
    """Applies :class:`Link` shapes to interfaces, with netem where the kernel has it and tbf
    (htb when it reorders) plus nftables where it does not (it learns which at its first
    netem). Each call replaces what the interface or host had; it remembers which nftables
    chains it made, so that a shape without them removes them and costs nothing otherwise."""

    def __init__(self) -> None:
        self.netem: bool | None = None  # unknown until tried
        self._chains: set[tuple[str, str, str]] = set()  # (namespace, table, chain)

    def shape(self, namespace: str, dev: str, link: Link) -> None:
        """Shape what ``dev`` in ``namespace`` sends as ``link``, all but its loss without
        netem (:meth:`lose`, for the host)."""
        if (link.delay or link.loss or link.reorder or link.duplicate) and self._netem(
            namespace, dev, link
        ):
            return
        if link.delay:
            raise ClusterError(
                f"a link delay ({link.delay}) needs tc's netem qdisc, which this kernel lacks "
                "(module sch_netem); shape rate, loss, reordering and duplication only, or use "
                "a kernel with sch_netem"
            )
        self.pace(namespace, dev, link.rate, hold_lane=bool(link.reorder))
        self.reorder(namespace, dev, link.reorder)
        self.duplicate(namespace, dev, link.duplicate)

    def _netem(self, namespace: str, dev: str, link: Link) -> bool:
        """Shape ``dev`` with netem; False where the kernel has no netem."""
        if self.netem is False:
            return False
        args = ["limit", "100000"]  # a deep queue: netem's 1000 packets drop what TCP paces
        delay = link.delay or ("1ms" if link.reorder else None)  # netem reorders delayed ones
        args += ["delay", delay] if delay else []
        args += ["rate", link.rate] if link.rate else []
        args += ["loss", f"{link.loss}%"] if link.loss else []
        args += ["reorder", f"{link.reorder}%"] if link.reorder else []
        args += ["duplicate", f"{link.duplicate}%"] if link.duplicate else []
        done = _tc(namespace, "qdisc", "replace", "dev", dev, "root", "netem", *args)
        if done.returncode == 0:
            self.netem = True
            return True
        if "unknown" not in done.stderr:
            raise ClusterError(f"tc netem on {dev} in {namespace}: {done.stderr.strip()}")
        self.netem = False
        return False

    def pace(self, namespace: str, dev: str, rate: str | None, hold_lane: bool = False) -> None:
        """Without netem: send from ``dev`` at ``rate`` at most (None: as fast as it goes), with
        a token bucket (tbf); ``hold_lane``: with htb instead, whose default class carries the
        rate and whose class 1:20 is the slow lane of packets held back (:meth:`reorder`)."""
        bits = _bits_per_s(rate or _UNSHAPED) or 0.0
        # a burst of 4 ms at the rate, at least 64 KiB (one segment of TCP's offload)
        burst = str(max(64 << 10, int(bits / 8 * 0.004)))
        if hold_lane:
            steps = [
                ["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
                ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:10", "htb"]
                + ["rate", rate or _UNSHAPED, "burst", burst, "cburst", burst, "quantum", "60000"],
                ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:20", "htb"]
                + ["rate", HOLD_RATE, "ceil", HOLD_RATE, "burst", "1", "cburst", "1"]
                + ["quantum", "1514"],
            ]
        elif rate:
            steps = [
                ["qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst]
                + ["latency", "100ms"]
            ]
        else:
            _tc(namespace, "qdisc", "del", "dev", dev, "root")  # nothing there is fine
            return
        for step in steps:
            done = _tc(namespace, *step)
            if done.returncode != 0:
                raise ClusterError(f"tc {' '.join(step)} in {namespace}: {done.stderr.strip()}")

    def lose(self, namespace: str, loss: float | None) -> None:
        """Without netem: drop ``loss`` percent of what the host in ``namespace`` sends and of
        what it receives, at random (nftables); None or 0 drops nothing."""
        if self.netem:
            return  # netem drops them on the interfaces
        for chain, hook in (("out", "output"), ("in", "input")):
            rule = f"numgen random mod 10000 < {_per_10k(loss)} drop" if loss else None
            self._rule(namespace, f"inet {LOSS_TABLE}", chain, f"hook {hook}", rule)

    def reorder(self, namespace: str, dev: str, reorder: float | None) -> None:
        """Without netem: hold ``reorder`` percent of what ``dev`` sends back in the slow lane
        that :meth:`pace` made (``hold_lane``), up to :data:`HOLD_BUDGET`, while later packets
        overtake them (nftables sets their priority to the lane's class); None or 0 holds
        nothing."""
        if self.netem:
            return
        rule = None
        if reorder:
            pick = f"numgen random mod 10000 < {_per_10k(reorder)}"
            rule = f'{pick} limit rate {HOLD_BUDGET} meta priority set "1:20"'
        self._rule(namespace, f"netdev {REORDER_TABLE}", dev, f'hook egress device "{dev}"', rule)

    def duplicate(self, namespace: str, dev: str, duplicate: float | None) -> None:
        """Without netem: send ``duplicate`` percent of what ``dev`` sends twice, the copy right
        after the packet (nftables ``dup``); None or 0 duplicates nothing."""
        if self.netem:
            return
        rule = None
        if duplicate:
            pick = f"meta mark != {DUPLICATED} numgen random mod 10000 < {_per_10k(duplicate)}"
            rule = f'{pick} meta mark set {DUPLICATED} dup to "{dev}"'
        self._rule(namespace, f"netdev {DUPLICATE_TABLE}", dev, f'hook egress device "{dev}"', rule)

    def _rule(self, namespace: str, table: str, chain: str, hook: str, rule: str | None) -> None:
        """Make ``chain`` of nftables ``table`` ("family name") in ``namespace`` a filter on
        ``hook`` holding ``rule`` alone, in one transaction; None: remove the chain (if this
        shaper made it)."""
        key = (namespace, table, chain)
        if rule is None and key not in self._chains:
            return
        make = (
            f"add table {table}; add chain {table} {chain} {{ type filter {hook} priority 0; }}; "
        )
        if rule is None:
            _nft(namespace, make + f"delete chain {table} {chain}")
            self._chains.discard(key)
        else:
            _nft(namespace, make + f"flush chain {table} {chain}; add rule {table} {chain} {rule}")
            self._chains.add(key)


def _bits_per_s(rate: str | None) -> float | None:
    m = _RATE.match(rate or "")
    return None if m is None else float(m.group(1)) * _BITS[m.group(2)]


def _per_10k(percent: float | None) -> int:
    return int(round((percent or 0) * 100))


def _tc(namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["tc", "-n", namespace, *args], capture_output=True, text=True, timeout=30
    )


def _nft(namespace: str, script: str) -> None:
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", namespace, "nft", script],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as e:
        raise ClusterError(f"nft: {e}") from e
    if done.returncode != 0:
        hint = " (apt-get install nftables)" if "No such file" in done.stderr else ""
        raise ClusterError(f"nft {script!r} in {namespace}: {done.stderr.strip()}{hint}")
