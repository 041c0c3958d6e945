"""The tiers in the Helm chart: the batch runner and the nearline worker (batchRunner, nearlineWorker), and what
turning them on changes in the gateway, Redis's NetworkPolicy and the mesh's AuthorizationPolicies."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from .support import RELEASE, TIER_COMMANDS, TIER_PORTS, Rendered

TIERS_ON = {
    "batchRunner": {"enabled": True, "replicas": 2, "files": {
        "url": "/var/lib/aiworks/batch/files", "volume": {"persistentVolumeClaim": {"claimName": "batch-files"}}}},
    "nearlineWorker": {"enabled": True, "deadlineSeconds": 0.25},
}  # fmt: skip
PREFIX = {"batch-runner": "AIWORKS_BATCH_", "nearline-worker": "AIWORKS_NEARLINE_"}


def deployment(rendered: Rendered, component: str) -> dict[str, Any]:
    return rendered.get("Deployment", f"{RELEASE}-{component}")


def container(rendered: Rendered, component: str) -> dict[str, Any]:
    [only] = deployment(rendered, component)["spec"]["template"]["spec"]["containers"]
    return only


def env_of(rendered: Rendered, component: str) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(rendered, component).get("env", [])}


def volumes_of(rendered: Rendered, component: str) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in deployment(rendered, component)["spec"]["template"]["spec"]["volumes"]}


def mounts_of(rendered: Rendered, component: str) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in container(rendered, component)["volumeMounts"]}


def test_off_by_default_as_in_the_gateway(render: Any) -> None:
    """The gateway's Batch API and asynchronous requests are off unless set; so are their workers."""
    default = render(None)
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in default.of_kind("Deployment")}
    assert not components & set(TIER_PORTS)
    gateway = env_of(default, "gateway")
    assert "AIWORKS_GATEWAY_BATCH_FILES_URL" not in gateway and "AIWORKS_GATEWAY_ASYNC_REQUESTS" not in gateway


def test_turning_them_on_turns_on_the_gateways_routes(render: Any) -> None:
    on = render(TIERS_ON)
    gateway = env_of(on, "gateway")
    assert gateway["AIWORKS_GATEWAY_BATCH_FILES_URL"] == "/var/lib/aiworks/batch/files"
    assert (gateway["AIWORKS_GATEWAY_ASYNC_REQUESTS"], gateway["AIWORKS_GATEWAY_ASYNC_DEADLINE_S"]) == ("true", "0.25")
    # One store of files: the same volume at the same path in every gateway and runner.
    for component in ("gateway", "batch-runner"):
        assert volumes_of(on, component)["batch-files"]["persistentVolumeClaim"] == {"claimName": "batch-files"}
        assert mounts_of(on, component)["batch-files"]["mountPath"] == "/var/lib/aiworks/batch"
    assert "batch-files" not in volumes_of(on, "nearline-worker")
    assert deployment(on, "batch-runner")["spec"]["replicas"] == 2


def test_workers_reach_the_gateway_over_its_tls_and_redis_with_the_release_secret(render: Any) -> None:
    """The services' own TLS (the default): HTTPS to the gateway, checked against the CA; the worker mounts only
    ca.crt of the gateway's Secret, never its key. Redis's URL (with its password) from the release's Secret."""
    on = render(TIERS_ON)
    for component, prefix in PREFIX.items():
        env = env_of(on, component)
        assert env[prefix + "REDIS_URL"] == {"secretKeyRef": {"name": f"{RELEASE}-redis", "key": "redis-url"}}
        assert env[prefix + "GATEWAY_URL"] == f"https://{RELEASE}-gateway:8000"
        ca = volumes_of(on, component)["gateway-ca"]["secret"]
        assert ca["secretName"] == f"{RELEASE}-gateway-tls"
        assert ca["items"] == [{"key": "ca.crt", "path": "ca.crt"}], "the CA's certificate only"
        assert env[prefix + "CA_FILE"] == mounts_of(on, component)["gateway-ca"]["mountPath"] + "/ca.crt"
        port = TIER_PORTS[component]["metrics"]
        assert (env[prefix + "METRICS_HOST"], env[prefix + "METRICS_PORT"]) == ("0.0.0.0", str(port))
        assert container(on, component)["args"][:2] == TIER_COMMANDS[component]
        assert container(on, component)["image"].startswith("aiworks/tiers:")
        # No credential of their own: they send each job's or request's submitter's.
        assert not [k for k in env if "API_KEY" in k or "TOKEN" in k], env
        assert deployment(on, component)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
        service = on.get("Service", f"{RELEASE}-{component}")
        assert [p["port"] for p in service["spec"]["ports"]] == [port]
    worker = env_of(on, "nearline-worker")
    assert worker["AIWORKS_NEARLINE_TENANTS_FILE"] == "/etc/aiworks/config/tenants.yaml", "callbacks' allowed hosts"
    assert volumes_of(on, "nearline-worker")["config"]["configMap"]["name"] == f"{RELEASE}-config"
    assert "--concurrency" in container(on, "nearline-worker")["args"]


def test_redis_admits_the_workers_only_when_they_run(render: Any) -> None:
    def admitted(rendered: Rendered) -> set[str]:
        policy = rendered.get("NetworkPolicy", f"{RELEASE}-redis")
        return {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                for rule in policy["spec"]["ingress"] for p in rule["from"]}  # fmt: skip

    assert admitted(render(None)) == {"gateway", "cache", "scheduler"}
    assert admitted(render(TIERS_ON)) == {"gateway", "cache", "scheduler", "batch-runner", "nearline-worker"}


