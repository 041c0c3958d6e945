"""The Helm chart, rendered and linted by the real Helm engine (helm-python-sdk)."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
import yaml

from .support import CHART, CONTRACT_PORTS, NAMESPACE, RELEASE, REPO, TIER_COMMANDS, TIER_PORTS, Rendered

SERVICES = ("gateway", "scheduler", "runtime", "cache", "monitor")
TIERS = tuple(TIER_PORTS)  # the batch runner and the nearline worker: the tiers image, off by default
GRPC_SERVICES = ("scheduler", "runtime", "cache")


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def component(obj: dict[str, Any]) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("values_file", [None, *sorted(f"ci/{p.name}" for p in (CHART / "ci").glob("*-values.yaml"))])
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
        # Several schedulers are a StatefulSet (ci/scheduler-ha-values.yaml), one is a Deployment.
        deployments = [d for d in rendered.of_kind("Deployment") + rendered.of_kind("StatefulSet")
                       if component(d) == service]  # fmt: skip
        services = [s for s in rendered.of_kind("Service") if component(s) == service]
        accounts = [a for a in rendered.of_kind("ServiceAccount") if component(a) == service]
        assert deployments and services and len(accounts) == 1, service
        for deployment in deployments:
            spec = deployment["spec"]["template"]["spec"]
            assert spec["serviceAccountName"] == accounts[0]["metadata"]["name"]


def workloads(rendered: Rendered) -> list[dict[str, Any]]:
    return rendered.of_kind("Deployment") + rendered.of_kind("StatefulSet")


def test_services_select_pods_and_name_their_ports(rendered: Rendered) -> None:
    pods = [d["spec"]["template"] for d in workloads(rendered)]
    tls = any("AIWORKS_GATEWAY_TLS_CERT" in env_of(c) for d in rendered.of_kind("Deployment") for c in containers(d))
    for service in rendered.of_kind("Service"):
        selected = [p for p in pods if selects(service["spec"]["selector"], p["metadata"]["labels"])]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        for pod in selected:
            names = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
            numbers = {p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in names
                assert port["port"] in numbers, "Service ports keep the contract's numbers"
                # Istio picks the protocol from appProtocol; the gateway's HTTP port is HTTPS with the release's TLS.
                expected = {"grpc", "http", "redis"} | ({"https"} if tls and port["name"] == "http" else set())
                assert port["appProtocol"] in expected, (service["metadata"]["name"], port)


def test_containers_keep_the_image_entrypoint(rendered: Rendered) -> None:
    """The images run `aiworks <service>`; the chart may add flags, never a command. The tiers image runs
    `aiworks`: its role's words come first."""
    for deployment in rendered.of_kind("Deployment"):
        role = TIER_COMMANDS.get(component(deployment), [])
        for container in containers(deployment):
            assert "command" not in container
            args = container.get("args", [])
            assert args[: len(role)] == role, args
            assert all(arg.startswith("--") or args[i - 1].startswith("--") for i, arg in enumerate(args)
                       if i >= len(role)), args  # fmt: skip


def test_ports_follow_the_contract(rendered: Rendered) -> None:
    for deployment in rendered.of_kind("Deployment"):
        expected = set({**CONTRACT_PORTS, **TIER_PORTS}[component(deployment)].values())
        declared = {p["containerPort"] for c in containers(deployment) for p in c["ports"]}
        assert declared == expected, deployment["metadata"]["name"]


