"""How a cluster's links are shaped: rate, delay and loss, with what the kernel offers.

``tc netem`` does all three, where the kernel has it (``sch_netem``). Kernels built small (some
VMs and containers) lack it; there a rate is a token bucket (``tbf``), loss is nftables dropping
a share of the host's packets at random (``numgen random``), and a delay cannot be made: asking
for one fails at once, naming the missing module. Each link is shaped on both of its ends, so
what a host sends and what it receives each see the shape once.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from transport.errors import ClusterError

_RATE = re.compile(r"\A(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)\Z")
_DELAY = re.compile(r"\A\d+(\.\d+)?(us|ms|s)\Z")
_BITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
#: the nftables table a host's loss lives in
LOSS_TABLE = "transport_loss"


@dataclass(frozen=True)
class Link:
    """How one link is shaped, the same both ways: ``rate`` (tc's units: ``2gbit``), ``delay``
    (``100us``), ``loss`` (percent of packets dropped); None leaves that unshaped."""

    rate: str | None = None
    delay: str | None = None
    loss: float | None = None

    def __post_init__(self) -> None:
        if self.rate is not None and not _RATE.match(self.rate):
            raise ValueError(
                f"link rate {self.rate!r} is not a tc rate (for example 2gbit, 500mbit)"
            )
        if self.delay is not None and not _DELAY.match(self.delay):
            raise ValueError(f"link delay {self.delay!r} is not a tc time (for example 100us, 2ms)")
        if self.loss is not None and not 0 <= self.loss < 100:
            raise ValueError(f"link loss must be a percentage from 0 to 100, got {self.loss!r}")

    @classmethod
    def parse(cls, text: str) -> Link:
        """``"2gbit,100us"`` or ``"2gbit,100us,5%"`` (any part may be left empty)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) > 3:
            raise ValueError(f"a link is RATE[,DELAY[,LOSS%]], got {text!r}")
        parts += [""] * (3 - len(parts))
        loss = parts[2].removesuffix("%")
        try:
            return cls(parts[0] or None, parts[1] or None, float(loss) if loss else None)
        except ValueError as e:
            raise ValueError(f"a link is RATE[,DELAY[,LOSS%]] (such as 2gbit,100us): {e}") from e

    @property
    def bits_per_s(self) -> float | None:
        """The rate in bits per second (None: unshaped)."""
        m = _RATE.match(self.rate or "")
        return None if m is None else float(m.group(1)) * _BITS[m.group(2)]

    def __str__(self) -> str:
        shown = [self.rate or "unshaped", self.delay or "no delay"]
        return ", ".join(shown + ([f"{self.loss}% loss"] if self.loss else []))


class Shaper:
    """Applies :class:`Link` shapes to interfaces, with netem where the kernel has it and tbf
    plus nftables where it does not (it learns which at its first netem). It owns nothing: each
    call replaces what the interface or host had."""

    def __init__(self) -> None:
        self.netem: bool | None = None  # unknown until tried

    def shape(self, namespace: str, dev: str, link: Link) -> None:
        """Shape what ``dev`` in ``namespace`` sends as ``link``."""
        if (link.delay or link.loss) and self.netem is not False:
            args = ["limit", "100000"]  # a deep queue: netem's 1000 packets drop what TCP paces
            args += ["delay", link.delay] if link.delay else []
            args += ["rate", link.rate] if link.rate else []
            args += ["loss", f"{link.loss}%"] if link.loss else []
            done = _tc(namespace, "qdisc", "replace", "dev", dev, "root", "netem", *args)
            if done.returncode == 0:
                self.netem = True
                return
            if "unknown" not in done.stderr:
                raise ClusterError(f"tc netem on {dev} in {namespace}: {done.stderr.strip()}")
            self.netem = False
        if link.delay:
            raise ClusterError(
                f"a link delay ({link.delay}) needs tc's netem qdisc, which this kernel lacks "
                "(module sch_netem); shape rate and loss only, or use a kernel with sch_netem"
            )
        if link.rate:
            bits = link.bits_per_s or 0
            # a burst of 4 ms at the rate, at least 64 KiB (one segment of TCP's offload)
            burst = max(64 << 10, int(bits / 8 * 0.004))
            done = _tc(
                namespace,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                link.rate,
                "burst",
                str(burst),
                "latency",
                "100ms",
            )
            if done.returncode != 0:
                raise ClusterError(f"tc tbf on {dev} in {namespace}: {done.stderr.strip()}")
        else:
            _tc(namespace, "qdisc", "del", "dev", dev, "root")  # nothing there is fine

    def lose(self, namespace: str, loss: float | None) -> None:
        """Without netem: drop ``loss`` percent of what the host in ``namespace`` sends and of
        what it receives, at random (nftables); None or 0 drops nothing."""
        if self.netem:
            return  # netem drops them on the interfaces
        _nft(namespace, "delete", "table", "inet", LOSS_TABLE, check=False)
        if not loss:
            return
        per_10k = str(int(round(loss * 100)))
        _nft(namespace, "add", "table", "inet", LOSS_TABLE)
        for chain, hook in (("out", "output"), ("in", "input")):
            _nft(
                namespace,
                "add",
                "chain",
                "inet",
                LOSS_TABLE,
                chain,
                f"{{ type filter hook {hook} priority 0; }}",
            )
            _nft(
                namespace,
                "add",
                "rule",
                "inet",
                LOSS_TABLE,
                chain,
                "numgen",
                "random",
                "mod",
                "10000",
                "<",
                per_10k,
                "drop",
            )


def _tc(namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["tc", "-n", namespace, *args], capture_output=True, text=True, timeout=30
    )


def _nft(namespace: str, *args: str, check: bool = True) -> None:
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", namespace, "nft", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as e:
        raise ClusterError(f"nft: {e}") from e
    if check and done.returncode != 0:
        hint = " (apt-get install nftables)" if "No such file" in done.stderr else ""
        raise ClusterError(f"nft {' '.join(args)} in {namespace}: {done.stderr.strip()}{hint}")
