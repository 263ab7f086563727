"""Reordering and duplication on a cluster's links (transport/cluster/links.py), both ways.

Numbered UDP datagrams go from one generator host to the other, across the link of the first
(what it sends, shaped on its end) or to it (what it receives, shaped on the switch's end), and
the receiver counts what came: duplicates (a number seen again) and datagrams that arrive late
(after one with a higher number). The receiver stops once it has every number, so nothing here
waits for a time to pass. Once the link is shaped plainly again, nothing is duplicated and no
share is held back (the kernel itself may still put one in a thousand late); and a TCP
stream across links that reorder, duplicate and lose packets arrives byte for byte.

Without netem a packet held back waits behind a 10 Mbit/s lane; with netem, reordering is
netem's own (links.py), and the same counts hold. How each is made, netem or not, is checked
with tc and nft stood in for, on any kernel."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
from collections.abc import Iterator

import pytest

from helpers.processes import LineReader
from transport.cluster import Cluster, Host, Link, links

#: datagrams a run sends. Each is held back (or duplicated) with probability 1/5 at 20%, on its
#: own: the chance that none of 2,000 is is 0.8**2000, about 1e-194. A held one is overtaken by
#: the next the sender sends while it waits (0.1 ms or more behind the slow lane; Python sends
#: one every few tens of microseconds): that none of some 400 held is overtaken is as remote.
DATAGRAMS = 2000
#: a stream's bytes
STREAM = 4 << 20
#: a receiver's patience with a silent socket: against hangs, never a claim about speed
SILENCE = 60.0

#: binds UDP ``port``, prints "ready", then counts numbered datagrams until it has each of 0 ..
#: n-1 (or the socket is silent for SILENCE): one JSON line
_COUNT = r"""
import json, socket, struct, sys
port, n, silence = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 16 << 20)  # no overflow
s.bind(("0.0.0.0", port))
s.settimeout(silence)
print("ready", flush=True)
seen, got, late, top, missing = bytearray(n), 0, 0, -1, n
try:
    while missing:
        (number,) = struct.unpack("!I", s.recv(2048)[:4])
        got += 1
        late += number < top
        top = max(top, number)
        missing -= not seen[number]
        seen[number] = 1
except TimeoutError:
    pass
print(json.dumps({"got": got, "late": late, "missing": missing}), flush=True)
"""
#: sends datagrams numbered 0 .. n-1 to (address, port), 100 bytes of padding each
_SEND = r"""
import socket, struct, sys
address, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(n):
    s.sendto(struct.pack("!I", i) + bytes(100), (address, port))
"""
#: listens on TCP ``port``, prints "ready", reads one connection to its end: its length and
#: SHA-256 as one JSON line
_SINK = r"""
import hashlib, json, socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
conn, _ = server.accept()
digest, size = hashlib.sha256(), 0
while chunk := conn.recv(1 << 20):
    digest.update(chunk)
    size += len(chunk)
print(json.dumps({"bytes": size, "sha256": digest.hexdigest()}), flush=True)
"""
#: streams ``size`` random bytes to (address, port) and closes: their length and SHA-256
_STREAM = r"""
import hashlib, json, os, socket, sys
data = os.urandom(int(sys.argv[3]))
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=120) as conn:
    conn.sendall(data)
