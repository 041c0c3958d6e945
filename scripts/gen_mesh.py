"""Rewrite the standalone Istio policies in mesh/ from the Helm chart's rendering.

Each mesh/<kind>-<service>-<variant>.yaml keeps its header comment; its
apiVersion, name and spec become what helm/aiworks renders for release
"aiworks" in namespace "aiworks" with tests/deploy/testdata/mesh-values.yaml
(canary files with runtime.pools.iris.canary at their weight). tests/deploy
fails when the two differ: edit the chart, then run

    .venv/bin/python scripts/gen_mesh.py
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parent.parent
MESH = ROOT / "mesh"
CANARY = re.compile(r"^virtual-service-runtime-canary-(\d+)\.yaml$")


class _Dumper(yaml.SafeDumper):
    """Block lists indented under their key, as the files are written by hand."""

    def increase_indent(self, flow: bool = False, indentless: bool = False):
        return super().increase_indent(flow, False)


def main() -> None:
    chart = helm.Chart.load(str(ROOT / "helm" / "aiworks"))
    base = yaml.safe_load((ROOT / "tests" / "deploy" / "testdata" / "mesh-values.yaml").read_text())
    try:
        for path in sorted(MESH.glob("*.yaml")):
            text = path.read_text()
            header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
            doc = yaml.safe_load(text)
            values = copy.deepcopy(base)
            if match := CANARY.match(path.name):
                values["runtime"]["pools"]["iris"]["canary"].update(enabled=True, weight=int(match.group(1)))
            rendered = [
                o for p, t in chart.render(values, name="aiworks", namespace="aiworks").items()
                for p, t in [(p, t)] if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o and o.get("kind") == doc["kind"]
            ]  # fmt: skip
            named = [o for o in rendered if o["metadata"]["name"] == doc["metadata"]["name"]]
            [obj] = named or rendered  # a renamed object: the only one of its kind
            doc["apiVersion"] = obj["apiVersion"]
            doc["metadata"]["name"] = obj["metadata"]["name"]
            doc["spec"] = obj["spec"]
            path.write_text(header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False))
    finally:
        chart.close()


if __name__ == "__main__":
    main()
