"""The box's driver, run in a network namespace of its own: render, install, run scenarios, write JSON.

    unshare --net python -m deploy.box REQUEST.json RESULT.json   (PYTHONPATH=tests)
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import helm_python as helm

from . import prepare as preparers
from .cluster import Box
from .images import REPO
from .scenarios import SCENARIOS

NAMESPACE = RELEASE = "aiworks"


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    workdir = Path(request_path).parent
    results: dict = {"scenarios": {}}
    chart = helm.Chart.load(str(REPO / "helm" / "aiworks"))
    try:
        manifests = chart.render(request["values"], name=RELEASE, namespace=NAMESPACE)
        values = chart.merge_values(request["values"] or {})
    finally:
        chart.close()
    box = Box(workdir / "cluster", NAMESPACE)
    try:
        if request["prepare"]:
            getattr(preparers, request["prepare"])(box, workdir, request["extra"])
        t0 = time.monotonic()
        box.install(manifests)
        ctx = {"values": values, "t0": t0, "install_s": time.monotonic() - t0, **request["extra"]}
        results["install_s"] = round(ctx["install_s"], 2)
        results["events"] = box.events
        for name in request["scenarios"]:
            started = time.monotonic()
            try:
                results["scenarios"][name] = {"ok": True, **SCENARIOS[name](box, ctx)}
            except Exception as exc:
                results["scenarios"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                              "trace": traceback.format_exc()[-3000:], "cluster": box.describe()[-6000:]}
            results["scenarios"][name]["seconds"] = round(time.monotonic() - started, 2)
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        results["trace"] = traceback.format_exc()[-3000:]
        results["cluster"] = box.describe()[-8000:]
    finally:
        box.close()
        for stop in request["extra"].get("_stop", []):
            stop()
        request["extra"].pop("_stop", None)
        Path(result_path).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:3])
