"""The supervisor's control API and the monitor's local adapter that drives it, on 127.0.0.1."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from aiworks.monitor.discovery import DEAD, LOCAL_POOL, RUNNING
from aiworks.monitor.platform import LocalPlatform, SchedulerEjector

from aiworks.core.errors import AIWorksError, NotFound, Status
from aiworks.supervisor.control import ControlServer

pytestmark = pytest.mark.loopback


class FakeSupervisor:
    """The supervisor's registry without processes: what the control API drives."""

    def __init__(self):
        self.services = {
            "scheduler": {"name": "scheduler", "kind": "scheduler", "pid": 10, "alive": True,
                          "metrics_address": "127.0.0.1:8101", "replica_id": None},
            "runtime-0": {"name": "runtime-0", "kind": "runtime", "pid": 11, "alive": False, "exit_code": -9,
                          "metrics_address": "127.0.0.1:8110", "replica_id": "runtime-0"},
        }  # fmt: skip
        self.replicas = 1
        self.stopped = False
        self.stopping = False

    def describe(self):
        return {"services": list(self.services.values()), "runtime_replicas": self.replicas}

    def restart(self, name):
        if self.stopping:
            raise AIWorksError("the suite is stopping", Status.FAILED_PRECONDITION)
        if name not in self.services:
            raise NotFound(f"no service named {name!r}")
        self.services[name] = {**self.services[name], "alive": True, "pid": self.services[name]["pid"] + 100}
        return self.services[name]

    def scale_runtimes(self, replicas):
        before, self.replicas = self.replicas, replicas
        return {"replicas": replicas, "started": [f"runtime-{i}" for i in range(before, replicas)], "stopped": []}

    def request_stop(self):
        self.stopped = True


@pytest.fixture
def control():
    target = FakeSupervisor()
    server = ControlServer(target, "127.0.0.1", 0)
    server.start()
    server.target = target
    yield server
    server.stop()


def call(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_control_api_routes_and_errors(control):
    status, doc = call(f"{control.url}/v1/services")
    assert status == 200 and [s["name"] for s in doc["services"]] == ["scheduler", "runtime-0"]
    status, doc = call(f"{control.url}/v1/services/runtime-0/restart", "POST")
    assert status == 200 and doc["alive"] and doc["pid"] == 111
    assert call(f"{control.url}/v1/services/nope/restart", "POST")[0] == 404
    status, doc = call(f"{control.url}/v1/runtime/scale", "POST", b'{"replicas": 3}')
    assert status == 200 and doc["started"] == ["runtime-1", "runtime-2"]
    for bad in (b'{"replicas": -1}', b'{"replicas": "3"}', b"{}", b"not json", b"[1]"):
        status, doc = call(f"{control.url}/v1/runtime/scale", "POST", bad)
        assert status == 400 and "error" in doc, bad
    assert call(f"{control.url}/v1/nothing")[0] == 404
    assert call(f"{control.url}/healthz") == (200, {"status": "ok"})
    assert call(f"{control.url}/v1/stop", "POST") == (200, {"stopping": True}) and control.target.stopped


async def test_local_platform_acts_through_the_control_api(control):
    platform = LocalPlatform(control.url, SchedulerEjector("127.0.0.1:1"))
    try:
        inv = await platform.inventory()
        assert [(s.name, s.kind, s.state) for s in inv.services] == [
            ("scheduler", "scheduler", RUNNING), ("runtime-0", "runtime", DEAD)
        ]  # fmt: skip
        assert inv.pools[0].name == LOCAL_POOL and inv.pools[0].desired == 1
        dead = inv.services[1]
        assert await platform.restart(dead) == "restarted runtime-0 as pid 111"
        await platform.scale(LOCAL_POOL, 2)
        assert control.target.replicas == 2
        control.target.stopping = True
        with pytest.raises(AIWorksError) as err:
            await platform.restart(dead)
        assert err.value.status is Status.FAILED_PRECONDITION and "stopping" in err.value.message
    finally:
        await platform.close()


async def test_local_platform_without_a_supervisor_observes_only():
    platform = LocalPlatform(None, SchedulerEjector("127.0.0.1:1"))
    assert (await platform.inventory()).services == ()
    with pytest.raises(AIWorksError, match="AIWORKS_MONITOR_SUPERVISOR_URL"):
        await platform.scale(LOCAL_POOL, 3)
    await platform.close()


async def test_an_unreachable_supervisor_is_unavailable():
    from aiworks.supervisor.supervisor import free_port

    platform = LocalPlatform(f"http://127.0.0.1:{free_port()}", SchedulerEjector("127.0.0.1:1"))
    with pytest.raises(AIWorksError) as err:
        await platform.inventory()
    assert err.value.status is Status.UNAVAILABLE and "unreachable" in err.value.message
    await platform.close()
