"""aiworks.supervisor.prometheus: the rendered configuration, a clear error without the binary, and a
real Prometheus that scrapes what it is given, loads the suite's rules, and picks up new targets."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, start_http_server

from aiworks.supervisor import prometheus as local
from aiworks.supervisor.prometheus import PrometheusNotFound, PrometheusProcess, find_rules_dir, render_config
from aiworks.supervisor.supervisor import free_port

from .support import RULES_DIR, PrometheusAPI, rule_groups


def test_each_kind_is_a_job_with_its_service_label():
    config = yaml.safe_load(
        render_config(
            {"gateway": ["127.0.0.1:8100"], "runtime": ["127.0.0.1:8110", "127.0.0.1:8111"], "cache": []},
            rules_dir=RULES_DIR,
            scrape_interval_s=0.5,
        )
    )
    assert config["global"]["scrape_interval"] == "500ms" and config["global"]["scrape_timeout"] == "500ms"
    assert config["global"]["evaluation_interval"] == "1s"
    assert config["rule_files"] == [f"{RULES_DIR}/*.yml"]
    jobs = {job["job_name"]: job["static_configs"] for job in config["scrape_configs"]}
    assert jobs == {
        "aiworks-gateway": [{"targets": ["127.0.0.1:8100"], "labels": {"service": "gateway"}}],
        "aiworks-runtime": [{"targets": ["127.0.0.1:8110", "127.0.0.1:8111"], "labels": {"service": "runtime"}}],
    }


def test_the_jobs_match_the_compose_configuration():
    compose = yaml.safe_load((RULES_DIR.parent / "prometheus.yml").read_text())
    compose_jobs = {job["job_name"]: job["static_configs"][0].get("labels") for job in compose["scrape_configs"]}
    kinds = ("gateway", "scheduler", "runtime", "cache", "monitor")
    local_jobs = yaml.safe_load(render_config({kind: ["127.0.0.1:1"] for kind in kinds}))["scrape_configs"]
    for job in local_jobs:
        assert compose_jobs[job["job_name"]] == job["static_configs"][0]["labels"]


def test_the_rules_are_found_from_the_package_whatever_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(local.RULES_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert find_rules_dir() == RULES_DIR
    monkeypatch.setenv(local.RULES_ENV, str(tmp_path))
    assert find_rules_dir() == tmp_path
    monkeypatch.setenv(local.RULES_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing"):
        find_rules_dir()


def test_a_missing_binary_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv(local.BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    process = PrometheusProcess({}, free_port(), tmp_path / "data", tmp_path / "prometheus.log")
    with pytest.raises(PrometheusNotFound, match="apt-get install prometheus"):
        process.start()
    monkeypatch.setenv(local.BINARY_ENV, str(tmp_path / "prometheus"))
    with pytest.raises(PrometheusNotFound, match=local.BINARY_ENV):
        process.start()
    assert process.process is None


@pytest.fixture
def exporter() -> Iterator[int]:
    """A /metrics endpoint with one suite counter, on a free port."""
    registry = CollectorRegistry()
    requests = Counter(
        "aiworks_gateway_requests", "test", ["model", "version", "tenant", "protocol", "status"], registry=registry
    )
    requests.labels("iris", "1", "", "http", "ok").inc(3)
    server, thread = start_http_server(0, "127.0.0.1", registry=registry)
    yield server.server_address[1]
    server.shutdown()
    thread.join(5)


def wait_for(check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def test_a_real_prometheus_scrapes_its_targets_and_loads_the_rules(prometheus_binaries, exporter, tmp_path):
    process = PrometheusProcess(
        {"gateway": [f"127.0.0.1:{exporter}"]}, free_port(), tmp_path / "data", tmp_path / "logs" / "prometheus.log"
    )
    with process:
        api = PrometheusAPI(process.url)
        assert api.session.get(f"{process.url}/-/ready", timeout=5).status_code == 200
        loaded = {group["name"]: len(group["rules"]) for group in api.rule_groups()}
        assert loaded == {group["name"]: len(group["rules"]) for group in rule_groups()}

        scraped = wait_for(
            lambda: api.query('aiworks_gateway_requests_total{job="aiworks-gateway", service="gateway"}')
        )
        assert [float(s["value"][1]) for s in scraped] == [3.0]
        assert scraped[0]["metric"]["model"] == "iris"

        # A target added later (a replica the monitor started) is scraped after a reload.
        missing = free_port()
        process.set_targets({"gateway": [f"127.0.0.1:{exporter}"], "runtime": [f"127.0.0.1:{missing}"]})
        down = wait_for(lambda: api.query('up{job="aiworks-runtime", service="runtime"} == 0'))
        assert down and down[0]["metric"]["instance"] == f"127.0.0.1:{missing}"
    assert process.process.returncode == 0
    assert (tmp_path / "logs" / "prometheus.log").read_text()