def test_bad_values_fail_the_install_naming_them(render: Any) -> None:
    with pytest.raises(Exception, match="batchRunner.files.url"):
        render({"batchRunner": {"enabled": True}})
    with pytest.raises(Exception, match="batchRunner.files.volume"):
        render({"batchRunner": {"enabled": True, "files": {"url": "/var/lib/aiworks/batch"}}})
    with pytest.raises(Exception, match="files.url"):  # neither S3 nor the shared folder (the schema's pattern)
        render({"batchRunner": {"enabled": True, "files": {"url": "/etc/passwd"}}})
    with pytest.raises(Exception, match="needs a Redis"):
        render({"nearlineWorker": {"enabled": True}, "redis": {"enabled": False}})


def test_s3_files_take_their_credentials_from_a_secret(render: Any) -> None:
    values = {"batchRunner": {"enabled": True, "files": {"url": "s3://jobs/aiworks", "credentialsSecret": "jobs-s3",
                                                         "env": [{"name": "AWS_ENDPOINT_URL_S3", "value": "https://s3"}]}}}  # fmt: skip
    on = render(values)
    for component in ("gateway", "batch-runner"):
        env = env_of(on, component)
        assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "jobs-s3", "key": "AWS_ACCESS_KEY_ID"}}
        assert env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "jobs-s3", "key": "AWS_SECRET_ACCESS_KEY"}}
        assert env["AWS_ENDPOINT_URL_S3"] == "https://s3"
        assert "batch-files" not in volumes_of(on, component)
    assert env_of(on, "gateway")["AIWORKS_GATEWAY_BATCH_FILES_URL"] == "s3://jobs/aiworks"


def test_in_the_mesh_workers_call_plain_http_and_are_authorized_to_infer_only(
    render: Any, all_features_values: dict[str, Any]
) -> None:
    """Istio's sidecars carry the mTLS; the gateway admits the workers' accounts to POST inferences, nothing else,
    and the ingress to the Batch API's routes."""
    values = copy.deepcopy(all_features_values)
    values["redis"] = {"enabled": True}
    mesh = render(values)
    for component, prefix in PREFIX.items():
        env = env_of(mesh, component)
        assert env[prefix + "GATEWAY_URL"] == f"http://{RELEASE}-gateway:8000"
        assert "gateway-ca" not in volumes_of(mesh, component)
    gateway = mesh.get("AuthorizationPolicy", f"{RELEASE}-gateway")["spec"]["rules"]
    principals = {c: f"cluster.local/ns/{RELEASE}/sa/{RELEASE}-{c}" for c in PREFIX}
    [workers] = [r for r in gateway if set(principals.values()) & set(r["from"][0]["source"]["principals"])]
    assert set(workers["from"][0]["source"]["principals"]) == set(principals.values())
    assert workers["to"] == [{"operation": {"ports": ["8000"], "methods": ["POST"], "paths": ["/v2/models/*"]}}]
    paths = {p for r in gateway for t in r["to"] for p in t["operation"].get("paths", [])}
    assert {"/v1/files", "/v1/files/*", "/v1/batches", "/v1/batches/*"} <= paths
    redis = mesh.get("AuthorizationPolicy", f"{RELEASE}-redis")["spec"]["rules"]
    assert set(principals.values()) <= {p for r in redis for p in r["from"][0]["source"]["principals"]}
    for component in PREFIX:  # each worker's own policy: only the scrapers, only /metrics
        [rule] = mesh.get("AuthorizationPolicy", f"{RELEASE}-{component}")["spec"]["rules"]
        assert rule["to"][0]["operation"]["paths"] == ["/metrics"]


def _hook(rendered: Rendered) -> tuple[list[str], list[str]]:
    """The install hook's arguments and the Secrets its Role may read and replace."""
    job = rendered.get("Job", f"{RELEASE}-setup")
    [hook] = job["spec"]["template"]["spec"]["containers"]
    role = rendered.get("Role", f"{RELEASE}-setup")
    return hook["args"], [n for rule in role["rules"] for n in rule.get("resourceNames", [])]


def test_the_tiers_credential_key_is_made_by_the_hook_and_read_by_the_gateway_and_the_tiers(render: Any) -> None:
    """Callers' credentials wait in Redis sealed (aiworks.security.sealing): the gateway seals, the tiers open,
    all with one key file from one Secret, which only they mount."""
    on = render(TIERS_ON)
    args, allowed = _hook(on)
    assert "--credential-key" in args and f"{RELEASE}-credential-key" in allowed
    variables = {"gateway": "AIWORKS_GATEWAY_", **PREFIX}
    for component, prefix in variables.items():
        assert env_of(on, component)[f"{prefix}CREDENTIAL_KEY_FILE"] == "/etc/aiworks/credential-key/credential-key"
        volume = volumes_of(on, component)["credential-key"]["secret"]
        assert volume["secretName"] == f"{RELEASE}-credential-key"
        assert volume["items"] == [{"key": "credential-key", "path": "credential-key"}]
        assert mounts_of(on, component)["credential-key"] == {
            "name": "credential-key", "mountPath": "/etc/aiworks/credential-key", "readOnly": True}  # fmt: skip
    others = [d for d in on.of_kind("Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"]
              not in variables]  # fmt: skip
    assert others and not any(v["name"] == "credential-key" for d in others for v in d["spec"]["template"]["spec"]["volumes"])
    # Off: nothing made, nothing mounted.
    off = render(None)
    assert "--credential-key" not in _hook(off)[0]
    assert "credential-key" not in volumes_of(off, "gateway")
    # An operator's own Secret: mounted instead, and the hook leaves it alone.
    own = render({**TIERS_ON, "credentialKey": {"existingSecret": "my-key"}})
    assert "--credential-key" not in _hook(own)[0]
    for component in variables:
        assert volumes_of(own, component)["credential-key"]["secret"]["secretName"] == "my-key"