print(json.dumps({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}), flush=True)
"""
PORT = 5301

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def two_generators(rights: None) -> Iterator[Cluster]:
    """A cluster whose two generator hosts are on 1 Gbit/s links."""
    with Cluster(2, Link("1gbit")) as cluster:
        yield cluster


def datagrams(cluster: Cluster, sender: Host, receiver: Host) -> dict[str, int]:
    """Send DATAGRAMS numbered datagrams from ``sender`` to ``receiver``: what arrived."""
    counter = Child(cluster, receiver, _COUNT, str(PORT), str(DATAGRAMS), str(SILENCE))
    assert counter.line() == "ready"
    Child(cluster, sender, _SEND, receiver.address, str(PORT), str(DATAGRAMS)).end()
    counts: dict[str, int] = json.loads(counter.line(2 * SILENCE))
    return counts


#: what a plain link may still put out of order: the kernel hands a veth's packets to the backlog
#: of whichever CPU dequeues them (the sender's, or the rate limiter's timer on another), so on a
#: loaded host one in a few thousand came late once (tests/run.sh, 2026-12-06) on a link that
#: holds nothing back; a link shaped to reorder 20% puts about 400 of 2,000 late
PLAIN_LATE = DATAGRAMS // 100


def plain(counts: dict[str, int]) -> None:
    """Every datagram arrived once, and no share was held back."""
    assert counts["got"] == DATAGRAMS and counts["missing"] == 0, counts
    assert counts["late"] <= PLAIN_LATE, counts


@pytest.mark.hosts
def test_a_duplicating_link_sends_a_share_twice_both_ways_until_shaped_plainly(two_generators):
    cluster = two_generators
    gen0, gen1 = cluster.generator(0), cluster.generator(1)
    cluster.shape(gen0, Link("1gbit", duplicate=20))
    for way, (sender, receiver) in {"sent": (gen0, gen1), "received": (gen1, gen0)}.items():
        counts = datagrams(cluster, sender, receiver)
        print(f"\n{DATAGRAMS} datagrams {way} by gen0, 20% duplicated: {counts}")
        assert counts["missing"] == 0, counts  # every number, at least once
        assert counts["got"] > DATAGRAMS, counts
    cluster.shape(gen0, Link("1gbit"))
    for sender, receiver in ((gen0, gen1), (gen1, gen0)):
        plain(datagrams(cluster, sender, receiver))


@pytest.mark.hosts
def test_a_reordering_link_holds_a_share_back_both_ways_until_shaped_plainly(two_generators):
    cluster = two_generators
    gen0, gen1 = cluster.generator(0), cluster.generator(1)
    cluster.shape(gen0, Link("1gbit", reorder=20))
    for way, (sender, receiver) in {"sent": (gen0, gen1), "received": (gen1, gen0)}.items():
        counts = datagrams(cluster, sender, receiver)
        print(f"\n{DATAGRAMS} datagrams {way} by gen0, 20% reordered: {counts}")
        assert counts["late"] > 0, counts
        assert counts["missing"] == 0 and counts["got"] == DATAGRAMS, counts  # none lost
    cluster.shape(gen0, Link("1gbit"))
    for sender, receiver in ((gen0, gen1), (gen1, gen0)):
        plain(datagrams(cluster, sender, receiver))


@pytest.mark.hosts
def test_a_tcp_stream_arrives_whole_across_links_that_reorder_duplicate_and_lose(
    two_generators,
):
    cluster = two_generators
    gen0, gen1 = cluster.generator(0), cluster.generator(1)
    for host in (gen0, gen1):
        cluster.shape(host, Link("1gbit", loss=1, reorder=20, duplicate=20))
    before = {h.role: _tcp_counters(h) for h in (gen0, gen1)}
    sink = Child(cluster, gen1, _SINK, str(PORT))
    assert sink.line() == "ready"
    stream = Child(cluster, gen0, _STREAM, gen1.address, str(PORT), str(STREAM))
    sent = json.loads(stream.line(240))
    assert json.loads(sink.line()) == sent  # byte for byte
    after = {h.role: _tcp_counters(h) for h in (gen0, gen1)}
    # what the links did to it, as the two ends' TCP counted: segments sent again (lost, or
    # taken for lost while held back), held-back ones seen overtaken, duplicates received
    seen = {
        "retransmitted": after["gen0"]["RetransSegs"] - before["gen0"]["RetransSegs"],
        "reordering seen": after["gen0"]["TCPSACKReorder"] - before["gen0"]["TCPSACKReorder"],
        "duplicates received": sum(
            after["gen1"][k] - before["gen1"][k] for k in ("TCPDSACKOldSent", "TCPDSACKOfoSent")
        ),
    }
    print(f"\n{STREAM >> 20} MiB over links with 1% loss, 20% reordered, 20% duplicated: {seen}")
    assert sum(seen.values()) > 0, seen  # the links were in the stream's way


class Child:
    """``python -c code args...`` in ``host`` (the cluster kills it at its close), its output
    read line by line."""

    def __init__(self, cluster: Cluster, host: Host, code: str, *args: str) -> None:
        argv = [sys.executable, "-c", code, *args]
        self.proc = cluster.start(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out, self.err = LineReader(self.proc.stdout), LineReader(self.proc.stderr)

    def line(self, timeout: float = SILENCE) -> str:
        """Its next line; fails with its errors if it ends or is silent past ``timeout``
        (against hangs, never a claim about speed)."""
        try:
            line = self.out.next_line(timeout)
        except queue.Empty:
            raise AssertionError(f"silent for {timeout} s: {''.join(self.err.seen)}") from None
        assert line is not None, f"it ended ({self.proc.wait(10)}): {''.join(self.err.seen)}"
        return line

    def end(self, timeout: float = SILENCE) -> None:
        """Wait for it to end, and succeed."""
        assert self.proc.wait(timeout) == 0, "".join(self.err.seen)


def _tcp_counters(host: Host) -> dict[str, int]:
    """The TCP counters of ``host``'s network namespace (/proc/net/snmp and netstat: header
    lines and value lines in pairs)."""
    out = subprocess.run(
        host.command(["cat", "/proc/net/snmp", "/proc/net/netstat"]),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.splitlines()
    counters: dict[str, int] = {}
    for names, values in zip(out[::2], out[1::2], strict=True):
        if names.split(":")[0] in ("Tcp", "TcpExt"):
            counters.update(zip(names.split()[1:], map(int, values.split()[1:]), strict=True))
    return counters


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, link",
    [
        ("2gbit", Link("2gbit")),
        ("2gbit,100us,5%", Link("2gbit", "100us", 5.0)),
        ("1gbit,,1%,20%,5%", Link("1gbit", None, 1.0, 20.0, 5.0)),
        ("1gbit,,,20", Link("1gbit", reorder=20.0)),
        (" 1gbit , , , , 2.5 ", Link("1gbit", duplicate=2.5)),
        (",,,,", Link()),
    ],
)
def test_a_link_parses_rate_delay_loss_reorder_and_duplicate(text: str, link: Link) -> None:
    assert Link.parse(text) == link


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, says",
    [
        ("1gbit,,1,2,3,4", "a link is RATE[,DELAY[,LOSS%[,REORDER%[,DUP%]]]], got"),
        ("1gbit,,,x%", "its reorder 'x%' is not a percentage"),
        ("1gbit,,,,²", "its duplicate '²' is not a percentage"),  # str.isdigit's digits: no
        ("1gbit,,,,-1", "its duplicate '-1' is not a percentage"),
        (
            "1gbit,,,100",
            "link reorder must be a percentage, at least 0 and under 100; got 100.0",
        ),
        (
            "1gbit,,,,150%",
            "link duplicate must be a percentage, at least 0 and under 100; got 150.0",
        ),
        ("1gbit,,5,,nan", "its duplicate 'nan' is not a percentage"),
    ],
)
def test_a_link_that_does_not_parse_says_which_part_and_the_format(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="RATE\\[,DELAY") as e:
        Link.parse(text)
    assert says in str(e.value)


@pytest.mark.unit
def test_a_link_shows_its_reordering_and_duplication() -> None:
    assert str(Link("1gbit", None, 1.0, 20.0, 2.5)) == (
        "1gbit, no delay, 1% loss, 20% reordered, 2.5% duplicated"
    )
    assert str(Link("1gbit")) == "1gbit, no delay"
    for bad in (float("nan"), 100.0, -0.5):
        with pytest.raises(ValueError, match="link duplicate must be a percentage"):
            Link(duplicate=bad)


@pytest.mark.unit
def test_with_netem_reordering_and_duplication_are_netems_own_with_a_delay_to_reorder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the kernel has netem (tc is stood in for, on any kernel): one netem qdisc does all,
    with 1 ms of delay when the link has none (netem reorders only delayed packets), and no
    nftables rule is made."""
    ran: list[tuple[str, ...]] = []

    def tc(namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
        ran.append(args)
        return subprocess.CompletedProcess(["tc", *args], 0, "", "")

    def nft(namespace: str, script: str) -> None:
        raise AssertionError(f"nft {script} with netem")

    monkeypatch.setattr(links, "_tc", tc)
    monkeypatch.setattr(links, "_nft", nft)
    shaper = links.Shaper()
    for link in (
        Link("1gbit", None, 1.0, 20.0, 5.0),
        Link(None, "2ms", reorder=20.0),
        Link(duplicate=5.0),
    ):
        shaper.shape("ns", "eth0", link)
        shaper.lose("ns", link.loss)
    netem = "qdisc replace dev eth0 root netem limit 100000"
    assert [" ".join(args) for args in ran] == [
        f"{netem} delay 1ms rate 1gbit loss 1.0% reorder 20.0% duplicate 5.0%",
        f"{netem} delay 2ms reorder 20.0%",
        f"{netem} duplicate 5.0%",
    ]


@pytest.mark.unit
def test_without_netem_a_hold_lane_and_nftables_rules_do_it_and_go_with_a_plain_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where tc knows no netem (tc and nft are stood in for): htb carries the rate and the slow
    lane, nftables rules on the interface's egress pick what is held back and what is sent
    twice; a plain shape puts tbf back and removes the rules."""
    ran: list[str] = []

    def tc(namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
        ran.append(" ".join(args))
        unknown = "netem" in args
        return subprocess.CompletedProcess(args, 2 if unknown else 0, "", "qdisc kind is unknown")

    monkeypatch.setattr(links, "_tc", tc)
    monkeypatch.setattr(links, "_nft", lambda namespace, script: ran.append(script))
    shaper = links.Shaper()
    shaper.shape("ns", "eth0", Link("1gbit", reorder=20.0, duplicate=5.0))
    assert shaper.netem is False
    assert ran[1].startswith("qdisc replace dev eth0 root handle 1: htb default 10")
    assert ran[2].startswith("class replace dev eth0 parent 1: classid 1:10 htb rate 1gbit")
    assert f"classid 1:20 htb rate {links.HOLD_RATE}" in ran[3]
    assert ran[4].endswith(
        f'numgen random mod 10000 < 2000 limit rate {links.HOLD_BUDGET} meta priority set "1:20"'
    )
    assert ran[5].endswith(f'mod 10000 < 500 meta mark set {links.DUPLICATED} dup to "eth0"')
    del ran[:]
    shaper.shape("ns", "eth0", Link("1gbit"))
    assert ran[0].startswith("qdisc replace dev eth0 root tbf rate 1gbit")
    assert [s.split("; ")[-1] for s in ran[1:]] == [
        f"delete chain netdev {links.REORDER_TABLE} eth0",
        f"delete chain netdev {links.DUPLICATE_TABLE} eth0",
    ]
