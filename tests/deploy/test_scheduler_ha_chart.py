"""The chart's side of scheduler HA, durable traffic policies and canary weights (docs/deployment.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from aiworks.scheduler.settings import SchedulerSettings

from .support import NAMESPACE, RELEASE
from .test_helm_chart import containers, env_of

SCHEDULER = f"{RELEASE}-scheduler"


def scheduler_env(rendered, kind: str = "Deployment") -> dict[str, Any]:
    return env_of(containers(rendered.get(kind, SCHEDULER))[0])


def pool_env(rendered, model: str, track: str = "stable") -> dict[str, Any]:
    return env_of(containers(rendered.get("Deployment", f"{RELEASE}-runtime-{model}-{track}"))[0])


def test_one_scheduler_keeps_its_policies_in_the_bundled_redis(render: Any) -> None:
    default = render(None)
    env = scheduler_env(default)
    assert env["AIWORKS_SCHEDULER_REDIS_URL"]["secretKeyRef"] == {"name": f"{RELEASE}-redis", "key": "redis-url"}
    assert "AIWORKS_SCHEDULER_STATE_FILE" not in env
    assert json.loads(env["AIWORKS_SCHEDULER_TRAFFIC_SEED"]) == {}  # no canary enabled
    assert pool_env(default, "iris")["AIWORKS_RUNTIME_SCHEDULER_ADDRESS"] == f"{SCHEDULER}:8010"
    [policy] = [p for p in default.of_kind("NetworkPolicy") if p["metadata"]["name"] == f"{RELEASE}-redis"]
    allowed = {s["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for s in policy["spec"]["ingress"][0]["from"]}
    assert allowed == {"gateway", "cache", "scheduler"}


def test_without_redis_the_policies_go_to_a_state_file(render: Any) -> None:
    env = scheduler_env(render({"redis": {"enabled": False}}))
    assert "AIWORKS_SCHEDULER_REDIS_URL" not in env
    assert env["AIWORKS_SCHEDULER_STATE_FILE"].startswith("/tmp/")  # the pod's writable emptyDir


def test_two_schedulers_are_a_statefulset_every_runtime_and_gateway_knows(render: Any) -> None:
    ha = render({"scheduler": {"replicas": 2}})
    assert SCHEDULER not in ha.names("Deployment")
    statefulset = ha.get("StatefulSet", SCHEDULER)
    assert statefulset["spec"]["serviceName"] == f"{SCHEDULER}-headless" and statefulset["spec"]["replicas"] == 2
    pods = [f"{SCHEDULER}-{i}.{SCHEDULER}-headless.{NAMESPACE}.svc:8010" for i in range(2)]
    for model in ("iris", "digits"):
        assert pool_env(ha, model)["AIWORKS_RUNTIME_SCHEDULER_ADDRESS"].split(",") == pods
    gateway = env_of(containers(ha.get("Deployment", f"{RELEASE}-gateway"))[0])
    assert gateway["AIWORKS_GATEWAY_SCHEDULER_ADDRESS"].split(",") == pods
    assert "AIWORKS_SCHEDULER_REDIS_URL" in scheduler_env(ha, "StatefulSet")


def test_two_schedulers_without_redis_are_refused(render: Any) -> None:
    with pytest.raises(Exception, match="needs Redis"):
        render({"scheduler": {"replicas": 2}, "redis": {"enabled": False}})


def test_the_canary_weight_seeds_the_schedulers_version_weights(render: Any, monkeypatch) -> None:
    pools = {"digits": {"stable": {"version": "1"}, "canary": {"enabled": True, "version": "2", "weight": 10}}}
    rendered = render({"runtime": {"pools": pools}})
    seed = scheduler_env(rendered)["AIWORKS_SCHEDULER_TRAFFIC_SEED"]
    assert json.loads(seed) == {"digits": {"1": 90, "2": 10}}
    monkeypatch.setenv("AIWORKS_SCHEDULER_TRAFFIC_SEED", seed)  # the scheduler reads it as its setting
    assert SchedulerSettings().traffic_seed == {"digits": {"1": 90, "2": 10}}
    # A canary without versions (same model files, another image tag) seeds nothing.
    plain = render({"runtime": {"pools": {"digits": {"canary": {"enabled": True, "weight": 10}}}}})
    assert json.loads(scheduler_env(plain)["AIWORKS_SCHEDULER_TRAFFIC_SEED"]) == {}


def test_a_canary_on_the_stable_version_is_refused(render: Any) -> None:
    pools = {"digits": {"stable": {"version": "1"}, "canary": {"enabled": True, "version": "1", "weight": 10}}}
    with pytest.raises(Exception, match="same version"):
        render({"runtime": {"pools": pools}})
