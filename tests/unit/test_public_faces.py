"""Each service has one public face: code outside a service imports only its client (and its settings, server and
cli modules, which the command line and tools start it or talk to it with), never its other modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Import name of each service package and its folder.
SERVICES = {"gateway": "gateway", "scheduler": "scheduler", "runtime": "model-runtime", "cache": "cache",
            "monitor": "monitor"}  # fmt: skip
FACES = {"client", "settings", "server", "cli"}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


def _violations() -> list[str]:
    found = []
    sources = [*ROOT.joinpath("src", "aiworks").rglob("*.py"), *ROOT.joinpath("services").rglob("*.py")]
    for path in sources:
        rel = path.relative_to(ROOT)
        if rel.parts[:3] == ("src", "aiworks", "pb"):
            continue
        own = next((name for name, folder in SERVICES.items() if rel.parts[:2] == ("services", folder)), None)
        for line, module, names in _imports(path):
            parts = module.split(".")
            if len(parts) < 2 or parts[0] != "aiworks" or parts[1] not in SERVICES or parts[1] == own:
                continue
            modules = [parts[2]] if len(parts) > 2 else names  # "from aiworks.cache import client"
            bad = [m for m in modules if m not in FACES]
            if bad:
                found.append(f"{rel}:{line} imports {module} {bad if len(parts) == 2 else ''}".rstrip())
    return found


def test_no_code_reaches_into_another_service():
    assert _violations() == []
