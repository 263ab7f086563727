"""The package's source as the structure tests read it: every module by dotted name, read from
its file (nothing is imported: the optional frameworks cost a minute of CPU to import)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the package's folders by the dotted name they install as (backends/ as transport.backends)
PACKAGES = {"transport": ROOT / "transport", "transport.backends": ROOT / "backends"}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    out = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out
