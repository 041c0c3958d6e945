"""Istio and prometheus-operator objects against their schema models
(cloudcoil-models-*), with no unknown fields, plus the mesh promises:
mTLS everywhere, circuit breaking, least-request balancing, weighted canary,
and exact caller -> /package.Service/Method authorization."""

from __future__ import annotations

import copy
import importlib
import re
from typing import Any

import pytest
from cloudcoil.models.cert_manager import v1 as cert_manager
from cloudcoil.models.istio.networking import v1 as networking
from cloudcoil.models.istio.security import v1 as security
from cloudcoil.models.prometheus_operator import v1 as monitoring

from .support import (
    BATCH_PATHS,
    CONTRACT_PORTS,
    CRD_GROUPS,
    NAMESPACE,
    PRIVATE_PATHS,
    PUBLIC_ROUTES,
    RELEASE,
    Rendered,
    api_group,
    differences,
)

MODELS = {
    ("networking.istio.io/v1", "DestinationRule"): networking.DestinationRule,
    ("networking.istio.io/v1", "VirtualService"): networking.VirtualService,
    ("networking.istio.io/v1", "Gateway"): networking.Gateway,
    ("security.istio.io/v1", "PeerAuthentication"): security.PeerAuthentication,
    ("security.istio.io/v1", "AuthorizationPolicy"): security.AuthorizationPolicy,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): monitoring.ServiceMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): monitoring.PrometheusRule,
    ("cert-manager.io/v1", "Issuer"): cert_manager.Issuer,
    ("cert-manager.io/v1", "Certificate"): cert_manager.Certificate,
}
# Kinds the all-features values render (cert-manager's come from ci/gateway-api-values.yaml).
ALL_FEATURES_KINDS = {k for (group, k) in MODELS if not group.startswith("cert-manager")}

# The suite's call graph: (caller's account, callee) -> the exact gRPC paths.
SCHEDULER = "/aiworks.scheduler.v1.SchedulerService/"
RUNTIME = "/aiworks.runtime.v1.RuntimeService/"
CALL_GRAPH = {
    ("gateway", "scheduler"): {
        SCHEDULER + m
        for m in (
            "WatchRouting", "ServerReady", "ModelReady", "ModelMetadata", "RepositoryIndex",
            "LoadModel", "UnloadModel", "ModelStatistics", "Status",
        )
    },
    ("gateway", "runtime"): {RUNTIME + "InferStream"},
    ("runtime", "scheduler"): {SCHEDULER + "RegisterReplica", SCHEDULER + "Heartbeat"},
    ("monitor", "scheduler"): {SCHEDULER + m for m in ("Status", "SetTrafficPolicy", "GetTrafficPolicy", "EjectReplica")},
    ("scheduler", "runtime"): {
        RUNTIME + m for m in ("LoadModel", "UnloadModel", "ListModels", "ModelMetadata", "Statistics")
    },
    ("gateway", "cache"): {"/aiworks.cache.v1.CacheService/" + m for m in ("Get", "Put", "GetStream", "PutStream", "Invalidate", "Stats")},
    # The admin identity (helm test, operators' CLI pods): readiness, status and traffic policy.
    ("admin", "scheduler"): {
        SCHEDULER + m
        for m in (
            "ServerReady", "ModelReady", "ModelMetadata", "RepositoryIndex", "LoadModel", "UnloadModel",
            "ModelStatistics", "Status", "SetTrafficPolicy", "GetTrafficPolicy", "EjectReplica",
        )
    },
    ("admin", "gateway"): {"/v2/health/ready", "/v2/health/live"},
    ("admin", "monitor"): {"/v1/*", "/healthz"},
    # The tiers (every feature on): each line of a job, each queued request, sent as an inference.
    ("batch-runner", "gateway"): {"/v2/models/*"},
    ("nearline-worker", "gateway"): {"/v2/models/*"},
}
# Plain TCP callers (no paths): (caller, callee) -> ports.
TCP_GRAPH = {("gateway", "redis"): {"6379"}, ("cache", "redis"): {"6379"}, ("scheduler", "redis"): {"6379"},
             ("batch-runner", "redis"): {"6379"}, ("nearline-worker", "redis"): {"6379"}}  # fmt: skip
