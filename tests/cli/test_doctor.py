"""``transport doctor`` against a real store, real NIXL agents in two processes of its own, and a
real peer; settings that cannot work are failures naming their fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import transport
from helpers.processes import REPO
from transport.backends import cma
from transport.cli.doctor import checks
from transport.cli.doctor.report import Report
from transport.cli.doctor.routes import parse_routes
from transport.peers.directory import Directory


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "transport.cli", "doctor", "--json", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def findings(out: subprocess.CompletedProcess[str]) -> dict[str, list[dict[str, str]]]:
    by: dict[str, list[dict[str, str]]] = {}
    for f in json.loads(out.stdout)["findings"]:
        by.setdefault(f["level"], []).append(f)
    return by


def test_the_doctor_reports_versions_routes_and_a_loopback_put(tcp_store):
    out = doctor("--store", tcp_store.url)
    assert out.returncode == 0, out.stderr + out.stdout
    report = json.loads(out.stdout)
    assert report["versions"]["nixl"].startswith("nixl")
    assert report["versions"]["ucx"][0].isdigit()
    assert "UCX" in report["versions"]["nixl plugins"]
    routes = {r["operation"]: r["transports"] for r in report["routes"]}
    # UCX's routes: a get goes by cross-memory attach where the library takes it (no UCX route)
    assert routes.get("put") and routes.get("notification"), routes
    assert routes.get("get") or cma.refusal() is None, routes
    lb = report["loopback"]
    assert lb["put_4k_us"] > 0 and lb["put_64m_gbps"] > 0 and lb["memcpy_64m_gbps"] > 0
    assert report["store"]["round_trip_us"] > 0
    lookups = report["lookups"]  # what torch's TCPStore looks up at each end of a connection
    assert lookups["address"] == "::ffff:127.0.0.1" and lookups["burst"] == checks.LOOKUP_BURST
    assert 0 < lookups["median_ms"] <= lookups["slowest_ms"]
    assert "fail" not in findings(out)


def test_a_reverse_lookup_the_resolver_lost_is_a_warning_naming_its_fixes():
    """The resolver drops the 51st query of a burst, and glibc asks again 5 s later (as the test
    machines' resolver does): a warning with the fixes; lookups that all answer at once are
    none. A clock that the lookups move stands for the time they take."""
    now = [0.0]
    asked: list[tuple[str, int, int, int]] = []

    def lookup(sockaddr: tuple[str, int, int, int], flags: int) -> tuple[str, str]:
        asked.append(sockaddr)
        now[0] += 5.0 if len(asked) == 51 else 0.0002
        return sockaddr[0], str(sockaddr[1])

    report = Report(versions={}, settings={}, progress="", devices={})
    checks.name_lookups(report, "tcp://127.0.0.1:29500", lookup, lambda: now[0])
    assert set(asked) == {("::ffff:127.0.0.1", 29500, 0, 0)}
    assert len(asked) == checks.LOOKUP_BURST
    assert report.lookups is not None and round(report.lookups.slowest_ms) == 5000
    (warn,) = report.findings
    assert warn.level == "warn" and "::ffff:127.0.0.1" in warn.what and "5.0 s" in warn.what
    assert "/etc/hosts" in warn.fix and "RES_OPTIONS=timeout:1" in warn.fix
    quick = Report(versions={}, settings={}, progress="", devices={})
    asked.clear()
    checks.name_lookups(quick, "tcp://127.0.0.1:29500", lambda a, f: asked.append(a), lambda: 0.0)
    assert quick.findings == [] and len(asked) == checks.LOOKUP_BURST
    redis = Report(versions={}, settings={}, progress="", devices={})
    checks.name_lookups(redis, "redis://127.0.0.1:6379/0", lookup, lambda: now[0])
    assert redis.lookups is None  # Redis's clients look nothing up


def test_the_doctor_proves_cross_memory_attach_between_two_processes_or_says_why_not(tcp_store):
    out = doctor("--store", tcp_store.url)
    assert out.returncode == 0, out.stderr + out.stdout
    mine = [f for fs in findings(out).values() for f in fs if f["topic"] == "cma"]
    if cma.refusal() is None:  # this machine allows it: the probe's reader was proven
        assert [f["level"] for f in mine] == ["note"] and "cross-memory attach" in mine[0]["what"]
    off = doctor("--store", tcp_store.url, **{cma.CMA_ENV: "0"})
    (warn,) = [f for f in findings(off)["warn"] if f["topic"] == "cma"]
    assert "through NIXL" in warn["what"] and warn["fix"] == f"unset {cma.CMA_ENV}"


def test_settings_that_cannot_work_fail_and_name_their_fix(tcp_store):
    out = doctor("--store", tcp_store.url, "--no-probe", TRANSPORT_PROGRESS="sometimes")
    assert out.returncode == 1
    (fail,) = findings(out)["fail"]
    assert fail["topic"] == "progress" and "TRANSPORT_PROGRESS" in fail["fix"]
    out = doctor("--store", tcp_store.url, "--no-probe", TRANSPORT_BELL_IP="192.0.2.1")
    assert out.returncode == 1
    (fail,) = findings(out)["fail"]
    assert fail["topic"] == "doorbell" and "TRANSPORT_BELL_IP" in fail["fix"]
    out = doctor("--store", tcp_store.url, "--no-probe", UCX_TLS="cma,sm")
    assert out.returncode == 0
    assert any("add tcp to UCX_TLS" in f["fix"] for f in findings(out)["warn"])


def test_a_named_peer_is_described_and_a_missing_one_fails(tcp_store):
    with transport.Transport("gen-0", store=tcp_store, namespace="job") as g:
        g.expose("x", torch.zeros(16))
        out = doctor(
            "--store", tcp_store.url, "--no-probe", "--namespace", "job", "--peer", "gen-0"
        )
        assert out.returncode == 0, out.stdout
        peer = json.loads(out.stdout)["peer"]
        rec = Directory(tcp_store, "job", None).fetch("gen-0")
        assert rec is not None and rec.bell is not None
        assert peer["name"] == f"gen-0#{g.generation}" and peer["regions"] == 1
        assert peer["doorbell"] == f"{rec.bell.ip}:{rec.bell.port}"
        out = doctor(
            "--store", tcp_store.url, "--no-probe", "--namespace", "job", "--peer", "ghost"
        )
        assert out.returncode == 1
        assert any("ghost" in f["what"] for f in findings(out)["fail"])


SAMPLE = """
[1] [h:1:0]   | w#1 self cfg#0                                   |
[1] [h:1:0]   | remote memory write by ucp_put* from host memory to host |
[1] [h:1:0]   | Range  | Description | Config                  |
[1] [h:1:0]   | 0..inf | zero-copy   | self/memory             |
[1] [h:1:0]   | w#1 inter-node cfg#1                             |
[1] [h:1:0]   | remote memory write by ucp_put* from host memory to host |
[1] [h:1:0]   | Range  | Description | Config                  |
[1] [h:1:0]   | 0..8K  | short       | rc_mlx5/mlx5_0:1        |
[1] [h:1:0]   | 8K..inf| zero-copy   | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
[1] [h:1:0]   | remote memory read by ucp_get*(multi) into cuda memory from cuda |
[1] [h:1:0]   | Range  | Description | Config                  |
[1] [h:1:0]   | 0..inf | zero-copy   | cuda_ipc/cuda           |
"""


def test_routes_are_read_from_ucx_tables():
    """The ``self`` tables are a process with itself and are left out; rails and GPU memory are
    read as UCX prints them."""
    routes = {r.operation: r.transports for r in parse_routes(SAMPLE, "x")}
    assert routes == {
        "put": ("rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"),
        "get (cuda memory)": ("cuda_ipc/cuda",),
    }
