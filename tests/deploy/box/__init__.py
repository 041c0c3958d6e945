"""A cluster in a box: the Helm chart rendered by the real Helm engine, installed as local processes.

``run_box(values, scenarios)`` runs ``python -m deploy.box`` in a network namespace of its own and
returns each scenario's JSON. See cluster.py (install, Services, pods), kubelet.py (one pod),
network.py, proxy.py, apiserver.py (the one stand-in) and scenarios.py (what is checked).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def run_box(workdir: Path, values: dict | None, scenarios: list[str], *, prepare: str = "", timeout_s: float = 600,
            extra: dict | None = None) -> dict:
    """Install the chart with ``values`` in a fresh box and run ``scenarios``; their results by name.

    ``prepare`` names a function of ``deploy.box.prepare`` that makes what the values expect to exist
    (Secrets, claims, an S3 bucket) before the install.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    request = workdir / "request.json"
    result = workdir / "result.json"
    request.write_text(json.dumps({"values": values, "scenarios": scenarios, "prepare": prepare, "extra": extra or {}}))
    env = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with (workdir / "driver.log").open("wb") as log:
        done = subprocess.run(
            ["unshare", "--net", sys.executable, "-m", "deploy.box", str(request), str(result)],
            env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=workdir,
        )  # fmt: skip
    if not result.exists():
        raise RuntimeError(f"the box ended (exit {done.returncode}) without results:\n"
                           f"{(workdir / 'driver.log').read_text()[-6000:]}")  # fmt: skip
    return json.loads(result.read_text())
