"""Lay the ``aiworks`` package out under DEST from the working tree, as pyproject.toml's package-dir maps it.

The GPU machine cannot build the project (no registry for its build
requirements), and it needs none: ``DEST/aiworks`` links ``src/aiworks``'s
contents and each service folder (``services/model-runtime`` as
``aiworks/runtime``, ...). Put DEST on PYTHONPATH; ``python3 -m aiworks``
then works there as after an install.

Usage: python3 scripts/device/link_package.py DEST
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def link_package(dest: Path) -> Path:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = dest / "aiworks"
    package.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / mapping["aiworks"]).iterdir():
        if entry.name != "__pycache__":
            _link(package / entry.name, entry)
    for name, folder in mapping.items():
        if name != "aiworks":
            _link(package / name.split(".", 1)[1], ROOT / folder)
    return package


def _link(path: Path, target: Path) -> None:
    if path.is_symlink() or path.exists():
        path.unlink()
    path.symlink_to(target.resolve())


if __name__ == "__main__":
    print(f"linked {link_package(Path(sys.argv[1]))}")