def test_probes_use_grpc_health(rendered: Rendered) -> None:
    """gRPC health on every gRPC service: the kubelet's probe in the mesh, and with the services' own
    mutual TLS (which the kubelet's plaintext probe cannot pass) `aiworks probe <service>`, with the pod's certificate."""
    for deployment in rendered.of_kind("Deployment"):
        service = component(deployment)
        [container] = containers(deployment)
        if service in TIERS:  # they serve only /metrics
            assert container["readinessProbe"]["httpGet"] == container["livenessProbe"]["httpGet"] == {
                "path": "/metrics", "port": "metrics"}
            continue
        ports = CONTRACT_PORTS[service]
        tls = f"AIWORKS_{service.upper()}_TLS_CERT" in env_of(container)
        if service in GRPC_SERVICES:
            ready, live = container["readinessProbe"], container["livenessProbe"]
            if tls:
                assert ready["exec"]["command"] == ["aiworks", "probe", "--quiet", service]
                assert live["tcpSocket"]["port"] == ports["grpc"]
            else:
                assert ready["grpc"]["port"] == live["grpc"]["port"] == ports["grpc"], service
            if service == "runtime" and not tls:
                # Alive while its model loads (or fails to); ready only once it has.
                assert live["grpc"]["service"] == "aiworks.runtime.v1.RuntimeService"
                assert "service" not in ready["grpc"]
        elif service == "gateway":
            ready = container["readinessProbe"]["httpGet"]
            assert ready["path"] == "/v2/health/ready" and ready["scheme"] == ("HTTPS" if tls else "HTTP")
            live = container["livenessProbe"]
            assert (live["tcpSocket"]["port"] == "grpc") if tls else (live["grpc"]["port"] == ports["grpc"])
        else:
            assert container["readinessProbe"]["httpGet"]["port"] == "http"


def test_pods_are_hardened_and_sized(rendered: Rendered) -> None:
    jobs = [j for j in rendered.of_kind("Job")]
    for workload in workloads(rendered) + jobs:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        # <SVC>_PORT=tcp://... service links would override AIWORKS_<SVC>_PORT settings.
        assert pod["enableServiceLinks"] is False, workload["metadata"]["name"]
        for container in pod["containers"] + pod.get("initContainers", []):
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert {"cpu", "memory"} <= set(container["resources"]["limits"])


def scheduler_addresses(rendered: Rendered) -> str:
    """What runtimes and gateways dial: the scheduler Service, or with several each StatefulSet pod by name."""
    sets = [s for s in rendered.of_kind("StatefulSet") if component(s) == "scheduler"]
    if not sets:
        return f"{RELEASE}-scheduler:8010"
    return ",".join(f"{RELEASE}-scheduler-{i}.{RELEASE}-scheduler-headless.{NAMESPACE}.svc:8010"
                    for i in range(int(sets[0]["spec"]["replicas"])))  # fmt: skip


