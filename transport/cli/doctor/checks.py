"""The doctor's checks of this machine: versions, the settings the library runs with, devices,
the store, the loopback probe's routes and figures, and a named peer; each problem becomes a
:class:`~transport.cli.doctor.report.Finding` with the setting or package that fixes it."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.metadata
import os
import platform
import site
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from transport.backends import cma
from transport.backends.nixl import PROGRESS_ENV, SHARED_MEMORY_TLS, progress_mode
from transport.cli.doctor.report import Loopback, NameLookups, Report, StoreCheck
from transport.doorbell import BELL_IP_ENV, bell_ip
from transport.store.base import Store, redact_url
from transport.store.tcp_url import parse_tcp_url

#: the environment that decides which paths a put takes (set by the user or by the library)
SETTINGS = (
    "UCX_TLS",
    "UCX_NET_DEVICES",
    "UCX_MODULES",
    "UCX_TCP_CONN_NB",
    "UCX_MEM_MMAP_HOOK_MODE",
    PROGRESS_ENV,
    BELL_IP_ENV,
    "TRANSPORT_STORE",
    "TRANSPORT_LANES",
    cma.CMA_ENV,
)
#: a store slower than this per call is worth a warning (a first put to a peer reads it)
SLOW_STORE_US = 2000.0
#: reverse lookups asked in a row, as dozens of peers connecting to the embedded store at a
#: job's start ask them (each connection asks two)
LOOKUP_BURST = 64
#: a reverse lookup slower than this holds up a connection to the embedded store noticeably
SLOW_LOOKUP_MS = 100.0
#: a same-host put slower than this share of an in-process copy is worth a warning
LOW_LOOPBACK_SHARE = 0.25


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _ucx_version() -> str | None:
    """The version of the UCX that NIXL's wheel ships (``ucp_get_version_string``)."""
    for dist in ("nixl_cu13", "nixl_cu12", "nixl"):
        for root in map(Path, site.getsitepackages()):
            for lib in glob.glob(str(root / f"{dist}.libs" / "libucp*.so*")):
                try:
                    fn = ctypes.CDLL(lib).ucp_get_version_string
                    fn.restype = ctypes.c_char_p
                    return str(fn().decode())
                except (OSError, AttributeError):
                    continue
    return None


def versions(report: Report) -> None:
    """Versions of the library and what it runs on; a NIXL that does not load is a failure."""
    import numpy
    import torch

    import transport

    v = report.versions
    v["transport"] = transport.__version__
    v["python"] = platform.python_version()
    cuda = torch.version.cuda
    v["torch"] = f"{torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU'} build)"
    v["numpy"] = numpy.__version__
    v["nixl"] = _dist_version("nixl-cu13", "nixl-cu12", "nixl") or "not installed"
    try:
        from transport.backends.nixl import load_nixl

        api, b = load_nixl()
        cfg = b.nixlAgentConfig()
        cfg.useProgThread = False
        plugins = sorted(b.nixlAgent("transport-doctor", cfg).getAvailPlugins())
        v["nixl plugins"] = ", ".join(plugins)
        if "UCX" not in plugins:
            report.add(
                "fail", "nixl", "NIXL has no UCX plugin", "reinstall nixl-cu13 (or nixl-cu12)"
            )
    except Exception as e:  # any way NIXL fails to load is the finding itself
        v["nixl plugins"] = "none"
        report.add(
            "fail",
            "nixl",
            f"NIXL does not load: {type(e).__name__}: {e}",
            "pip install nixl-cu13 (CUDA 13 wheels; nixl-cu12 for CUDA 12)",
        )
    v["ucx"] = _ucx_version() or "unknown"
    if cuda and not torch.cuda.is_available():
        report.add(
            "note",
            "torch",
            "torch's CUDA build on a host without a usable GPU: host transfers run as with the "
            "CPU build (same bandwidth measured, benchmarks/README.md)",
        )


def settings(report: Report, store_url: str) -> None:
    """The environment the library runs with, the progress mode and why, and the doorbell's
    address; contradictory settings are findings."""
    for key in SETTINGS:
        report.settings[key] = os.environ.get(key, "(unset)")
    tls = os.environ.get("UCX_TLS", "")
    names = {x.strip().lower() for x in tls.lstrip("^").split(",") if x.strip()}
    try:
        report.progress = progress_mode(None)
    except ValueError as e:
        report.progress = "invalid"
        report.add("fail", "progress", str(e), f"unset ${PROGRESS_ENV} or give a valid mode")
    if report.progress == "events":
        report.progress += (
            ": NIXL's progress thread sleeps on UCX's events and lands incoming bytes"
        )
        if names & SHARED_MEMORY_TLS and not tls.startswith("^"):
            report.add(
                "warn",
                "progress",
                "NIXL's progress thread is on while UCX may use shared memory: it halves the "
                "bandwidth of large puts between processes of this host",
                f"unset ${PROGRESS_ENV} (auto turns it on only where UCX is kept to networks)",
            )
    elif report.progress == "poll":
        report.progress += ": incoming bytes land while the engine polls (peers ring it awake)"
    if tls and not tls.startswith("^") and "tcp" not in names and "all" not in names:
        report.add(
            "warn",
            "ucx",
            f"UCX_TLS={tls} leaves out tcp: UCX then has no handler for a peer that fails, and "
            "a killed peer can hang transfers to it",
            "add tcp to UCX_TLS",
        )
    try:
        ip = bell_ip(store_url)
        with socket.socket(
            socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM
        ) as s:
            s.bind((ip, 0))
        report.devices["doorbell"] = [ip]
    except (OSError, ValueError) as e:
        report.devices["doorbell"] = []
        report.add(
            "fail",
            "doorbell",
            f"the doorbell cannot listen: {e}",
            f"set ${BELL_IP_ENV} to an address of this host that its peers reach",
        )


