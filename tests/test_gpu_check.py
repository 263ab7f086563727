"""benchmarks/gpu_check.sh, the one call a lent GPU machine gets (with no network there): its dry
run on this machine, and the checks that stop it in seconds on a machine that cannot run it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_DEVICE = "this process has no CUDA device"


def probe_wheel(folder: Path, work: Path) -> str:
    """A wheel of a one-module distribution that nothing here has installed, built offline."""
    src = work / "probe-src"
    src.mkdir()
    (src / "transport_gpu_probe.py").write_text("MARK = 'carried'\n")
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "transport-gpu-probe"\nversion = "0.0.1"\n'
        '[tool.setuptools]\npy-modules = ["transport_gpu_probe"]\n'
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "-w",
            str(folder),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = folder.glob("*.whl")
    return wheel.name


def gpu_check(out: Path, wheels: Path, *args: str, python: str = sys.executable):
    env = {
        **os.environ,
        "OUT": str(out),
        "TRANSPORT_GPU_PYTHON": python,
        "TRANSPORT_GPU_WHEELS": str(wheels),
    }
    return subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_dry_run_installs_the_carried_wheels_and_the_gpu_tests_skip_with_their_reason(
    tmp_path: Path,
) -> None:
    wheels = tmp_path / "wheels"
    probe_wheel(wheels, tmp_path)
    out = tmp_path / "out"
    r = gpu_check(out, wheels, "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr

    found = json.loads((out / "versions.json").read_text())
    assert found["missing"] == []
    # the carried wheel was installed into a temporary folder, not into this environment ...
    version, _, where = found["versions"]["carried"]["transport_gpu_probe"].partition(" in ")
    assert version == "0.0.1"
    assert not where.startswith(sys.prefix) and not Path(where).exists()  # ... removed at the end
    with pytest.raises(ImportError):
        __import__("transport_gpu_probe")
    assert found["versions"]["transport"].endswith(f"from {ROOT / 'transport'}")

    log = (out / "gpu-tests.txt").read_text()
    skips = re.findall(r"^SKIPPED \[(\d+)\] (\S+?):\d+: (.*)$", log, re.M)
    assert skips, log
    for _, where, why in skips:
        assert where.endswith("_gpu.py") and NO_DEVICE in why, (where, why)
    summary = log.strip().splitlines()[-1]
    assert f"{sum(int(n) for n, _, _ in skips)} skipped" in summary, summary
    assert "failed" not in summary and "error" not in summary, summary

    lanes = json.loads((out / "lanes.json").read_text())
    assert lanes  # the lanes benchmark's command line still parses and runs
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8  # at most 8 files come back
    assert "tests exit 0" in (out / "summary.txt").read_text()


def test_without_a_cuda_device_the_check_fails_at_once_naming_the_way_out(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "benchmarks/gpu_env.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert re.search(r"^gpu_check: torch \S+", r.stdout, re.M)  # the versions come first
    assert "missing CUDA device" in r.stderr and "--dry-run" in r.stderr, r.stderr


def test_without_nixl_the_check_fails_naming_the_wheels_to_carry() -> None:
    hide = (
        "import runpy, sys; sys.modules.update(nixl=None, nixl_cu13=None);"
        "sys.argv = ['gpu_env.py', '--dry-run']; runpy.run_path('benchmarks/gpu_env.py', run_name='__main__')"
    )
    r = subprocess.run(
        [sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2
    assert "missing nixl" in r.stderr and "gpu_wheels.sh" in r.stderr, r.stderr


def test_a_missing_python_stops_the_check_before_anything_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = gpu_check(out, tmp_path, python=str(tmp_path / "no-such-python"))
    assert r.returncode == 2
    assert "TRANSPORT_GPU_PYTHON" in r.stdout
    assert not (out / "gpu-tests.txt").exists()