def test_services_get_their_peers_and_settings(rendered: Rendered) -> None:
    scheduler = scheduler_addresses(rendered)
    workloads = rendered.of_kind("Deployment") + [s for s in rendered.of_kind("StatefulSet") if component(s) in SERVICES]
    by_component = {component(d): env_of(containers(d)[0]) for d in workloads if component(d) in SERVICES}
    gateway = by_component["gateway"]
    assert gateway["AIWORKS_GATEWAY_HTTP_PORT"] == "8000"
    assert gateway["AIWORKS_GATEWAY_SCHEDULER_ADDRESS"] == scheduler
    assert gateway["AIWORKS_GATEWAY_CACHE_ADDRESS"] == f"{RELEASE}-cache:8030"
    # A stopping gateway serves while not ready (drain), then gives running requests their grace, then
    # flushes usage and audit lines: Kubernetes must not kill it first.
    from aiworks.gateway.settings import GatewaySettings

    drain = float(gateway["AIWORKS_GATEWAY_DRAIN_S"])
    grace = GatewaySettings.model_fields["shutdown_grace_s"].default
    [gateway_deployment] = [d for d in workloads if component(d) == "gateway"]
    assert drain >= 5 and gateway_deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + grace + 10
    runtime = by_component["runtime"]
    assert runtime["AIWORKS_RUNTIME_SCHEDULER_ADDRESS"] == scheduler
    assert runtime["AIWORKS_RUNTIME_MODEL_REPOSITORY"] == "/models"
    assert runtime["AIWORKS_RUNTIME_REPLICA_ID"] == "$(POD_NAME)"
    assert runtime["AIWORKS_RUNTIME_ADVERTISE_ADDRESS"].endswith(":8020")
    # A stopping runtime finishes the streams and generations it holds (its drain) and then closes its port
    # with at most 5 s of grace: Kubernetes must not kill it first.
    runtime_drain = float(runtime["AIWORKS_RUNTIME_DRAIN_S"])
    for pool in (d for d in workloads if component(d) == "runtime"):
        assert runtime_drain >= 20 and pool["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= runtime_drain + 10
    assert by_component["monitor"]["AIWORKS_MONITOR_PROMETHEUS_URL"].startswith("http")
    names = {s["metadata"]["name"] for s in rendered.of_kind("Service")}
    assert f"{RELEASE}-scheduler" in names and f"{RELEASE}-cache" in names
    for service, env in by_component.items():
        # Every service names itself to the tracing backend the standard way.
        assert env["OTEL_SERVICE_NAME"] == f"aiworks-{service}"
        assert f"service.namespace={RELEASE}" in env["OTEL_RESOURCE_ATTRIBUTES"]
        # Internal servers refuse a non-loopback bind without one of these: the chart always sets one.
        prefix = f"AIWORKS_{service.upper()}_"
        assert {prefix + "TLS_CERT", prefix + "MESH_MTLS"} & set(env), service
        assert prefix + "INSECURE" not in env, "never the chart's default"


def test_default_install_wires_shared_state_and_tls(render: Any) -> None:
    """Redis behind limits, usage and the cache; certificates from the install hook; the first API key."""
    default = render(None)
    env = {component(d): env_of(containers(d)[0]) for d in default.of_kind("Deployment")}
    redis_url = {"secretKeyRef": {"name": f"{RELEASE}-redis", "key": "redis-url"}}
    assert env["gateway"]["AIWORKS_GATEWAY_REDIS_URL"] == redis_url
    assert env["cache"]["AIWORKS_CACHE_REDIS_URL"] == redis_url
    assert env["gateway"]["AIWORKS_GATEWAY_LIMITS_EXPECTED_REPLICAS"] == "10", "the HPA's most gateways"
    assert env["gateway"]["AIWORKS_GATEWAY_API_KEYS_FILE"] == "/etc/aiworks/keys/api-keys.yaml"
    [redis] = default.of_kind("StatefulSet")
    assert "--aclfile" in containers(redis)[0]["args"], "the password is in a file, not on the command line"
    [hook] = default.of_kind("Job")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    args = hook["spec"]["template"]["spec"]["containers"][0]["args"]
    identities = {a.split("=")[0] for a in args[1:] if "=" in a and not a.startswith("app.")}
    assert identities >= {"gateway", "scheduler", "runtime", "cache", "monitor", "admin"}
    assert args[args.index("--api-key-tenant") + 1] == "default"
    assert args[args.index("--redis-host") + 1] == f"{RELEASE}-redis:6379"
    role = default.get("Role", f"{RELEASE}-setup")
    assert {v for r in role["rules"] for v in r["verbs"]} == {"create", "get", "update"}
    assert all(r["resources"] == ["secrets"] for r in role["rules"])
    for deployment in default.of_kind("Deployment"):
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == f"{RELEASE}-{component(deployment)}-tls"
    notes = default.notes
    assert f"get secret {RELEASE}-api-keys -o jsonpath='{{.data.api-key}}'" in notes
    [headless] = [s for s in default.of_kind("Service") if s["metadata"]["name"] == f"{RELEASE}-scheduler-headless"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True


def test_auth_modes(render: Any) -> None:
    demo = render({"auth": {"mode": "demo"}})
    gateway = env_of(containers(demo.get("Deployment", f"{RELEASE}-gateway"))[0])
    assert "AIWORKS_GATEWAY_TENANTS_FILE" not in gateway and "AIWORKS_GATEWAY_API_KEYS_FILE" not in gateway
    assert "--api-key-tenant" not in demo.get("Job", f"{RELEASE}-setup")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "auth.mode=demo" in demo.notes
    jwt = render({"auth": {"mode": "jwt", "jwt": {"keySecret": "idp-key", "keySecretKey": "key.pem", "issuer": "https://idp"}},
                  "config": {"tenants": []}})
    gateway = jwt.get("Deployment", f"{RELEASE}-gateway")
    env = env_of(containers(gateway)[0])
    assert env["AIWORKS_GATEWAY_JWT_KEY_FILE"] == "/etc/aiworks/jwt/key.pem"
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert volumes["jwt-key"]["secret"] == {"secretName": "idp-key", "items": [{"key": "key.pem", "path": "key.pem"}]}
    tenants = yaml.safe_load(jwt.get("ConfigMap", f"{RELEASE}-config")["data"]["tenants.yaml"])
    # Emptied tenants: one tenant with no limits, never an empty file the gateway would refuse.
    assert tenants["tenants"] == [{"name": "default", "models": ["*"]}]
    assert tenants["jwt"] == {"algorithms": ["RS256"], "issuer": "https://idp", "tenant_claim": "tenant", "leeway_s": 10}
    with pytest.raises(Exception, match="keySecret"):
        render({"auth": {"mode": "jwt"}})
    with pytest.raises(Exception, match="generatedKeyTenant"):
        render({"auth": {"keys": {"generatedKeyTenant": "nobody"}}})


def test_storage_initializer_fetches_each_pool(full: Rendered) -> None:
    for deployment in full.of_kind("Deployment"):
        if component(deployment) != "runtime":
            continue
        pod = deployment["spec"]["template"]["spec"]
        [init] = pod["initContainers"]
        model = deployment["metadata"]["labels"]["aiworks.io/model"]
        assert init["command"] == ["aiworks", "storage", "fetch"]
        uri = {"iris": "pvc://aiworks-models/iris", "digits": "s3://aiworks-models/digits"}[model]
        assert init["args"][:5] == [uri, "--model", model, "--repository", "/models"]
        assert init["envFrom"] == [{"secretRef": {"name": "aiworks-model-store"}}]
        assert init["image"] == containers(deployment)[0]["image"], "the track's own image fetches"
        mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
        assert "readOnly" not in mounts["/models"] and mounts["/mnt/pvc/aiworks-models"]["readOnly"]
        runtime_mounts = {m["mountPath"]: m for m in containers(deployment)[0]["volumeMounts"]}
        assert runtime_mounts["/models"]["readOnly"] is True


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
    assert set(config["data"]) == {"tenants.yaml", "iris.config.pbtxt"}, "no models.yaml: no setting reads one"
    tenants = yaml.safe_load(config["data"]["tenants.yaml"])["tenants"]
    assert [t["name"] for t in tenants] == ["default", "research"]
    text = yaml.safe_dump(config["data"]).lower()
    assert "password" not in text and "apikey" not in text.replace("_", "")
    cache = env_of(containers(full.get("Deployment", f"{RELEASE}-cache"))[0])
    assert cache["AIWORKS_CACHE_REDIS_URL"] == {"secretKeyRef": {"name": "aiworks-redis", "key": "redis-url"}}
    gateway = full.get("Deployment", f"{RELEASE}-gateway")["spec"]["template"]["spec"]
    secrets = [v["secret"]["secretName"] for v in gateway["volumes"] if "secret" in v]
    # The API keys' hashes, and the tiers' credential key (full turns the tiers on), which the hook makes.
    assert secrets == ["aiworks-api-keys", "aiworks-credential-key"]


def test_monitor_may_manage_only_its_namespace(rendered: Rendered) -> None:
    assert not rendered.of_kind("ClusterRole") and not rendered.of_kind("ClusterRoleBinding")
    role = rendered.get("Role", f"{RELEASE}-monitor")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "*" not in verbs and "create" not in verbs


def test_chart_test_hook(rendered: Rendered) -> None:
    hooks = [p for p in rendered.of_kind("Pod") if p["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    assert len(hooks) == 1
    pod = hooks[0]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["aiworks", "kube", "check"]
    args = container["args"]
    assert args[args.index("--gateway-url") + 1].endswith(f"://{RELEASE}-gateway:8000")
    assert args[args.index("--scheduler-address") + 1] == f"{RELEASE}-scheduler:8010"
    pools = {d["metadata"]["labels"]["aiworks.io/model"] for d in rendered.of_kind("Deployment") if component(d) == "runtime"}
    assert {args[i + 1] for i, a in enumerate(args) if a == "--model"} == pools, "every pool's model must be ready"
    assert pod["serviceAccountName"] == f"{RELEASE}-admin"


def test_monitoring_objects(full: Rendered) -> None:
    [monitor] = full.of_kind("ServiceMonitor")
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http-metrics" and endpoint["scheme"] == "https"
    # One Service exposes each workload's metrics: the ServiceMonitor selects all of them, so a second
    # (the scheduler's headless one) would scrape it twice.
    scraped = {s["metadata"]["name"] for s in full.of_kind("Service") if any(p["name"] == "http-metrics" for p in s["spec"]["ports"])}
    suite = {s["metadata"]["name"] for s in full.of_kind("Service") if component(s) in SERVICES + TIERS}
    assert {f"{RELEASE}-{tier}" for tier in TIERS} <= suite, "every feature on: the tiers are scraped too"
    assert scraped == suite - {f"{RELEASE}-scheduler-headless"}
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


def test_audit_sinks(render: Any) -> None:
    """File: one file per pod in the audit volume. Redis: the pod's chain, named after it, in the release's Redis."""
    files = render({"gateway": {"audit": {"enabled": True}}}).get("Deployment", f"{RELEASE}-gateway")
    env = env_of(containers(files)[0])
    assert env["AIWORKS_GATEWAY_AUDIT_LOG"] == "/var/log/aiworks/audit/$(POD_NAME).jsonl"
    assert "audit" in {v["name"] for v in files["spec"]["template"]["spec"]["volumes"]}
    stream = render({"gateway": {"audit": {"enabled": True, "sink": "redis"}}}).get("Deployment", f"{RELEASE}-gateway")
    env = env_of(containers(stream)[0])
    assert (env["AIWORKS_GATEWAY_AUDIT_SINK"], env["AIWORKS_GATEWAY_AUDIT_WRITER"]) == ("redis", "$(POD_NAME)")
    assert "AIWORKS_GATEWAY_AUDIT_LOG" not in env and "AIWORKS_GATEWAY_REDIS_URL" in env
    assert "audit" not in {v["name"] for v in stream["spec"]["template"]["spec"]["volumes"]}
    with pytest.raises(Exception, match="needs a Redis"):
        render({"gateway": {"audit": {"enabled": True, "sink": "redis"}}, "redis": {"enabled": False}})
    with pytest.raises(Exception, match="sink"):
        render({"gateway": {"audit": {"enabled": True, "sink": "kafka"}}})


def test_in_the_mesh_the_sidecar_outlives_the_drains(render: Any) -> None:
    """Istio stops a pod's sidecar 5 s after SIGTERM by default, which would cut a gateway's or a runtime's
    drain short: their pods tell the sidecar to stay for the container's own stop and to leave once no
    connection is open (pilot-agent's EXIT_ON_ZERO_ACTIVE_CONNECTIONS)."""

    def proxy_configs(rendered: Rendered) -> dict[str, str]:
        found = {}
        for d in (o for o in rendered.objects if o["kind"] == "Deployment"):
            annotations = d["spec"]["template"]["metadata"].get("annotations") or {}
            if "proxy.istio.io/config" in annotations:
                found[component(d)] = annotations["proxy.istio.io/config"]
        return found

    assert proxy_configs(render(None)) == {}  # no mesh, no annotation
    meshed = proxy_configs(render({"istio": {"enabled": True}, "gateway": {"drainSeconds": 7}, "runtime": {"drainSeconds": 40}}))
    assert set(meshed) == {"gateway", "runtime"}, meshed
    assert yaml.safe_load(meshed["gateway"]) == {
        "terminationDrainDuration": "12s", "proxyMetadata": {"EXIT_ON_ZERO_ACTIVE_CONNECTIONS": "true"}
    }  # fmt: skip
    assert yaml.safe_load(meshed["runtime"])["terminationDrainDuration"] == "45s"
    own = {"istio": {"enabled": True}, "gateway": {"podAnnotations": {"proxy.istio.io/config": "concurrency: 2"}}}
    assert proxy_configs(render(own))["gateway"] == "concurrency: 2"  # the operator's own config is kept as it is
