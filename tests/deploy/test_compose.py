"""docker-compose.yml as Docker Compose loads it (the real compose engine, no
Docker daemon), and the Prometheus and Grafana files it mounts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .support import CONTRACT_PORTS, REPO, SERVICE_FOLDERS, TIER_COMMANDS, TIER_PORTS

SUITE = {
    "gateway": "gateway",
    "scheduler": "scheduler",
    "runtime-1": "runtime",
    "runtime-2": "runtime",
    "cache": "cache",
    "monitor": "monitor",
}
# The tiers: one image (services/tiers), two roles.
TIERS = {"batch-runner": "batch-runner", "nearline-worker": "nearline-worker"}
INFRA = {"redis", "prometheus", "grafana", "envoy"}
# One-shot jobs -> the image they run.
ONE_SHOT = {"certs": "gateway", "models": "runtime", "gateway-ca": "gateway"}


def services(project: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return project["services"]


def test_every_service_is_there(compose_project: dict[str, Any]) -> None:
    assert set(services(compose_project)) == set(SUITE) | set(TIERS) | INFRA | set(ONE_SHOT)


def test_suite_images_build_from_the_service_dockerfiles(compose_project: dict[str, Any]) -> None:
    for name, service in services(compose_project).items():
        component = SUITE.get(name, ONE_SHOT.get(name))
        if name in TIERS:
            assert service["build"]["dockerfile"] == "services/tiers/Dockerfile", name
            assert service["command"] == TIER_COMMANDS[name], "the tiers image runs `aiworks`: the role comes first"
            continue
        if component is None:
            assert ":" in service["image"] and not service["image"].endswith(":latest"), name
            continue
        build = service["build"]
        assert Path(build["context"]) == REPO, "the build context is the repository root"
        assert build["dockerfile"] == f"services/{SERVICE_FOLDERS[component]}/Dockerfile"
        assert (REPO / build["dockerfile"]).is_file()


def test_every_mounted_file_exists(compose_project: dict[str, Any]) -> None:
    binds = [
        (name, mount)
        for name, service in services(compose_project).items()
        for mount in service.get("volumes", [])
        if mount["type"] == "bind"
    ]
    assert binds
    for name, mount in binds:
        source = Path(mount["source"])
        assert mount.get("read_only"), f"{name} mounts {source} writable"
        assert source.exists(), f"{name} mounts missing {source}"
        assert REPO in source.parents


def test_only_the_edge_is_published(compose_project: dict[str, Any]) -> None:
    published = {name: s["ports"] for name, s in services(compose_project).items() if s.get("ports")}
    assert set(published) == {"envoy", "grafana"}
    [grafana] = published["grafana"]
    assert grafana["host_ip"] == "127.0.0.1"
    [envoy] = published["envoy"]
    listener = yaml.safe_load((REPO / "mesh" / "envoy" / "envoy.yaml").read_text())["static_resources"]["listeners"][0]
    assert envoy["target"] == listener["address"]["socket_address"]["port_value"]


def test_healthchecks_and_ordered_start(compose_project: dict[str, Any]) -> None:
    project = services(compose_project)
    for name, service in project.items():
        if name not in ONE_SHOT:
            assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dependency, condition in service.get("depends_on", {}).items():
            if dependency in ONE_SHOT:
                assert condition["condition"] == "service_completed_successfully"
            else:
                assert condition["condition"] == "service_healthy", (name, dependency)
                assert project[dependency].get("healthcheck"), dependency
    assert set(project["gateway"]["depends_on"]) >= {"scheduler", "cache"}
    assert set(project["envoy"]["depends_on"]) >= {"gateway", "certs"}
    assert set(project["cache"]["depends_on"]) == {"redis", "certs"}


def test_ports_agree_across_env_expose_and_healthchecks(compose_project: dict[str, Any]) -> None:
    for name, component in SUITE.items():
        service = services(compose_project)[name]
        ports = {str(p) for p in CONTRACT_PORTS[component].values()}
        assert set(service["expose"]) == ports, name
        prefix = f"AIWORKS_{component.upper()}_"
        env_ports = {v for k, v in service["environment"].items() if k.startswith(prefix) and k.endswith("_PORT")}
        assert env_ports == ports, name
        # The probe dials 127.0.0.1 on the port of the environment checked above, over the service's TLS.
        assert service["healthcheck"]["test"] == ["CMD", "aiworks", "probe", "--quiet", component], name
        assert service["read_only"] and service["cap_drop"] == ["ALL"]


def test_runtimes_advertise_themselves(compose_project: dict[str, Any]) -> None:
    for name in ("runtime-1", "runtime-2"):
        env = services(compose_project)[name]["environment"]
        assert env["AIWORKS_RUNTIME_ADVERTISE_ADDRESS"] == f"{name}:8020"
        assert env["AIWORKS_RUNTIME_REPLICA_ID"] == name
        assert env["AIWORKS_RUNTIME_SCHEDULER_ADDRESS"] == "scheduler:8010"
        [models] = [v for v in services(compose_project)[name]["volumes"] if v["target"] == "/models"]
        assert models["read_only"] and models["source"] == "model-repository"
        assert env["AIWORKS_RUNTIME_MODEL_REPOSITORY"].startswith("/models/")


def test_models_job_fills_the_runtimes_repository(compose_project: dict[str, Any]) -> None:
    job = services(compose_project)["models"]
    [volume] = job["volumes"]
    assert (volume["source"], volume["target"]) == ("model-repository", "/models")
    out = job["command"][job["command"].index("--out") + 1]
    assert job["entrypoint"] == ["aiworks", "demo-models"]
    for name in ("runtime-1", "runtime-2"):
        assert services(compose_project)[name]["environment"]["AIWORKS_RUNTIME_MODEL_REPOSITORY"] == out


def test_every_internal_hop_is_mutual_tls_with_the_jobs_certificates(compose_project: dict[str, Any]) -> None:
    """Services bind 0.0.0.0 in their containers, so each needs its certificate (they refuse to start without)."""
    project = services(compose_project)
    job = project["certs"]["command"]
    out_dir = job[job.index("--out-dir") + 1]
    issued = set(job[job.index("--services") + 1].split(","))
    assert issued >= set(SUITE.values()) | {"admin"}
    [job_mount] = [m for m in project["certs"]["volumes"] if m["target"] == out_dir]
    for name, component in SUITE.items():
        service = project[name]
        env = service["environment"]
        prefix = f"AIWORKS_{component.upper()}_"
        assert env[f"{prefix}HOST"] == "0.0.0.0"
        assert not {f"{prefix}INSECURE", f"{prefix}MESH_MTLS"} & set(env), name
        [mount] = [m for m in service["volumes"] if m["source"] == job_mount["source"]]
        assert mount["read_only"], name
        for key, file in (("TLS_CERT", "tls.crt"), ("TLS_KEY", "tls.key"), ("TLS_CA", "ca.crt")):
            assert env[prefix + key] == f"{mount['target']}/{component}/{file}", (name, key)
        assert project[name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    token = job[job.index("--internal-token") + 1]
    monitor = project["monitor"]
    [mount] = [m for m in monitor["volumes"] if m["source"] == job_mount["source"]]
    assert monitor["environment"]["AIWORKS_MONITOR_INTERNAL_TOKEN_FILE"] == token.replace(out_dir, mount["target"])
    # Only the suite and Envoy see the keys (and the job that copies the CA's certificate out, for the tiers).
    readers = {n for n, svc in project.items() for m in svc.get("volumes", []) if m["source"] == job_mount["source"]}
    assert readers == set(SUITE) | {"envoy", "certs", "gateway-ca"}


def test_envoy_reaches_the_gateway_over_tls_checked_against_the_ca(compose_project: dict[str, Any]) -> None:
    config = yaml.safe_load((REPO / "mesh" / "envoy" / "envoy.yaml").read_text())
    envoy_mounts = {m["target"]: m for m in services(compose_project)["envoy"]["volumes"]}
    for cluster in config["static_resources"]["clusters"]:
        if not cluster["name"].startswith("gateway_"):
            continue
        tls = cluster["transport_socket"]["typed_config"]
        assert tls["sni"] == "gateway"
        validation = tls["common_tls_context"]["validation_context"]
        ca = Path(validation["trusted_ca"]["filename"])
        assert str(ca.parent) in envoy_mounts and ca.name == "ca.crt"
        assert validation["match_typed_subject_alt_names"] == [{"san_type": "DNS", "matcher": {"exact": "gateway"}}]


def test_envoy_reads_the_certs_the_job_writes(compose_project: dict[str, Any]) -> None:
    project = services(compose_project)
    envoy_mounts = {m["target"]: m for m in project["envoy"]["volumes"]}
    certs_mounts = {m["source"]: m for m in project["certs"]["volumes"]}
    listener = yaml.safe_load((REPO / "mesh" / "envoy" / "envoy.yaml").read_text())["static_resources"]["listeners"][0]
    tls = listener["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"]
    [certificate] = tls["tls_certificates"]
    folder = str(Path(certificate["certificate_chain"]["filename"]).parent)
    assert envoy_mounts[folder]["type"] == "volume"
    assert envoy_mounts[folder]["source"] in certs_mounts
    assert project["envoy"]["user"] == project["certs"].get("user", "10001:10001")
    assert "/etc/envoy/envoy.yaml" in envoy_mounts


def mount_target(service: dict[str, Any], source: Path) -> str:
    [mount] = [m for m in service["volumes"] if m["type"] == "bind" and Path(m["source"]) == source]
    return mount["target"]


def test_prometheus_scrapes_every_metrics_port(compose_project: dict[str, Any]) -> None:
    project = services(compose_project)
    config_path = REPO / "deploy" / "prometheus" / "prometheus.yml"
    config = yaml.safe_load(config_path.read_text())
    assert mount_target(project["prometheus"], config_path) == "/etc/prometheus/prometheus.yml"
    rules_target = mount_target(project["prometheus"], REPO / "deploy" / "prometheus" / "rules")
    assert config["rule_files"] == [f"{rules_target}/*.yml"]
    targets = {t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]}
    for target in targets - {"localhost:9090"}:
        host, port = target.split(":")
        assert port in project[host]["expose"], target
    for name, component in SUITE.items():
        assert f"{name}:{CONTRACT_PORTS[component]['metrics']}" in targets
    for name in TIERS:
        assert f"{name}:{TIER_PORTS[name]['metrics']}" in targets


def test_rules_files_are_valid_rule_groups() -> None:
    files = sorted((REPO / "deploy" / "prometheus" / "rules").glob("*.yml"))
    assert files
    for path in files:
        groups = yaml.safe_load(path.read_text())["groups"]
        assert len({g["name"] for g in groups}) == len(groups)
        for group in groups:
            for rule in group["rules"]:
                assert ("record" in rule) != ("alert" in rule) and rule["expr"].strip(), (path, rule)


def test_grafana_is_provisioned(compose_project: dict[str, Any]) -> None:
    grafana = services(compose_project)["grafana"]
    provisioning = REPO / "deploy" / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    [prometheus] = datasources
    assert prometheus["type"] == "prometheus" and prometheus["url"] == "http://prometheus:9090"
    assert "9090" in services(compose_project)["prometheus"]["expose"]
    providers = yaml.safe_load((provisioning / "dashboards" / "aiworks.yml").read_text())["providers"]
    dashboards_target = mount_target(grafana, REPO / "deploy" / "grafana" / "dashboards")
    assert [p["options"]["path"] for p in providers] == [dashboards_target]
    for kind in ("datasources", "dashboards"):
        assert mount_target(grafana, provisioning / kind) == f"/etc/grafana/provisioning/{kind}"


def test_the_monitor_watches_every_suite_service_where_prometheus_scrapes_it(compose_project: dict[str, Any]) -> None:
    import json

    from aiworks.monitor.discovery import from_static

    env = services(compose_project)["monitor"]["environment"]
    inventory = from_static(json.loads(env["AIWORKS_MONITOR_STATIC_SERVICES"]))
    watched = {s.name: s for s in inventory.services}
    assert set(watched) == set(SUITE) - {"monitor"}
    scraped = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in scraped["scrape_configs"] for c in job.get("static_configs", []) for t in c["targets"]}
    for name, service in watched.items():
        assert service.kind == SUITE[name]
        port = next(v for k, v in services(compose_project)[name]["environment"].items() if k.endswith("METRICS_PORT"))
        assert service.metrics_address == f"{name}:{port}" and service.metrics_address in targets
    assert watched["runtime-1"].replica_id == "runtime-1"  # what the runtime registers as, so ejection finds it


def test_the_tiers_share_the_gateways_redis_and_files_and_check_its_certificate(compose_project: dict[str, Any]) -> None:
    """The batch runner and the nearline worker: the gateway's Redis database (the jobs and the queue it writes),
    the Batch API's files on one volume, and the gateway's certificate checked against the CA alone (the
    `gateway-ca` job copies ca.crt out of the certs volume, so no tier container can read a private key), with the
    credential key the gateway seals callers' credentials under."""
    project = services(compose_project)
    gateway = project["gateway"]["environment"]
    assert gateway["AIWORKS_GATEWAY_ASYNC_REQUESTS"] == "true"
    [gateway_files] = [m for m in project["gateway"]["volumes"] if m["source"] == "batch-files"]
    assert gateway["AIWORKS_GATEWAY_BATCH_FILES_URL"].startswith(gateway_files["target"] + "/")
    [runner_files] = [m for m in project["batch-runner"]["volumes"] if m["source"] == "batch-files"]
    assert runner_files["target"] == gateway_files["target"], "job inputs and results at the same paths"
    job = project["gateway-ca"]
    assert job["network_mode"] == "none" and job["entrypoint"][0] == "cp"
    [certs] = [m for m in job["volumes"] if m["source"] == "certs"]
    assert certs["read_only"] and job["entrypoint"][1] == f"{certs['target']}/gateway/ca.crt"
    [out] = [m for m in job["volumes"] if m["source"] == "gateway-ca"]
    # cp CA KEY DIR/: the CA's certificate and the credential key the gateway seals callers' credentials under
    # (the certs job makes it), and nothing else of the certs volume.
    assert job["entrypoint"][2] == gateway["AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE"] == f"{certs['target']}/credential-key"
    certs_job = project["certs"]["command"]
    assert certs_job[certs_job.index("--credential-key") + 1] == "/var/lib/aiworks/credential-key"
    assert job["entrypoint"][3].rstrip("/") == out["target"] and len(job["entrypoint"]) == 4
    copied = Path(out["target"]) / "ca.crt"
    for name, prefix in (("batch-runner", "AIWORKS_BATCH_"), ("nearline-worker", "AIWORKS_NEARLINE_")):
        service = project[name]
        env = service["environment"]
        assert env[prefix + "REDIS_URL"] == gateway["AIWORKS_GATEWAY_REDIS_URL"], name
        assert env[prefix + "GATEWAY_URL"] == "https://gateway:8000", name
        [ca] = [m for m in service["volumes"] if m["source"] == "gateway-ca"]
        assert ca["read_only"] and env[prefix + "CA_FILE"] == f"{ca['target']}/{copied.name}", name
        assert env[prefix + "CREDENTIAL_KEY_FILE"] == f"{ca['target']}/credential-key", name
        assert "certs" not in {m["source"] for m in service["volumes"]}, f"{name} must not see the keys"
        port = str(TIER_PORTS[name]["metrics"])
        assert (service["expose"], env[prefix + "METRICS_PORT"], env[prefix + "METRICS_HOST"]) == ([port], port, "0.0.0.0")
        assert service["healthcheck"]["test"] == ["CMD", "aiworks", "probe", "--quiet", name]
        assert service["read_only"] and service["cap_drop"] == ["ALL"]
        assert service["depends_on"]["gateway"]["condition"] == "service_healthy"
        assert service["depends_on"]["gateway-ca"]["condition"] == "service_completed_successfully"
