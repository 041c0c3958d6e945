"""The Gateway API routes (gatewayAPI.enabled): every public route of the gateway reaches its
port, nothing else does, and the long-lived HTTP streams have their request timeout disabled."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

from .support import CONTRACT_PORTS, PRIVATE_PATHS, PUBLIC_ROUTES, RELEASE, Rendered

# GEP-2257: a Gateway API Duration.
DURATION = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")
# Where a RegularExpression ranks is implementation-specific; Envoy Gateway, Contour, NGINX and
# kgateway rank it between Exact and PathPrefix (docs/deployment.md, section 8).
RANK = {"Exact": 0, "RegularExpression": 1, "PathPrefix": 2}


@pytest.fixture(scope="module")
def routes(render: Callable[..., Rendered]) -> Rendered:
    values: dict[str, Any] = {"gatewayAPI": {"enabled": True}}
    return render(copy.deepcopy(values))


def path_matches(match: dict[str, str], path: str) -> bool:
    value = match["value"]
    if match["type"] == "Exact":
        return path == value
    if match["type"] == "PathPrefix":  # whole path elements: /v1 takes /v1/models, not /v1x
        prefix = value.rstrip("/")
        return path == prefix or path.startswith(prefix + "/")
    assert match["type"] == "RegularExpression", match
    return re.fullmatch(value, path) is not None


def http_rule(route: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The rule the most precise matching path belongs to: Exact, then regex, then the longest prefix."""
    candidates = [
        ((RANK[m["path"]["type"]], -len(m["path"]["value"])), rule)
        for rule in route["spec"]["rules"]
        for m in rule["matches"]
        if path_matches(m["path"], path)
    ]
    return min(candidates, key=lambda c: c[0])[1] if candidates else None


def grpc_rule(route: dict[str, Any], path: str) -> dict[str, Any] | None:
    service, _, method = path.strip("/").partition("/")
    for rule in route["spec"]["rules"]:
        for m in rule["matches"]:
            if m["method"]["service"] == service and m["method"].get("method", method) == method:
                return rule
    return None


def test_every_public_route_reaches_its_port(routes: Rendered) -> None:
    name = f"{RELEASE}-gateway"
    http, grpc = routes.get("HTTPRoute", name), routes.get("GRPCRoute", name)
    for path, (port, _) in PUBLIC_ROUTES.items():
        rule = grpc_rule(grpc, path) if port == "grpc" else http_rule(http, path)
        assert rule is not None, f"{path} is not routed"
        assert rule["backendRefs"] == [{"name": name, "port": CONTRACT_PORTS["gateway"][port]}], path
    for path in PRIVATE_PATHS:
        assert http_rule(http, path) is None and grpc_rule(grpc, path) is None, f"{path} must stay private"


def test_http_streams_have_no_request_timeout(routes: Rendered) -> None:
    http = routes.get("HTTPRoute", f"{RELEASE}-gateway")
    for rule in http["spec"]["rules"]:
        for value in rule.get("timeouts", {}).values():
            assert DURATION.match(value), value
        for m in rule["matches"]:
            if m["path"]["type"] == "RegularExpression":
                re.compile(m["path"]["value"])
    for path, (port, stream) in PUBLIC_ROUTES.items():
        if port == "http":
            rule = http_rule(http, path)
            assert rule is not None
            # "0s" disables the timeout; unary routes keep the implementation's own.
            assert rule.get("timeouts") == ({"request": "0s"} if stream else None), path
            assert "retry" not in rule, path
