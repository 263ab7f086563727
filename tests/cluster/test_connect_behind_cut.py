"""First contact with a peer whose link is down, across the hosts of a cluster: loading the peer
must not hold the caller until the kernel gives up on a TCP connection (UCX's blocking connect:
3 s for an address nobody answers for, 38 s for a peer restarted behind a cut link). Loading it
returns while the link is still down, a put to it fails at its own deadline, and once the link
is back a put lands byte for byte. No time is asserted: with a blocking connect, loading the
peer fails (the kernel's error) while the link is down, which is what the test tells apart."""

from __future__ import annotations

import json

import pytest

from helpers.cluster_peers import start
from helpers.processes import PythonProcess
from transport.cluster import Cluster, Link

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(300)]

#: a peer named A that exposes 1 MiB for writes, prints its first word, then answers "read"
#: with a digest of what the region holds (and exits on end of input)
PEER = r"""
import hashlib, json, sys, torch, transport
t = transport.Transport("a", store=sys.argv[1], namespace="cut", timeout=10)
box = torch.zeros(1 << 20, dtype=torch.uint8)
t.expose("box", box, access="w")
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    print(json.dumps({"sha": hashlib.sha256(box.numpy().tobytes()).hexdigest()}), flush=True)
"""
#: the prober: "load" (load peer A afresh: what it raised, if anything) or "put" (write 1 MiB
#: of a pattern into A's box with a 5 s deadline: what it raised, and the pattern's digest)
PROBER = r"""
import hashlib, json, sys, torch, transport
t = transport.Transport("b", store=sys.argv[1], namespace="cut", timeout=10)
src = (torch.arange(1 << 20) % 251).to(torch.uint8)
t.register(src)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    err = ""
    try:
        if line.strip() == "load":
            t.core.peer("a", refresh=True)
        else:
            t.put(src, "a", "box", timeout=5).wait(30)
    except transport.TransportError as e:
        err = type(e).__name__
    sha = hashlib.sha256(src.numpy().tobytes()).hexdigest()
    print(json.dumps({"error": err, "sha": sha}), flush=True)
"""


def ask(proc: PythonProcess, line: str) -> dict:
    assert proc.proc.stdin is not None
    proc.proc.stdin.write(line + "\n")
    proc.proc.stdin.flush()
    return json.loads(proc.expect_line(120))


@pytest.mark.parametrize("known", [False, True], ids=["first contact", "restarted behind the cut"])
def test_a_peer_behind_a_cut_link_is_loaded_at_once_and_written_once_the_link_is_back(
    rights, known: bool
) -> None:
    with Cluster(1, Link.parse("1gbit")) as cluster:
        url = cluster.start_store("tcp")
        peer = start(cluster, cluster.trainer, PEER, url)
        assert json.loads(peer.expect_line(120)) == {"ready": True}
        prober = start(cluster, cluster.generator(0), PROBER, url)
        assert json.loads(prober.expect_line(120)) == {"ready": True}
        if known:  # it knew A, whose host is then cut off and A restarted (its record is new)
            assert ask(prober, "load")["error"] == ""
            peer.kill()
            peer = start(cluster, cluster.trainer, PEER, url)
            assert json.loads(peer.expect_line(120)) == {"ready": True}
        cluster.cut(cluster.trainer)
        assert ask(prober, "load")["error"] == ""  # a blocking connect fails here
        failed = ask(prober, "put")
        assert failed["error"] in ("TransferTimeout", "PeerLostError"), failed
        cluster.cut(cluster.trainer, cut=False)
        landed = ask(prober, "put")
        assert landed["error"] == "", landed
        assert ask(peer, "read")["sha"] == landed["sha"]
        prober.kill()
        peer.kill()