GRPC_PATH = re.compile(r"^/[a-z][a-z0-9_]*(\.[a-z0-9_]+)*\.[A-Z][A-Za-z0-9]*/([A-Z][A-Za-z0-9]*|\*)$")


def check_against_model(obj: dict[str, Any]) -> list[str]:
    """Differences between an object and its schema model's round trip (unknown fields are dropped)."""
    model = MODELS.get((obj["apiVersion"], obj["kind"]))
    if model is None:
        return [f"no schema model for {obj['apiVersion']} {obj['kind']}"]
    parsed = model.model_validate(obj)
    return differences(obj, parsed.model_dump(by_alias=True, exclude_unset=True, mode="json"))


def crd_objects(rendered: Rendered) -> list[dict[str, Any]]:
    return [o for o in rendered.objects if api_group(o) in CRD_GROUPS]


def test_chart_crd_objects_match_their_schemas(full: Rendered) -> None:
    objects = crd_objects(full)
    kinds = {o["kind"] for o in objects}
    assert kinds == ALL_FEATURES_KINDS
    failures = [f"{o['kind']}/{o['metadata']['name']}{d}" for o in objects for d in check_against_model(o)]
    assert not failures, "\n".join(failures)


def test_mesh_files_match_their_schemas(mesh_documents: dict[str, dict[str, Any]]) -> None:
    failures = [f"mesh/{name}{d}" for name, doc in mesh_documents.items() for d in check_against_model(doc)]
    assert not failures, "\n".join(failures)


def test_models_catch_unknown_and_invalid_fields(full: Rendered) -> None:
    """Guard against a vacuous check: a misspelt field and a bad enum must be caught."""
    rule = next(o for o in full.of_kind("DestinationRule"))
    misspelt = {**rule, "spec": {**rule["spec"], "trafficPolicy": {**rule["spec"]["trafficPolicy"], "outlierDetecton": {}}}}
    assert any("outlierDetecton" in d for d in check_against_model(misspelt))
    bad_enum = {**rule, "spec": {**rule["spec"], "trafficPolicy": {"loadBalancer": {"simple": "FASTEST"}}}}
    with pytest.raises(ValueError):
        networking.DestinationRule.model_validate(bad_enum)


def test_mtls_is_strict(full: Rendered, render: Any, all_features_values: dict[str, Any]) -> None:
    [peer] = full.of_kind("PeerAuthentication")
    # The release's own pods, so the namespace's "default" policy (the platform's) is never replaced.
    assert peer["metadata"]["name"] == RELEASE and peer["metadata"]["namespace"] == NAMESPACE
    assert peer["spec"] == {
        "selector": {"matchLabels": {"app.kubernetes.io/name": "aiworks", "app.kubernetes.io/instance": RELEASE}},
        "mtls": {"mode": "STRICT"},
    }, "no port exceptions"
    for rule in full.of_kind("DestinationRule"):
        assert rule["spec"]["trafficPolicy"]["tls"]["mode"] == "ISTIO_MUTUAL"
    wide = copy.deepcopy(all_features_values)
    wide["istio"]["peerAuthentication"] = {"namespaceWide": True}
    [peer] = render(wide).of_kind("PeerAuthentication")
    assert peer["metadata"]["name"] == "default" and peer["spec"] == {"mtls": {"mode": "STRICT"}}


