"""The wheel a user installs (``pip install .``, not the editable install the suite runs on)
holds every module of the tree: a package left out of pyproject.toml fails here, not in a user's
``transport cluster up``."""

from __future__ import annotations

import shutil
import subprocess
import sys
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


@pytest.mark.timeout(600)
def test_the_built_wheel_holds_every_module_of_the_tree(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (its tracked files are the tree)")
    src = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path / "wheel"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    (wheel,) = out.glob("transport-*.whl")
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if n.endswith(".py")}
    assert tracked_modules() - held == set()
    assert "transport/py.typed" in zipfile.ZipFile(wheel).namelist()
