"""helm/aiworks/README.md's table of values is what scripts/gen_chart_readme.py writes from values.yaml
and values.schema.json now, and it covers every top-level block."""

from __future__ import annotations

import importlib.util
import sys

import yaml

from .support import CHART, REPO


def generator():
    spec = importlib.util.spec_from_file_location("gen_chart_readme", REPO / "scripts" / "gen_chart_readme.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_values_table_is_current() -> None:
    readme = (CHART / "README.md").read_text()
    assert generator().render(readme) == readme, "run .venv/bin/python scripts/gen_chart_readme.py"


def test_every_top_level_value_is_documented() -> None:
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [k for k in values if f"| `{k}` |" not in readme and k not in {"nameOverride", "fullnameOverride"}]
    assert not missing, f"no description in values.yaml or the schema for {missing}"
    for key in ("auth.mode", "internalTLS.provider", "redis.enabled", "runtime.storage.volume", "tracing.otlpEndpoint",
                "istio.ingress.gatewayServiceAccount", "gatewayAPI.enabled"):
        assert f"| `{key}` |" in readme, key
