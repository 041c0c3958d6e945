"""The Helm chart, rendered and linted by the real Helm engine (helm-python-sdk)."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
import yaml

from .support import CHART, CONTRACT_PORTS, NAMESPACE, RELEASE, REPO, Rendered

SERVICES = ("gateway", "scheduler", "runtime", "cache", "monitor")
GRPC_SERVICES = ("scheduler", "runtime", "cache")


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def component(obj: dict[str, Any]) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("values_file", [None, "ci/all-features-values.yaml"])
def test_lint_passes_strict(values_file: str | None) -> None:
    values = yaml.safe_load((CHART / values_file).read_text()) if values_file else None
    report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE, kube_version="v1.27.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


def test_chart_renders_offline() -> None:
    """No dependencies to fetch and no cluster lookups: the render is hermetic."""
    metadata = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert "dependencies" not in metadata
    assert not (CHART / "Chart.lock").exists()
    for template in (CHART / "templates").rglob("*"):
        if template.is_file():
            text = template.read_text()
            assert not re.search(r"[({|]\s*lookup\s", text), f"{template} calls lookup"
            assert "http://" not in text.replace("http://{{", ""), f"{template} names a URL"


def test_one_template_and_values_block_per_service(chart: Any) -> None:
    templates = {p.name for p in (CHART / "templates").glob("*.yaml")}
    for service in SERVICES:
        assert f"{service}.yaml" in templates
        assert service in chart.values


def test_each_service_has_deployment_service_and_account(rendered: Rendered) -> None:
    for service in SERVICES:
        deployments = [d for d in rendered.of_kind("Deployment") if component(d) == service]
        services = [s for s in rendered.of_kind("Service") if component(s) == service]
        accounts = [a for a in rendered.of_kind("ServiceAccount") if component(a) == service]
        assert deployments and services and len(accounts) == 1, service
        for deployment in deployments:
            spec = deployment["spec"]["template"]["spec"]
            assert spec["serviceAccountName"] == accounts[0]["metadata"]["name"]


def test_services_select_pods_and_name_their_ports(rendered: Rendered) -> None:
    pods = [d["spec"]["template"] for d in rendered.of_kind("Deployment")]
    for service in rendered.of_kind("Service"):
        selected = [p for p in pods if selects(service["spec"]["selector"], p["metadata"]["labels"])]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        for pod in selected:
            names = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
            numbers = {p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in names
                assert port["port"] in numbers, "Service ports keep the contract's numbers"
                # Istio picks the protocol from appProtocol.
                assert port["appProtocol"] in {"grpc", "http"}


def test_containers_keep_the_image_entrypoint(rendered: Rendered) -> None:
    """The images run `aiworks <service>`; the chart may add flags, never a command."""
    for deployment in rendered.of_kind("Deployment"):
        for container in containers(deployment):
            assert "command" not in container
            assert all(arg.startswith("--") for arg in container.get("args", [])), container["args"]


def test_ports_follow_the_contract(rendered: Rendered) -> None:
    for deployment in rendered.of_kind("Deployment"):
        expected = set(CONTRACT_PORTS[component(deployment)].values())
        declared = {p["containerPort"] for c in containers(deployment) for p in c["ports"]}
        assert declared == expected, deployment["metadata"]["name"]


def test_probes_use_grpc_health(rendered: Rendered) -> None:
    for deployment in rendered.of_kind("Deployment"):
        service = component(deployment)
        [container] = containers(deployment)
        ports = CONTRACT_PORTS[service]
        if service in GRPC_SERVICES:
            for probe in ("readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"]["port"] == ports["grpc"], (service, probe)
        elif service == "gateway":
            assert container["livenessProbe"]["grpc"]["port"] == ports["grpc"]
            assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        else:
            assert container["readinessProbe"]["httpGet"]["port"] == "http"


def test_pods_are_hardened_and_sized(rendered: Rendered) -> None:
    for deployment in rendered.of_kind("Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert {"cpu", "memory"} <= set(container["resources"]["limits"])


def test_services_get_their_peers_and_settings(rendered: Rendered) -> None:
    scheduler = f"{RELEASE}-scheduler:8010"
    by_component = {component(d): env_of(containers(d)[0]) for d in rendered.of_kind("Deployment")}
    gateway = by_component["gateway"]
    assert gateway["AIWORKS_GATEWAY_HTTP_PORT"] == "8000"
    assert gateway["AIWORKS_GATEWAY_SCHEDULER_ADDRESS"] == scheduler
    assert gateway["AIWORKS_GATEWAY_CACHE_ADDRESS"] == f"{RELEASE}-cache:8030"
    runtime = by_component["runtime"]
    assert runtime["AIWORKS_RUNTIME_SCHEDULER_ADDRESS"] == scheduler
    assert runtime["AIWORKS_RUNTIME_MODEL_REPOSITORY"] == "/models"
    assert runtime["AIWORKS_RUNTIME_REPLICA_ID"] == "$(POD_NAME)"
    assert runtime["AIWORKS_RUNTIME_ADVERTISE_ADDRESS"].endswith(":8020")
    assert by_component["monitor"]["AIWORKS_MONITOR_PROMETHEUS_URL"].startswith("http")
    names = {s["metadata"]["name"] for s in rendered.of_kind("Service")}
    assert scheduler.split(":")[0] in names and f"{RELEASE}-cache" in names


def test_runtime_pools_have_version_tracks(full: Rendered) -> None:
    deployments = {d["metadata"]["name"]: d for d in full.of_kind("Deployment") if component(d) == "runtime"}
    assert set(deployments) == {
        f"{RELEASE}-runtime-{model}-{track}" for model in ("iris", "digits") for track in ("stable", "canary")
    }
    for name, deployment in deployments.items():
        track = name.rsplit("-", 1)[1]
        assert deployment["metadata"]["labels"]["version"] == track
        assert deployment["spec"]["selector"]["matchLabels"]["version"] == track
        assert deployment["spec"]["template"]["metadata"]["labels"]["version"] == track
        image = containers(deployment)[0]["image"]
        assert image.startswith("registry.example.com/aiworks/model-runtime:")
        assert image.endswith(":0.2.0" if track == "canary" else ":0.1.0")
    # One Service per pool, over both tracks.
    pool = full.get("Service", f"{RELEASE}-runtime-iris")
    assert "version" not in pool["spec"]["selector"]
    assert pool["spec"]["selector"]["aiworks.io/model"] == "iris"


def test_hpa_on_cpu_and_custom_metrics(full: Rendered) -> None:
    deployments = full.names("Deployment")
    for hpa in full.of_kind("HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]["name"]
        assert target in deployments
        assert "replicas" not in full.get("Deployment", target)["spec"], "the HPA owns replicas"
        metrics = hpa["spec"]["metrics"]
        assert metrics[0]["resource"]["name"] == "cpu"
        if component(hpa) == "runtime":
            external = {m["external"]["metric"]["name"]: m["external"] for m in metrics[1:]}
            assert set(external) == {"aiworks_scheduler_queue_depth", "aiworks_request_latency_p99_seconds"}
            model = hpa["metadata"]["labels"]["aiworks.io/model"]
            for metric in external.values():
                assert metric["metric"]["selector"]["matchLabels"] == {"model": model}
    assert {component(h) for h in full.of_kind("HorizontalPodAutoscaler")} == {"gateway", "runtime", "cache"}


def test_disruption_budgets_cover_pods(rendered: Rendered) -> None:
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in rendered.of_kind("Deployment")]
    budgets = rendered.of_kind("PodDisruptionBudget")
    assert budgets
    for pdb in budgets:
        assert any(selects(pdb["spec"]["selector"]["matchLabels"], labels) for labels in pods)


def test_config_map_holds_no_secrets_and_secrets_are_referenced(full: Rendered) -> None:
    assert not full.of_kind("Secret"), "the chart references existing Secrets and creates none"
    config = full.get("ConfigMap", f"{RELEASE}-config")
    assert {"tenants.yaml", "models.yaml", "iris.config.pbtxt"} <= set(config["data"])
    models = yaml.safe_load(config["data"]["models.yaml"])["models"]
    weights = {m["name"]: m["tracks"]["canary"]["weight"] for m in models}
    assert weights == {"iris": 20, "digits": 5}
    text = yaml.safe_dump(config["data"]).lower()
    assert "password" not in text and "apikey" not in text.replace("_", "")
    cache = env_of(containers(full.get("Deployment", f"{RELEASE}-cache"))[0])
    assert cache["AIWORKS_CACHE_REDIS_URL"] == {"secretKeyRef": {"name": "aiworks-redis", "key": "redis-url"}}
    gateway = full.get("Deployment", f"{RELEASE}-gateway")["spec"]["template"]["spec"]
    secrets = [v["secret"]["secretName"] for v in gateway["volumes"] if "secret" in v]
    assert secrets == ["aiworks-api-keys"]


def test_monitor_may_manage_only_its_namespace(rendered: Rendered) -> None:
    assert not rendered.of_kind("ClusterRole") and not rendered.of_kind("ClusterRoleBinding")
    role = rendered.get("Role", f"{RELEASE}-monitor")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "*" not in verbs and "create" not in verbs


def test_chart_test_hook(rendered: Rendered) -> None:
    hooks = [p for p in rendered.of_kind("Pod") if p["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    assert len(hooks) == 1
    command = "\n".join(hooks[0]["spec"]["containers"][0]["command"])
    assert f"http://{RELEASE}-gateway:8000/v2/health/ready" in command


def test_monitoring_objects(full: Rendered) -> None:
    [monitor] = full.of_kind("ServiceMonitor")
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http-metrics" and endpoint["scheme"] == "https"
    metrics_ports = [p for s in full.of_kind("Service") for p in s["spec"]["ports"] if p["name"] == "http-metrics"]
    assert len(metrics_ports) == len(full.of_kind("Service"))
    rules_on_disk = []
    for path in sorted((REPO / "deploy" / "prometheus" / "rules").glob("*.yml")):
        rules_on_disk += yaml.safe_load(path.read_text())["groups"]
    [rule] = full.of_kind("PrometheusRule")
    assert rule["spec"]["groups"] == rules_on_disk
    dashboards = sorted((REPO / "deploy" / "grafana" / "dashboards").glob("*.json"))
    maps = [c for c in full.of_kind("ConfigMap") if c["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert len(maps) == len(dashboards)


def test_istio_objects_only_behind_the_flag(render: Any) -> None:
    default = render(None)
    assert not [o for o in default.objects if "istio.io" in o["apiVersion"]]
    assert not [o for o in default.objects if "coreos.com" in o["apiVersion"]]


def test_notes_name_the_entry_points(rendered: Rendered) -> None:
    assert f"svc/{RELEASE}-gateway 8000:8000" in rendered.notes
    assert f"helm test {RELEASE}" in rendered.notes
