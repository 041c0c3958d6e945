"""Envoy's compose config parsed into Envoy's own Bootstrap proto (xds-protos),
with every typed_config resolved, and checked for the edge's promises."""

from __future__ import annotations

import copy
import importlib
import pkgutil
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from google.protobuf import json_format

from .support import MESH, PRIVATE_PATHS, PUBLIC_ROUTES


def type_urls(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if "@type" in node:
            yield node["@type"]
        for value in node.values():
            yield from type_urls(value)
    elif isinstance(node, list):
        for value in node:
            yield from type_urls(value)


def import_extensions(config: dict[str, Any]) -> None:
    """Import the generated modules of every package a typed_config names, so
    its message is in the descriptor pool when ParseDict meets the Any."""
    for url in set(type_urls(config)):
        package = url.rsplit("/", 1)[1].rsplit(".", 1)[0]
        module = importlib.import_module(package)
        for info in pkgutil.iter_modules(module.__path__):
            if info.name.endswith("_pb2"):
                importlib.import_module(f"{package}.{info.name}")


def parse(config: dict[str, Any]) -> bootstrap_pb2.Bootstrap:
    import_extensions(config)
    return json_format.ParseDict(config, bootstrap_pb2.Bootstrap())


def test_envoy_configs_parse_into_bootstrap() -> None:
    files = sorted((MESH / "envoy").glob("*.yaml"))
    assert files
    for path in files:
        parse(yaml.safe_load(path.read_text()))


def test_parser_rejects_unknown_fields(envoy_config: dict[str, Any]) -> None:
    """Guard against a vacuous check: a misspelt field must fail to parse."""
    broken = copy.deepcopy(envoy_config)
    broken["static_resources"]["clusters"][0]["circuit_breaker"] = {}
    with pytest.raises(json_format.ParseError):
        parse(broken)


def test_tls_termination_with_http2(envoy_config: dict[str, Any]) -> None:
    bootstrap = parse(envoy_config)
    https = next(x for x in bootstrap.static_resources.listeners if x.name == "https")
    assert https.address.socket_address.port_value == 8443
    [chain] = https.filter_chains
    assert chain.transport_socket.typed_config.type_url.endswith("DownstreamTlsContext")
    tls = envoy_config["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"]["typed_config"]
    assert tls["common_tls_context"]["alpn_protocols"] == ["h2", "http/1.1"]
    assert bootstrap.admin.address.socket_address.address == "127.0.0.1"


def routes(envoy_config: dict[str, Any]) -> list[dict[str, Any]]:
    manager = envoy_config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    [host] = manager["route_config"]["virtual_hosts"]
    return host["routes"]


def envoy_route(routes: list[dict[str, Any]], path: str, grpc: bool) -> dict[str, Any]:
    """The first route whose match takes the request (Envoy's path, prefix, RE2 full match; grpc: gRPC only)."""
    for route in routes:
        match = route["match"]
        if "grpc" in match and not grpc:
            continue
        if "path" in match and path == match["path"]:
            return route
        if "prefix" in match and path.startswith(match["prefix"]):
            return route
        if "safe_regex" in match and re.fullmatch(match["safe_regex"]["regex"], path):
            return route
    raise AssertionError(f"no route takes {path}")


def test_http_and_grpc_routes_with_retries(envoy_config: dict[str, Any]) -> None:
    table = routes(envoy_config)
    parse(envoy_config)  # the regex and duration fields are Envoy's own
    for path, (port, stream) in PUBLIC_ROUTES.items():
        route = envoy_route(table, path, grpc=port == "grpc")
        assert route["route"]["cluster"] == f"gateway_{port}", path
        if stream:
            # No route timeout, no retries; a gRPC stream keeps only its caller's own deadline, uncapped.
            assert route["route"]["timeout"] == "0s" and "retry_policy" not in route["route"], path
            if port == "grpc":
                assert route["route"]["max_stream_duration"] == {"grpc_timeout_header_max": "0s"}, path
        else:
            assert route["route"]["timeout"] == "60s", path
            policy = route["route"]["retry_policy"]
            assert policy["num_retries"] >= 1 and policy["per_try_timeout"], path
            assert "reset" not in policy["retry_on"] and "5xx" not in policy["retry_on"].split(","), path
    for path in PRIVATE_PATHS:
        for grpc in (False, True):
            assert envoy_route(table, path, grpc)["direct_response"]["status"] == 404, f"{path} must stay private"
    assert table[-1]["match"] == {"prefix": "/"}, "nothing else is exposed"


def test_clusters_break_circuits(envoy_config: dict[str, Any]) -> None:
    bootstrap = parse(envoy_config)
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    for name, port in (("gateway_http", 8000), ("gateway_grpc", 8001)):
        cluster = clusters[name]
        [threshold] = cluster.circuit_breakers.thresholds
        assert threshold.max_requests.value > 0 and threshold.max_pending_requests.value > 0
        assert cluster.outlier_detection.consecutive_5xx.value > 0
        assert cluster.lb_policy == cluster.LEAST_REQUEST
        [health] = cluster.health_checks
        assert health.HasField("grpc_health_check" if "grpc" in name else "http_health_check")
        [endpoint] = cluster.load_assignment.endpoints[0].lb_endpoints
        address = endpoint.endpoint.address.socket_address
        assert (address.address, address.port_value) == ("gateway", port)
    options = clusters["gateway_grpc"].typed_extension_protocol_options
    assert "envoy.extensions.upstreams.http.v3.HttpProtocolOptions" in options