def devices(report: Report) -> None:
    """GPUs, RDMA devices and network interfaces, and what their absence means."""
    import torch

    gpus = []
    try:
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a CUDA build with no driver raises here on some versions
        gpus = []
    report.devices["gpus"] = gpus
    rdma = (
        sorted(os.listdir("/sys/class/infiniband"))
        if os.path.isdir("/sys/class/infiniband")
        else []
    )
    report.devices["rdma"] = rdma
    report.devices["network"] = [name for _, name in socket.if_nameindex()]
    if not rdma:
        report.add(
            "note",
            "network",
            "no RDMA device: peers on other hosts are reached over TCP",
            "for RDMA, a host with an RDMA NIC and rdma-core (libibverbs) installed",
        )
    if not gpus:
        report.add("note", "gpu", "no GPU: the GPU paths (CUDA IPC, GPUDirect RDMA) are not probed")


def store(report: Report, handle: Store, opened_s: float) -> None:
    """The store's round trip; a slow one is a finding."""
    key = f"transport/doctor/{os.getpid()}"
    times = []
    for i in range(20):
        t0 = time.perf_counter()
        handle.set(key, str(i).encode())
        handle.get(key)
        times.append(time.perf_counter() - t0)
    handle.delete(key)
    check = StoreCheck(redact_url(handle.url), opened_s * 1e3, statistics.median(times) * 1e6)
    report.store = check
    if check.round_trip_us > SLOW_STORE_US:
        report.add(
            "warn",
            "store",
            f"a set and a get take {check.round_trip_us / 1e3:.1f} ms: every first put to a peer "
            "and every join reads the store",
            "a store near the peers (Redis on the trainer's host), or a less loaded one",
        )


def name_lookups(
    report: Report,
    store_url: str,
    lookup: Callable[[tuple[str, int, int, int], int], object] = socket.getnameinfo,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """For the embedded store: the reverse lookups its connections wait for (NameLookups,
    each made by ``lookup`` and timed by ``clock``); a slow one is a finding."""
    if not store_url.startswith("tcp://"):
        return
    host, port, _, _ = parse_tcp_url(store_url)
    try:
        address = f"::ffff:{socket.gethostbyname(host)}"
    except OSError:
        return  # the store check names an unreachable host
    times = []
    for _ in range(LOOKUP_BURST):
        t0 = clock()
        with contextlib.suppress(OSError):  # unresolved: torch logs the number instead
            lookup((address, port, 0, 0), 0)
        times.append(clock() - t0)
    lookups = NameLookups(address, LOOKUP_BURST, statistics.median(times) * 1e3, max(times) * 1e3)
    report.lookups = lookups
    if lookups.slowest_ms > SLOW_LOOKUP_MS:
        report.add(
            "warn",
            "store",
            f"a reverse lookup of {address} took {lookups.slowest_ms / 1e3:.1f} s (of "
            f"{LOOKUP_BURST} in a row): torch's TCPStore makes one at both ends of each "
            "connection to the embedded store, and the connection waits for it",
            f"list {address} in /etc/hosts, or make the resolver give up sooner "
            "(RES_OPTIONS=timeout:1), or use a Redis store (redis://HOST:PORT)",
        )


def cross_memory(report: Report, header: bytes) -> None:
    """Whether host puts and gets with the processes of this host take the library's
    cross-memory attach (backends/cma.py): this process's settings, then the proof of the probe
    reader's identity (``header``), as a writer's backend makes it."""
    why = cma.refusal()
    if why is None:
        peers = cma.CmaPeers()
        try:
            ident, _ = cma.Identity.split(header)
            proven = ident is not None and peers.add("probe-reader", ident)
        finally:
            peers.close()
        if proven:
            report.add(
                "note",
                "cma",
                "host puts and gets with processes of this host take cross-memory attach (the "
                "library's: one system call each; a notified one also sends one byte through "
                "NIXL with its notification)",
            )
            return
        why = "the kernel refused it between two processes of this host (ptrace rules)"
    fix = {
        True: f"unset {cma.CMA_ENV}",
        False: "kernel.yama.ptrace_scope=0, or the processes in one container; unset UCX_TLS if "
        "it leaves out cma; reinstall with a C compiler if transport._cma was not built",
    }[why.startswith("$" + cma.CMA_ENV)]
    report.add("warn", "cma", f"host puts with processes of this host go through NIXL: {why}", fix)


def loopback(report: Report, result: Loopback) -> None:
    """Findings on the probe's routes and figures."""
    report.loopback = result
    for route in report.routes:
        tcp = [t for t in route.transports if t.startswith("tcp/")]
        if route.operation == "put" and tcp:
            report.add(
                "warn",
                "routes",
                "puts between processes of this host go over TCP, not CMA (one copy by the "
                "kernel): CMA needs ptrace permission between them",
                "kernel.yama.ptrace_scope=0, or the processes in one container; unset UCX_TLS "
                "if it leaves out cma",
            )
        if route.operation == "notification" and tcp:
            report.add(
                "note",
                "routes",
                f"notifications between processes of this host go over {tcp[0]} (UCX's choice "
                "for active messages)",
            )
    share = result.put_64m_gbps / result.memcpy_64m_gbps
    if share < LOW_LOOPBACK_SHARE:
        report.add(
            "warn",
            "loopback",
            f"a 64 MiB put between processes of this host reaches {share:.2f}x an in-process copy",
            "check the routes above; a host with CPUs to spare (lanes post from threads of "
            "their own: $TRANSPORT_LANES)",
        )
