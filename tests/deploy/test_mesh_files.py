"""The standalone policies in mesh/: bookinfo-style names, the same objects the
chart renders, and a README that explains each one."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

from .support import MESH, NAMESPACE, Rendered

KIND_PREFIX = {
    "PeerAuthentication": "peer-authentication",
    "DestinationRule": "destination-rule",
    "VirtualService": "virtual-service",
    "AuthorizationPolicy": "authorization-policy",
    "Gateway": "gateway",
}
SERVICES = {"gateway", "scheduler", "runtime", "cache", "monitor", "ingress", "strict"}
CANARY_FILE = re.compile(r"^virtual-service-runtime-canary-(\d+)\.yaml$")


def test_names_follow_kind_service_variant(mesh_documents: dict[str, dict[str, Any]]) -> None:
    for name, doc in mesh_documents.items():
        prefix = KIND_PREFIX[doc["kind"]]
        assert name.startswith(prefix + "-"), name
        service = name[len(prefix) + 1 :].removesuffix(".yaml").split("-")[0]
        assert service in SERVICES, name
        assert doc["metadata"]["namespace"] == NAMESPACE


def test_canary_steps_are_all_there(mesh_documents: dict[str, dict[str, Any]]) -> None:
    steps = sorted(int(m.group(1)) for n in mesh_documents if (m := CANARY_FILE.match(n)))
    assert steps == [5, 20, 50, 100]
    assert "virtual-service-runtime-stable.yaml" in mesh_documents


def test_mesh_files_equal_the_chart(
    mesh_documents: dict[str, dict[str, Any]],
    mesh_values: dict[str, Any],
    render: Callable[[dict[str, Any] | None], Rendered],
) -> None:
    mismatched = []
    for name, doc in mesh_documents.items():
        values = copy.deepcopy(mesh_values)
        if match := CANARY_FILE.match(name):
            values["runtime"]["pools"]["iris"]["canary"].update(enabled=True, weight=int(match.group(1)))
        rendered = render(values).get(doc["kind"], doc["metadata"]["name"])
        if (doc["apiVersion"], doc["spec"]) != (rendered["apiVersion"], rendered["spec"]):
            mismatched.append(name)
    assert not mismatched, f"mesh/ and helm/aiworks disagree on: {mismatched}"


def test_readme_explains_every_policy(mesh_documents: dict[str, dict[str, Any]]) -> None:
    readme = (MESH / "README.md").read_text()
    for name in [*mesh_documents, "envoy/envoy.yaml"]:
        assert name in readme, name
    for promise in ("mTLS", "circuit breaking", "canary", "least-request"):
        assert promise.lower() in readme.lower()
