"""The acceptance test of the chart: a cluster in a box (tests/deploy/box).

The chart is rendered by the real Helm engine (helm-python-sdk) and installed as Helm installs it:
the pre-install hook Job, then every workload as local processes with exactly the env, args and
mounted files its pod gets, each pod in a network namespace of its own, Services on virtual IPs.
Real clients (tritonclient, over TLS with the release's CA and the generated API key) then check
what an operator would. Only the Kubernetes API server is a stand-in (box/apiserver.py).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from .box import run_box

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

if shutil.which("unshare") is None or shutil.which("nsenter") is None:
    pytest.skip("the box needs util-linux's unshare and nsenter", allow_module_level=True)

# The shared 2-core machine answers Redis slower than the gateway's 5 ms budget under this load, and
# the gateway then enforces 1/N locally for a while (by design, and it over-admits); the test is about
# sharing, so it gives Redis a second.
SHARED_MACHINE = {"gateway": {"extraEnv": [{"name": "AIWORKS_GATEWAY_LIMITS_TIMEOUT_S", "value": "1.0"}]}}


@pytest.fixture(scope="module")
def default_install(tmp_path_factory) -> dict:
    """The default values, as `helm install aiworks helm/aiworks` gets them."""
    return run_box(tmp_path_factory.mktemp("box-default"), SHARED_MACHINE,
                   ["default_install_serves", "shared_limits"], timeout_s=900)


def scenario(result: dict, name: str) -> dict:
    assert "error" not in result, f"{result.get('error')}\n{result.get('trace')}\n{result.get('cluster')}"
    found = result["scenarios"][name]
    assert found["ok"], f"{found.get('error')}\n{found.get('trace')}\n{found.get('cluster')}"
    return found


def test_default_install_answers_the_demo_models(default_install: dict) -> None:
    found = scenario(default_install, "default_install_serves")
    assert found["api_key_generated"] and found["tls"], "closed by default: a generated key, mutual TLS"
    assert found["iris"]["label"] == [0, 0, 0] or len(found["iris"]["label"]) == 3
    assert "401" in found["anonymous"], "no key, no inference"
    assert found["helm_test"]["passed"], found["helm_test"]["log"]
    # Target: from a rendered default install to the first successful inference in under 60 s.
    print(f"first inference {found['first_inference_s']} s after the install began; digits {found['digits_after_s']} s")
    assert found["first_inference_s"] < 60


def test_two_gateways_share_one_tenants_limits(default_install: dict) -> None:
    found = scenario(default_install, "shared_limits")
    assert found["gateways"] == 2 and found["other_errors"] == 0, found
    assert found["redis_fallbacks"] == 0, "a gateway lost Redis during the run: not a test of sharing"
    assert found["limited"] > 0, "the load exceeded the rate"
    # Admitted within 2 % of what one bucket of `burst` refilled at `rate` admits over the span (two unshared
    # buckets would admit about +80 %). 2 %, not 1: the span is read at the client, so a few ms of scheduling
    # jitter at its ends on a loaded 2-core machine moves the expected count (500 here) by a request or two;
    # one combined local run read just over 1 %.
    assert abs(found["error_pct"]) <= 2.0, found
    # Usage read from either replica counts both replicas' traffic.
    totals = [sum(row["requests"] for row in report["totals"] if row["model"] == "iris") for report in found["usage"]]
    before = sum(row["requests"] for row in found["usage_before"]["totals"] if row["model"] == "iris")
    assert totals[0] == totals[1] == before + found["admitted"], (totals, before, found["admitted"])


def test_helm_test_fails_when_no_model_loaded(tmp_path: Path) -> None:
    values = {
        "runtime": {"pools": {"iris": {"storageUri": "pvc://models/iris"}, "digits": None},
                    "storage": {"pvcClaims": ["models"]}},
        "tests": {"timeoutSeconds": 15},
    }
    result = run_box(tmp_path / "box", values, ["helm_test_fails_without_model"], prepare="broken_iris", timeout_s=600)
    found = scenario(result, "helm_test_fails_without_model")
    assert found["runtime_running"] == [True] and found["runtime_ready"] == [False], found["runtime_log"]
    assert not found["helm_test_passed"]
    assert "NOT READY: iris" in found["helm_test_log"], found["helm_test_log"]


def test_an_operators_own_stores_and_jwt(tmp_path: Path) -> None:
    """ci/external-values.yaml: JWT, an external Redis, models from a claim and from S3 (a real SeaweedFS),
    two gateways, Gateway API routes and a tracing collector, installed as the operator would."""
    import yaml

    from .support import CHART

    values = yaml.safe_load((CHART / "ci" / "external-values.yaml").read_text())
    result = run_box(tmp_path / "box", values, ["values_install_serves"], prepare="external_stores", timeout_s=900)
    found = scenario(result, "values_install_serves")
    assert found["credentials"] == "jwt"
    assert {"iris_after_s", "iris-s3_after_s"} <= set(found), found
    assert "401" in found["anonymous"], found["anonymous"]
    assert found["helm_test"]["passed"], found["helm_test"]["log"]


def _ha_values() -> dict:
    """ci/scheduler-ha-values.yaml: two schedulers (a StatefulSet under its headless Service, sharing the
    bundled Redis) and digits' canary (version 2) at 10 %."""
    import yaml

    from .support import CHART

    return {**yaml.safe_load((CHART / "ci" / "scheduler-ha-values.yaml").read_text()), **SHARED_MACHINE}


