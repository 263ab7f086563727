"""The wheel a user installs (``pip install .``, not the editable install the suite runs on)
holds every module of the tree: a package that setuptools does not find (pyproject.toml finds
them; transport/backends and transport/csrc are links to backends/ and csrc/) fails here, not in
a user's ``transport cluster up``. Installed into a fresh virtual environment (its dependencies, torch and
NIXL, borrowed from this one; no source tree on its path), its command runs, every integration
imports, and a put crosses from one process to another with its bytes verified."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tracked_modules() -> set[str]:
    """Every Python file git tracks in the package's two trees, as its path in the wheel."""
    out = subprocess.run(
        ["git", "ls-files", "transport", "backends"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    found = set()
    for rel in out:
        if not rel.endswith(".py"):
            continue
        top, _, rest = rel.partition("/")
        found.add(f"transport/backends/{rest}" if top == "backends" else rel)
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the files git tracks (what a clone holds), once for this module."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (its tracked files are the tree)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    for rel in files:
        if (ROOT / rel).is_symlink():  # transport/backends, transport/csrc: links, as in a clone
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(ROOT / rel), src / rel)
        elif (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp / "wheel"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    (built,) = out.glob("transport-*.whl")
    return built


@pytest.mark.timeout(600)
def test_the_built_wheel_holds_every_module_of_the_tree(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if n.endswith(".py")}
    assert tracked_modules() - held == set()
    assert "transport/py.typed" in zipfile.ZipFile(wheel).namelist()


INTEGRATIONS = (
    "transport.integrations.vllm",
    "transport.integrations.vllm.server",
    "transport.integrations.verl",
    "transport.integrations.torch_api",
    "transport.cuda",
    "transport.cluster",
)


@pytest.mark.timeout(600)
def test_the_wheel_installed_in_a_fresh_environment_runs_its_command_and_a_put(
    wheel: Path, tmp_path: Path
):
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # torch, NIXL and the rest from this environment: a path line, so that this environment's
    # own .pth files (the editable install of the source tree among them) are not read
    Path(site, "borrowed.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr[-4000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    run = tmp_path / "elsewhere"  # no source tree here
    run.mkdir()

    def ok(*cmd: str | Path) -> str:
        done = subprocess.run(
            [str(c) for c in cmd], cwd=run, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (cmd, done.stdout[-2000:], done.stderr[-4000:])
        return done.stdout

    where = ok(python, "-c", "import transport; print(transport.__file__)").strip()
    assert where.startswith(site), where  # the installed wheel, not the source tree
    assert "usage: transport cluster" in ok(env_dir / "bin" / "transport", "cluster", "--help")
    assert "usage: transport bench put" in ok(
        env_dir / "bin" / "transport", "bench", "put", "--help"
    )
    ok(python, "-c", "; ".join(f"import {m}" for m in INTEGRATIONS))
    out = ok(
        env_dir / "bin" / "transport",
        "bench",
        "put",
        "--sizes",
        "4K",
        "--batch",
        "none",
        "--op",
        "write",
        "--baselines",
        "none",
        "--budget",
        "0.1",
        "--no-progress",
    )
    line = next(row for row in out.splitlines() if row.startswith("4 KiB"))
    assert line.split()[-1] == "yes", out  # the reader verified the bytes it was sent
    assert f"transport from {Path(site, 'transport')}" in out, out