def test_services_trust_the_mesh_for_caller_identity(full: Rendered) -> None:
    """With Istio, every service reads its caller from the sidecar; no certificates of its own. The tiers
    serve no API (only /metrics): they call the gateway in plain HTTP, which the sidecars make mutual TLS."""
    for deployment in full.of_kind("Deployment"):
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        if component in ("batch-runner", "nearline-worker"):
            prefix = {"batch-runner": "AIWORKS_BATCH_", "nearline-worker": "AIWORKS_NEARLINE_"}[component]
            assert env[prefix + "GATEWAY_URL"] == f"http://{RELEASE}-gateway:8000", component
            assert prefix + "CA_FILE" not in env, component
            continue
        prefix = f"AIWORKS_{component.upper()}_"
        assert env[prefix + "MESH_MTLS"] == "true", component
        assert not {prefix + "TLS_CERT", prefix + "INSECURE"} & set(env), component
    accounts = {a["metadata"]["name"] for a in full.of_kind("ServiceAccount")}
    # The sidecar's SPIFFE URI names <fullname>-<service>: each service has that account.
    assert {f"{RELEASE}-{c}" for c in ("gateway", "scheduler", "runtime", "cache", "monitor", "admin")} <= accounts


def test_destination_rules_break_circuits_and_balance_least_request(full: Rendered) -> None:
    hosts = {r["spec"]["host"] for r in full.of_kind("DestinationRule")}
    services = {f"{s['metadata']['name']}.{NAMESPACE}.svc.cluster.local" for s in full.of_kind("Service")}
    assert hosts <= services
    assert {f"{RELEASE}-{c}.{NAMESPACE}.svc.cluster.local" for c in ("gateway", "scheduler", "cache")} <= hosts
    for rule in full.of_kind("DestinationRule"):
        policy = rule["spec"]["trafficPolicy"]
        assert policy["loadBalancer"] == {"simple": "LEAST_REQUEST"}
        assert policy["connectionPool"]["tcp"]["maxConnections"] > 0
        assert policy["connectionPool"]["http"]["http2MaxRequests"] > 0
        assert policy["outlierDetection"]["consecutive5xxErrors"] > 0
        assert 0 < policy["outlierDetection"]["maxEjectionPercent"] < 100


def test_runtime_subsets_match_track_labels(full: Rendered) -> None:
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in full.of_kind("Deployment")]
    for model in ("iris", "digits"):
        rule = full.get("DestinationRule", f"{RELEASE}-runtime-{model}")
        service = full.get("Service", f"{RELEASE}-runtime-{model}")
        for subset in rule["spec"]["subsets"]:
            selector = {**service["spec"]["selector"], **subset["labels"]}
            assert any(all(p.get(k) == v for k, v in selector.items()) for p in pods), subset


def test_canary_routes_are_weighted(full: Rendered) -> None:
    expected = {"iris": 20, "digits": 5}
    for model, canary in expected.items():
        service = full.get("VirtualService", f"{RELEASE}-runtime-{model}")
        streams, unary = service["spec"]["http"]
        for route in (streams, unary):
            weights = {d["destination"]["subset"]: d["weight"] for d in route["route"]}
            assert weights == {"stable": 100 - canary, "canary": canary}
            assert all(m["port"] == 8020 for m in route["match"]), "metrics traffic is not rerouted"
        # A long-lived batch stream is neither cut by a route timeout nor replayed.
        assert streams["match"][0]["uri"] == {"exact": RUNTIME + "InferStream"}  # the gateways' request stream
        assert (streams["timeout"], streams["retries"]) == ("0s", {"attempts": 0})
        assert unary["retries"]["attempts"] >= 1 and unary["timeout"] != "0s"


def istio_route(routes: list[dict[str, Any]], path: str) -> dict[str, Any] | None:
    """The first route of a VirtualService whose uri match takes the path (Istio's exact, prefix, RE2 full match)."""
    for route in routes:
        for match in route["match"]:
            uri = match["uri"]
            if ("exact" in uri and path == uri["exact"]) or ("prefix" in uri and path.startswith(uri["prefix"])):
                return route
            if "regex" in uri and re.fullmatch(uri["regex"], path):
                return route
    return None