def _binomial_ok(load: dict, weight_pct: float, version: str = "2") -> bool:
    """The canary's answers are within 4 standard deviations (plus one) of a binomial draw at its weight."""
    n, p = load["ok"], weight_pct / 100
    return abs(load["versions"].get(version, 0) - n * p) <= 4 * math.sqrt(n * p * (1 - p)) + 1


def test_two_schedulers_survive_a_kill_under_load_and_keep_and_obey_the_canary_weights(tmp_path: Path) -> None:
    result = run_box(tmp_path, _ha_values(), ["scheduler_failover_and_canary"], timeout_s=600)
    found = scenario(result, "scheduler_failover_and_canary")
    print(json.dumps({k: v for k, v in found.items() if k not in ("registered", "restarted")}))
    for phase in ("split", "kill", "after_change"):
        load = found[phase]
        print(f"{phase}: {load['ok']} answered, {load['failed_count']} failed, longest gap {load['gap_s']} s, "
              f"versions {load['versions']}, {load['seconds']} s")  # fmt: skip
    print(f"install to ready {found['ready_after_s']} s; scenario {found['seconds']} s; "
          f"new weights on both schedulers after {found['changed_on_both_s']} s")  # fmt: skip
    assert found["schedulers"] == ["aiworks-scheduler-0", "aiworks-scheduler-1"]
    assert all(v["weights"] == {"1": 90, "2": 10} for v in found["registered"]), found["registered"]
    # (a) The split follows the values' weight.
    split = found["split"]
    assert split["failed"] == [] and split["ok"] >= 100, split
    assert _binomial_ok(split, 10), split
    # (b) SIGKILL of the scheduler the gateways watch: nothing lost, traffic back within 5 s.
    killed, before, after_kill = found["killed"], found["watched_before_kill"], found["watched_after_kill"]
    print(f"killed {killed}; gateways watched {before} before, {after_kill} after; "
          f"the load went through {found['kill_load_through']}")  # fmt: skip
    assert len(before) == 2 and killed in before.values(), before
    assert found["kill_load_through"] and all(before[g] == killed for g in found["kill_load_through"])
    assert killed not in after_kill.values(), "every gateway that watched it moved to the other scheduler"
    kill = found["kill"]
    assert kill["failed"] == [], kill["failed"]
    assert kill["ok"] >= 100 and kill["gap_s"] < 5.0, kill
    # (c) The kubelet restarted it, and it holds the weights again (from Redis).
    assert found["restarts"] >= 1
    assert found["restarted"]["weights"] == {"1": 90, "2": 10}, found["restarted"]
    # (d) A weight set afterwards (through the restarted scheduler) is what the gateways route by.
    after = found["after_change"]
    assert after["failed"] == [] and after["ok"] >= 100, after
    assert _binomial_ok(after, 50), after


def test_the_tiers_answer_async_requests_and_run_batch_jobs(tmp_path: Path) -> None:
    """batchRunner and nearlineWorker on (the tiers image's pods), the default install otherwise: a request with
    `Prefer: respond-async` and a three-line job through the Batch API, answered as the online calls are."""
    values = {**SHARED_MACHINE,
              "batchRunner": {"enabled": True, "files": {"url": "/var/lib/aiworks/batch/files",
                                                         "volume": {"persistentVolumeClaim": {"claimName": "batch-files"}}}},
              "nearlineWorker": {"enabled": True, "deadlineSeconds": 30}}  # fmt: skip
    result = run_box(tmp_path / "box", values, ["tiers_serve"], prepare="batch_files", timeout_s=600)
    found = scenario(result, "tiers_serve")
    print(json.dumps({k: found[k] for k in ("ready_after_s", "seconds") if k in found}))
    assert found["async_submit"] == 202, found
    assert found["async"] == {"status": 200, "request_status": "completed", "label": found["sync"][0]}, found
    assert found["batch"]["status"] == "completed", found
    assert found["batch"]["counts"] == {"total": 3, "completed": 3, "failed": 0}, found
    assert found["batch"]["labels"] == {f"row-{i}": label for i, label in enumerate(found["sync"])}, found
    assert found["tier_pods"] == {"batch-runner": [True], "nearline-worker": [True]}, found
    assert found["files_on_claim"], "the job's files are on the claim the gateway and the runner share"
