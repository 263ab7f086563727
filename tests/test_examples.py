"""The examples run as a user runs them, each on its own embedded store."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.processes import REPO, free_port


def run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / script),
            "--store",
            f"tcp://127.0.0.1:{free_port()}",
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(300)
def test_quickstart():
    out = run("quickstart.py")
    assert (
        "every byte as sent: True" in out and "identical: True" in out and "quickstart: OK" in out
    )


@pytest.mark.timeout(300)
def test_push_weights_main_job():
    out = run(
        "push_weights.py", "--generators", "2", "--steps", "3", "--params", "2e6", "--tensors", "20"
    )
    assert "generators verified 6 of 6 updates, every byte; mismatches: 0" in out
    assert "push_weights: OK" in out


@pytest.mark.timeout(300)
def test_rl_loop_main_job():
    out = run("rl_loop.py", "--steps", "6", "--generators", "2")
    assert "rl_loop: OK" in out, out
    for name in ("gen-0", "gen-1"):
        line = next(
            line for line in out.splitlines() if line.startswith(f"{name}: ") and "samples" in line
        )
        assert "checksum mismatches 0" in line and "..6," in line, line


@pytest.mark.timeout(300)
def test_rl_loop_with_generators_relaying_along_a_chain():
    out = run("rl_loop.py", "--steps", "4", "--generators", "3", "--fanout", "chain")
    assert "rl_loop: OK" in out and "(chain)" in out, out
    for name in ("gen-0", "gen-1", "gen-2"):
        line = next(
            line for line in out.splitlines() if line.startswith(f"{name}: ") and "samples" in line
        )
        assert "checksum mismatches 0" in line and "..4," in line, line
    assert "excluded" not in out, out


def test_push_weights_rejects_bad_arguments():
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "push_weights.py"), "--generators", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "must be at least 1" in proc.stderr


def test_importing_nixl_leaves_logging_alone():
    code = (
        "import logging; import transport.backends.nixl as n; n.load_nixl(); "
        "print(logging.raiseExceptions, logging.getLogger('nixl').getEffectiveLevel() >= logging.WARNING)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr
