"""Fixtures of the observability tests: the Prometheus binaries, installed the way CI installs them.

``make test`` runs ``scripts/ensure-debian-packages.sh`` before pytest, so
CI has ``prometheus`` and ``promtool``. When a developer's machine lacks
them the fixture runs the same script; only if that cannot install them
(no root, no sudo, no network) do the tests that need them skip, saying why.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from .support import REPO


def pytest_collection_modifyitems(items):
    for item in items:
        if "/observability/" in str(item.fspath) and item.fspath.basename == "test_prometheus_live.py":
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def prometheus_binaries() -> dict[str, str]:
    """``{"prometheus": path, "promtool": path}``, installing the Debian package when they are missing."""
    names = ("prometheus", "promtool")
    found = {name: shutil.which(name) for name in names}
    if all(found.values()):
        return found
    script = REPO / "scripts" / "ensure-debian-packages.sh"
    try:
        result = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=900)
        output = (result.stdout + result.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        output = str(exc)
    found = {name: shutil.which(name) for name in names}
    if not all(found.values()):
        missing = ", ".join(name for name, path in found.items() if path is None)
        pytest.skip(f"{missing} missing and {script.name} could not install the prometheus package: {output[-500:]}")
    return found


@pytest.fixture(scope="session")
def promtool(prometheus_binaries) -> str:
    return prometheus_binaries["promtool"]