def test_ingress_routes_http_and_grpc(full: Rendered) -> None:
    [gateway] = full.of_kind("Gateway")
    https = next(s for s in gateway["spec"]["servers"] if s["port"]["protocol"] == "HTTPS")
    assert https["tls"]["mode"] == "SIMPLE" and https["tls"]["credentialName"]
    ingress = full.get("VirtualService", f"{RELEASE}-gateway-ingress")
    assert ingress["spec"]["gateways"] == [f"{NAMESPACE}/{gateway['metadata']['name']}"]
    routes = ingress["spec"]["http"]
    for path, (port, _) in PUBLIC_ROUTES.items():
        route = istio_route(routes, path)
        assert route is not None, f"{path} is not routed"
        [destination] = route["route"]
        assert destination["destination"]["port"]["number"] == CONTRACT_PORTS["gateway"][port], path
    for path in PRIVATE_PATHS:
        assert istio_route(routes, path) is None, f"{path} must stay private"


def test_ingress_streams_have_no_timeout_and_no_retries(full: Rendered) -> None:
    """A long-lived stream is neither cut by a route timeout nor replayed; unary calls keep both."""
    routes = full.get("VirtualService", f"{RELEASE}-gateway-ingress")["spec"]["http"]
    for path, (_, stream) in PUBLIC_ROUTES.items():
        route = istio_route(routes, path)
        assert route is not None
        if stream:
            assert (route["timeout"], route["retries"]) == ("0s", {"attempts": 0}), path
        else:
            assert route["timeout"] == "60s" and route["retries"]["attempts"] == 2, path
            assert route["retries"]["retryOn"] == "connect-failure,refused-stream,unavailable", path


def istio_allows(rules: list[dict[str, Any]], principal: str, port: int, path: str) -> bool:
    """Whether an ALLOW policy's rules admit a call with any method (Istio's exact, "prefix*" and "*suffix"
    paths); rules limited to some methods are left out, so a method limit on a public route fails here."""

    def matches(pattern: str) -> bool:
        if pattern.endswith("*"):
            return path.startswith(pattern[:-1])
        if pattern.startswith("*"):
            return path.endswith(pattern[1:])
        return path == pattern

    for rule in rules:
        [source], [operation] = rule["from"], rule["to"]
        op = operation["operation"]
        if principal in source["source"]["principals"] and str(port) in op["ports"] and "methods" not in op:
            if any(matches(p) for p in op.get("paths", ["*"])):
                return True
    return False


@pytest.mark.parametrize("batch", [False, True])
def test_ingress_principal_reaches_every_public_route(
    render: Any, all_features_values: dict[str, Any], batch: bool
) -> None:
    values = copy.deepcopy(all_features_values)
    values["batchRunner"]["enabled"] = batch
    rules = render(values).get("AuthorizationPolicy", f"{RELEASE}-gateway")["spec"]["rules"]
    ingress = "cluster.local/ns/istio-ingress/sa/istio-ingressgateway"
    ports = CONTRACT_PORTS["gateway"]
    for path, (port, _) in PUBLIC_ROUTES.items():
        expected = batch or path not in BATCH_PATHS
        assert istio_allows(rules, ingress, ports[port], path) == expected, path
        other = "grpc" if port == "http" else "http"
        assert not istio_allows(rules, ingress, ports[other], path), f"{path} on the {other} port"
    for path in PRIVATE_PATHS:
        for port in ("http", "grpc", "metrics"):
            assert not istio_allows(rules, ingress, ports[port], path), (path, port)


