"""The Kubernetes traffic adapter against a stub CustomObjectsApi holding the chart's VirtualService.

The stub starts from ``mesh/virtual-service-runtime-stable.yaml`` (what the
chart renders; tests/deploy keeps the two equal) and applies patches as the
API server applies a JSON merge patch, including the resourceVersion check.
Each step's result must equal the chart's own ``-canary-<N>.yaml`` rendering.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from rollout_support import RecordingTarget

from aiworks.core.errors import AIWorksError, NotFound, Status
from aiworks.monitor.rollout_targets import KubernetesTraffic, chart_fullname, set_route_weights

MESH = Path(__file__).resolve().parents[2] / "mesh"
NAME = "aiworks-runtime-iris"


def mesh_object(variant: str) -> dict:
    return yaml.safe_load((MESH / f"virtual-service-runtime-{variant}.yaml").read_text())


def merge_patch(target, patch):
    """RFC 7386, as the API server applies ``application/merge-patch+json``."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class StubCustomObjectsApi:
    """The two CustomObjectsApi methods the adapter calls, over an in-memory object store."""

    def __init__(self, *objects: dict):
        self.store = {}
        for obj in objects:
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = "1"
            self.store[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        self.patches: list[dict] = []
        self.conflicts = 0  # answer this many patches with 409, as after a concurrent edit

    def _key(self, group, version, namespace, plural, name):
        assert (group, version, plural) == ("networking.istio.io", "v1", "virtualservices")
        if (namespace, name) not in self.store:
            raise ApiException(status=404, reason="Not Found")
        return (namespace, name)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        return copy.deepcopy(self.store[self._key(group, version, namespace, plural, name)])

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body):
        key = self._key(group, version, namespace, plural, name)
        self.patches.append(copy.deepcopy(body))
        current = self.store[key]
        if self.conflicts:
            self.conflicts -= 1
            current["metadata"]["resourceVersion"] = str(int(current["metadata"]["resourceVersion"]) + 1)
        wanted = body.get("metadata", {}).get("resourceVersion")
        if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        updated = merge_patch(current, body)
        updated["metadata"]["resourceVersion"] = str(int(current["metadata"]["resourceVersion"]) + 1)
        self.store[key] = updated
        return copy.deepcopy(updated)

    def spec(self, name: str = NAME, namespace: str = "aiworks") -> dict:
        return self.store[(namespace, name)]["spec"]


def route_weights(spec: dict) -> list[dict[str, int]]:
    return [{d["destination"]["subset"]: d["weight"] for d in route["route"]} for route in spec["http"]]


@pytest.fixture
def api() -> StubCustomObjectsApi:
    return StubCustomObjectsApi(mesh_object("stable"))


async def test_each_step_writes_the_weights_the_chart_renders_for_it(api):
    scheduler = RecordingTarget()
    traffic = KubernetesTraffic("aiworks", "aiworks", scheduler, api)
    for weight in (5, 20, 50, 100):
        await traffic.set_split("iris", "1", "2", weight)
        assert api.spec() == mesh_object(f"canary-{weight}")["spec"], f"step {weight}%"
        for weights in route_weights(api.spec()):
            assert weights == {"stable": 100 - weight, "canary": weight} and sum(weights.values()) == 100
    # The scheduler, which picks the replica of every batch, gets the same split by version.
    assert scheduler.calls == [("iris", "1", "2", w) for w in (5, 20, 50, 100)]
    assert await traffic.subset_weights("iris") == {"stable": 0, "canary": 100}

    await traffic.set_split("iris", "1", "2", 0)  # rollback: the canary destination stays, at 0
    assert route_weights(api.spec()) == [{"stable": 100, "canary": 0}] * 2
    untouched = {k: v for k, v in mesh_object("stable")["spec"]["http"][1].items() if k != "route"}
    assert {k: v for k, v in api.spec()["http"][1].items() if k != "route"} == untouched
    assert all(p["metadata"]["resourceVersion"] for p in api.patches)  # every patch is conditional
    assert scheduler.current["iris"] == {"1": 100, "2": 0}


async def test_a_concurrent_edit_is_read_again_and_a_missing_object_is_not_found(api):
    traffic = KubernetesTraffic("aiworks", "aiworks", None, api)
    api.conflicts = 1
    await traffic.set_split("iris", "1", "2", 20)
    assert len(api.patches) == 2 and api.spec() == mesh_object("canary-20")["spec"]
    with pytest.raises(NotFound, match="get virtualservice aiworks-runtime-digits: 404"):
        await traffic.set_split("digits", "1", "2", 20)
    api.conflicts = 5
    with pytest.raises(AIWorksError, match="409") as err:
        await traffic.set_split("iris", "1", "2", 50)
    assert err.value.status is Status.ALREADY_EXISTS


async def test_object_names_follow_the_chart():
    assert chart_fullname("aiworks") == "aiworks"
    assert chart_fullname("prod-aiworks-eu") == "prod-aiworks-eu"
    assert chart_fullname("prod") == "prod-aiworks"
    other = mesh_object("stable")
    other["metadata"]["name"] = "prod-aiworks-runtime-iris"
    api = StubCustomObjectsApi(other)
    await KubernetesTraffic("aiworks", "prod", None, api).set_split("iris", "1", "2", 5)
    assert route_weights(api.spec("prod-aiworks-runtime-iris")) == [{"stable": 95, "canary": 5}] * 2


def test_specs_without_a_stable_subset_are_refused():
    with pytest.raises(AIWorksError, match="no route to a 'stable' subset") as err:
        set_route_weights({"http": [{"route": [{"destination": {"host": "x"}, "weight": 100}]}]}, 20)
    assert err.value.status is Status.FAILED_PRECONDITION
    with pytest.raises(AIWorksError, match="besides"):
        set_route_weights(
            {
                "http": [
                    {
                        "name": "r",
                        "route": [{"destination": {"host": "x", "subset": "stable"}}, {"destination": {"host": "y"}}],
                    }
                ]
            },
            20,
        )
