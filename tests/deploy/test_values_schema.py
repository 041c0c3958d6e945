"""values.schema.json: good values pass, bad ones are refused by Helm with a
message that names the key and the rule."""

from __future__ import annotations

import copy
from typing import Any

import helm_python as helm
import pytest

from .support import CHART


def test_shipped_values_pass(chart: Any, all_features_values: dict[str, Any], mesh_values: dict[str, Any]) -> None:
    chart.validate_schema(None)
    chart.validate_schema(all_features_values)
    chart.validate_schema(mesh_values)


BAD_VALUES = [
    pytest.param({"gatewy": {"replicas": 2}}, ["gatewy"], id="unknown-top-level-key"),
    pytest.param({"gateway": {"replica": 2}}, ["replica"], id="misspelt-service-key"),
    pytest.param(
        {"runtime": {"pools": {"iris": {"canary": {"enabled": True, "weight": 120}}}}},
        ["/runtime/pools/iris/canary/weight", "maximum"],
        id="canary-weight-over-100",
    ),
    pytest.param(
        {"runtime": {"pools": {"Iris_Model": {"stable": {"replicas": 1}, "canary": {"enabled": False, "weight": 0}}}}},
        ["Iris_Model"],
        id="pool-name-not-dns",
    ),
    pytest.param({"istio": {"peerAuthentication": {"mode": "DISABLE"}}}, ["/istio/peerAuthentication/mode"], id="mtls-off"),
    pytest.param({"istio": {"virtualServices": {"runtime": {"timeout": "30 seconds"}}}}, ["/istio/virtualServices/runtime/timeout"], id="bad-duration"),
    pytest.param({"gateway": {"image": {"pullPolicy": "Sometimes"}}}, ["/gateway/image/pullPolicy"], id="bad-pull-policy"),
    pytest.param({"scheduler": {"replicas": -1}}, ["/scheduler/replicas", "minimum"], id="negative-replicas"),
    pytest.param({"istio": {"authorizationPolicies": {"ingressPrincipals": ["istio-ingressgateway"]}}}, ["ingressPrincipals"], id="principal-not-spiffe"),
]


@pytest.mark.parametrize(("overrides", "mentions"), BAD_VALUES)
def test_bad_values_are_refused_clearly(chart: Any, overrides: dict[str, Any], mentions: list[str]) -> None:
    values = chart.merge_values(copy.deepcopy(overrides))
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(values)
    message = str(refused.value)
    for mention in mentions:
        assert mention in message, message
    # An install would be refused the same way, before any template runs.
    with pytest.raises(helm.HelmValuesError):
        chart.render(overrides, name="aiworks", namespace="aiworks")


def test_lint_reports_schema_violations() -> None:
    report = helm.lint(str(CHART), {"runtime": {"pools": {"iris": {"canary": {"weight": 120}}}}}, strict=True)
    assert any("maximum" in error for error in report["errors"]), report