def authorized(full: Rendered) -> dict[tuple[str, str], set[str]]:
    """(caller account, callee component) -> paths the AuthorizationPolicies allow."""
    accounts = {a["metadata"]["name"]: a for a in full.of_kind("ServiceAccount")}
    allowed: dict[tuple[str, str], set[str]] = {}
    for policy in full.of_kind("AuthorizationPolicy"):
        callee = policy["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        assert policy["spec"]["action"] == "ALLOW"
        for rule in policy["spec"]["rules"]:
            [source] = rule["from"]
            [operation] = rule["to"]
            paths = set(operation["operation"].get("paths", [])) or {f":{p}" for p in operation["operation"]["ports"]}
            assert operation["operation"]["ports"], "every rule names its port"
            for principal in source["source"]["principals"]:
                account = principal.rsplit("/", 1)[1]
                if f"/ns/{NAMESPACE}/" in principal and account in accounts:
                    caller = accounts[account]["metadata"]["labels"]["app.kubernetes.io/component"]
                else:
                    caller = principal
                allowed.setdefault((caller, callee), set()).update(paths)
    return allowed


@pytest.mark.parametrize("bundled_redis", [False, True])
def test_authorization_allows_only_the_call_graph(
    full: Rendered, render: Any, all_features_values: dict[str, Any], bundled_redis: bool
) -> None:
    if bundled_redis:
        values = copy.deepcopy(all_features_values)
        values["redis"]["enabled"] = True
        full = render(values)
    allowed = authorized(full)
    internal = {pair: paths - {"/metrics"} for pair, paths in allowed.items() if "/" not in pair[0]}
    internal = {pair: paths for pair, paths in internal.items() if paths}
    tcp = {pair: {p.lstrip(":") for p in paths} for pair, paths in internal.items() if all(p.startswith(":") for p in paths)}
    assert tcp == (TCP_GRAPH if full.of_kind("StatefulSet") else {}), "only the gateways and caches reach Redis"
    assert {pair: paths for pair, paths in internal.items() if pair not in tcp} == CALL_GRAPH
    for (caller, _), paths in CALL_GRAPH.items():
        # Internal calls are gRPC methods; the admin and the tiers call the gateway's public HTTP API.
        assert caller in ("admin", "batch-runner", "nearline-worker") or all(GRPC_PATH.match(p) for p in paths)
    external = {pair: paths for pair, paths in allowed.items() if "/" in pair[0]}
    for (caller, callee), paths in external.items():
        if caller == "cluster.local/ns/istio-ingress/sa/istio-ingressgateway":  # Istio's Helm-installed gateway
            # With the Batch API on (every feature), its routes too.
            assert (callee, paths) == ("gateway", {"/v2", "/v2/*", "/v1/models", "/v1/completions",
                                                   "/v1/chat/completions", "/v1/embeddings",
                                                   "/inference.GRPCInferenceService/*",
                                                   "/aiworks.streams.v1.ResultStreams/Subscribe", "/v1/files",
                                                   "/v1/files/*", "/v1/batches", "/v1/batches/*"})  # fmt: skip
        else:
            assert paths == {"/metrics"}, f"{caller} may only scrape {callee}"


def test_every_workload_has_a_policy(full: Rendered) -> None:
    protected = {p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for p in full.of_kind("AuthorizationPolicy")}
    workloads = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in full.of_kind("Deployment")}
    assert workloads <= protected


# Methods the call graph grants that the protos do not declare yet (the
# monitor's control calls). Drop them from here when they land.
PENDING_METHODS: set[str] = set()


def declared_methods(package: str) -> set[str] | None:
    """Every /package.Service/Method the generated code of a package declares, or None without it."""
    service = package.split(".")[1]
    try:
        descriptor = importlib.import_module(f"aiworks.pb.{service}.v1.{service}_pb2").DESCRIPTOR
    except ModuleNotFoundError:
        return None
    return {
        f"/{service.full_name}/{method.name}"
        for service in descriptor.services_by_name.values()
        for method in service.methods
    }


def test_authorization_matches_the_protos() -> None:
    """Every granted method exists, and every declared method is granted to someone."""
    granted = set().union(*CALL_GRAPH.values())
    for package in ("aiworks.scheduler.v1", "aiworks.runtime.v1", "aiworks.cache.v1"):
        declared = declared_methods(package)
        if declared is None:
            continue  # the service's API is not generated yet
        ours = {p for p in granted if p.startswith(f"/{package}.")}
        assert ours - declared <= PENDING_METHODS, sorted(ours - declared - PENDING_METHODS)
        assert declared <= ours, f"no caller may call {sorted(declared - ours)}"
