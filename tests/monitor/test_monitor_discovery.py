"""Discovery from the supervisor's registry and from a release's pods; the Kubernetes adapter on a stub API."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from aiworks.core.errors import AIWorksError, Status
from aiworks.monitor.discovery import DEAD, LOCAL_POOL, RUNNING, STARTING, from_kubernetes, from_supervisor
from aiworks.monitor.k8s import KubernetesPlatform
from aiworks.monitor.platform import EjectResult


def test_from_supervisor():
    doc = {
        "services": [
            {"name": "scheduler", "kind": "scheduler", "alive": True, "metrics_address": "127.0.0.1:8101"},
            {"name": "runtime-0", "kind": "runtime", "alive": True, "metrics_address": "127.0.0.1:8110",
             "replica_id": "runtime-0"},
            {"name": "runtime-1", "kind": "runtime", "alive": False, "exit_code": -9,
             "metrics_address": "127.0.0.1:8111", "replica_id": "runtime-1"},
        ],
        "runtime_replicas": 2,
    }  # fmt: skip
    inv = from_supervisor(doc)
    assert [(s.name, s.state) for s in inv.services] == [
        ("scheduler", RUNNING), ("runtime-0", RUNNING), ("runtime-1", DEAD)
    ]  # fmt: skip
    assert inv.services[2].detail == "exited with code -9" and inv.services[2].pool == LOCAL_POOL
    assert inv.targets() == ["127.0.0.1:8101", "127.0.0.1:8110", "127.0.0.1:8111"]
    assert [(p.name, p.desired, p.models) for p in inv.pools] == [(LOCAL_POOL, 2, ())]
    assert [s.name for s in inv.runtimes()] == ["runtime-0", "runtime-1"]


# ---- Kubernetes objects, as the API returns them ---------------------------------------------------

RELEASE = "prod"


def labels(component: str, **extra) -> dict[str, str]:
    return {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/name": "aiworks",
            "app.kubernetes.io/component": component, **extra}  # fmt: skip


def pod(name, component, phase="Running", ready=True, ip="10.0.0.5", port="8021", waiting=None, deleting=False,
        **extra_labels) -> client.V1Pod:  # fmt: skip
    state = client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason=waiting)) if waiting else None
    status = client.V1ContainerStatus(name=component, image="aiworks", image_id="", ready=ready, restart_count=0,
                                      state=state)  # fmt: skip
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name, labels=labels(component, **extra_labels),
            annotations={"prometheus.io/scrape": "true", "prometheus.io/port": port} if port else None,
            deletion_timestamp="2025-01-01T00:00:00Z" if deleting else None,
        ),
        status=client.V1PodStatus(phase=phase, pod_ip=ip, container_statuses=[status]),
    )  # fmt: skip


def deployment(name, component, replicas, **extra_labels) -> client.V1Deployment:
    selector = {k: v for k, v in labels(component, **extra_labels).items() if k != "app.kubernetes.io/name"}
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name, labels=labels(component, **extra_labels)),
        spec=client.V1DeploymentSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=selector),
            template=client.V1PodTemplateSpec(),
        ),
    )


RUNTIME_IRIS = {"aiworks.io/model": "iris", "version": "stable"}
PODS = [
    pod("prod-aiworks-scheduler-abc", "scheduler", port="8011", ip="10.0.0.2"),
    pod("prod-aiworks-runtime-iris-stable-1", "runtime", ip="10.0.0.5", **RUNTIME_IRIS),
    pod("prod-aiworks-runtime-iris-stable-2", "runtime", phase="Running", ready=False, ip="10.0.0.6", **RUNTIME_IRIS),
    pod("prod-aiworks-runtime-iris-stable-3", "runtime", waiting="CrashLoopBackOff", ready=False, ip="10.0.0.7",
        **RUNTIME_IRIS),
    pod("prod-aiworks-runtime-iris-stable-4", "runtime", phase="Pending", ip=None, **RUNTIME_IRIS),
    pod("prod-aiworks-runtime-iris-stable-5", "runtime", deleting=True, **RUNTIME_IRIS),
    pod("prod-aiworks-runtime-iris-canary-1", "runtime", ip="10.0.0.8", **{"aiworks.io/model": "iris", "version": "canary"}),
    pod("some-other-pod", "sidecar"),
]  # fmt: skip
DEPLOYMENTS = [
    deployment("prod-aiworks-runtime-iris-stable", "runtime", 4, **RUNTIME_IRIS),
    deployment("prod-aiworks-runtime-iris-canary", "runtime", 1, **{"aiworks.io/model": "iris", "version": "canary"}),
]


def test_from_kubernetes():
    inv = from_kubernetes(PODS, DEPLOYMENTS)
    by_name = {s.name: s for s in inv.services}
    assert "some-other-pod" not in by_name and "prod-aiworks-runtime-iris-stable-5" not in by_name
    assert by_name["prod-aiworks-scheduler-abc"].metrics_address == "10.0.0.2:8011"
    one = by_name["prod-aiworks-runtime-iris-stable-1"]
    assert (one.state, one.metrics_address, one.replica_id) == (RUNNING, "10.0.0.5:8021", one.name)
    assert one.pool == "prod-aiworks-runtime-iris-stable"
    assert by_name["prod-aiworks-runtime-iris-stable-2"].state == STARTING  # running, not ready yet
    crashing = by_name["prod-aiworks-runtime-iris-stable-3"]
    assert crashing.state == DEAD and "CrashLoopBackOff" in crashing.detail
    pending = by_name["prod-aiworks-runtime-iris-stable-4"]
    assert pending.state == STARTING and pending.metrics_address is None
    # Canary tracks belong to the rollout, not to the autoscaler.
    assert by_name["prod-aiworks-runtime-iris-canary-1"].pool is None
    assert [(p.name, p.desired, p.models) for p in inv.pools] == [("prod-aiworks-runtime-iris-stable", 4, ("iris",))]


class StubCoreApi:
    """Answers like CoreV1Api; records deletions."""

    def __init__(self, pods, error: ApiException | None = None):
        self.pods = pods
        self.error = error
        self.calls: list[tuple] = []

    def list_namespaced_pod(self, namespace, label_selector=None):
        self.calls.append(("list_pods", namespace, label_selector))
        return client.V1PodList(items=self.pods)

    def delete_namespaced_pod(self, name, namespace):
        if self.error is not None:
            raise self.error
        self.calls.append(("delete_pod", name, namespace))
        return client.V1Status(status="Success")


class StubAppsApi:
    """Answers like AppsV1Api; records scale patches."""

    def __init__(self, deployments):
        self.deployments = deployments
        self.calls: list[tuple] = []

    def list_namespaced_deployment(self, namespace, label_selector=None):
        self.calls.append(("list_deployments", namespace, label_selector))
        return client.V1DeploymentList(items=self.deployments)

    def patch_namespaced_deployment_scale(self, name, namespace, body):
        self.calls.append(("patch_scale", name, namespace, body))
        return client.V1Scale(spec=client.V1ScaleSpec(replicas=body["spec"]["replicas"]))


class StubEjector:
    def __init__(self):
        self.calls = []

    async def eject(self, replica_id, duration_s, reason):
        self.calls.append((replica_id, duration_s, reason))
        return EjectResult(True, duration_s, "ejected")

    async def close(self):
        pass


def platform(core=None, apps=None, ejector=None) -> KubernetesPlatform:
    return KubernetesPlatform(
        "serving", RELEASE, ejector or StubEjector(), core_api=core or StubCoreApi(PODS), apps_api=apps or StubAppsApi(DEPLOYMENTS)
    )  # fmt: skip


async def test_kubernetes_platform_discovers_restarts_and_scales():
    core, apps, ejector = StubCoreApi(PODS), StubAppsApi(DEPLOYMENTS), StubEjector()
    p = platform(core, apps, ejector)
    inv = await p.inventory()
    assert core.calls == [("list_pods", "serving", "app.kubernetes.io/instance=prod")]
    assert apps.calls == [
        ("list_deployments", "serving", "app.kubernetes.io/instance=prod,app.kubernetes.io/component=runtime")
    ]
    crashing = next(s for s in inv.services if s.state == DEAD)
    assert "Deployment replaces it" in await p.restart(crashing)
    assert core.calls[-1] == ("delete_pod", "prod-aiworks-runtime-iris-stable-3", "serving")
    await p.scale("prod-aiworks-runtime-iris-stable", 5)
    assert apps.calls[-1] == ("patch_scale", "prod-aiworks-runtime-iris-stable", "serving", {"spec": {"replicas": 5}})
    result = await p.eject("prod-aiworks-runtime-iris-stable-1", 30.0, "errors")
    assert result.ejected and ejector.calls == [("prod-aiworks-runtime-iris-stable-1", 30.0, "errors")]


@pytest.mark.parametrize(
    ("code", "status"), [(403, Status.PERMISSION_DENIED), (404, Status.NOT_FOUND), (500, Status.UNAVAILABLE)]
)
async def test_kubernetes_api_errors_become_aiworks_errors(code, status):
    p = platform(core=StubCoreApi(PODS, error=ApiException(status=code, reason="nope")))
    inv = await p.inventory()
    with pytest.raises(AIWorksError) as err:
        await p.restart(inv.services[0])
    assert err.value.status is status and f"{code} nope" in err.value.message
