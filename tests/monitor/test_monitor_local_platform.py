"""The supervisor's control API and the monitor's local adapter that drives it, on 127.0.0.1.

The API wants a bearer token derived from the installation's secret, JSON
bodies with a length, and caps ``replicas`` (issue 15, finding 7); the
refusals are checked here against the real server, raw HTTP included.
"""

from __future__ import annotations

import http.client
import json
import secrets
import urllib.error
import urllib.request

import pytest

from aiworks.core.errors import AIWorksError, NotFound, Status
from aiworks.monitor.discovery import DEAD, LOCAL_POOL, RUNNING
from aiworks.monitor.platform import LocalPlatform, SchedulerEjector
from aiworks.security.callers import CallerAuth, ClientCaller
from aiworks.supervisor.control import ControlServer

SECRET = secrets.token_hex(32).encode()

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
    server = ControlServer(target, "127.0.0.1", 0, auth=CallerAuth(secret=SECRET), max_replicas=64)
    server.start()
    server.target = target
    yield server
    server.stop()


def headers(caller: str | None = "monitor", content_type: str | None = "application/json") -> dict[str, str]:
    found = {"Authorization": ClientCaller.from_secret(caller, SECRET).bearer()} if caller else {}
    return found | ({"Content-Type": content_type} if content_type else {})


def call(url: str, method: str = "GET", body: bytes | None = None, caller: str | None = "monitor", **kw):
    request = urllib.request.Request(url, data=body, method=method, headers=headers(caller, **kw))
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
    assert call(f"{control.url}/healthz", caller=None) == (200, {"status": "ok"})
    assert call(f"{control.url}/v1/stop", "POST", caller="admin") == (200, {"stopping": True})
    assert control.target.stopped


def raw(control, method: str, path: str, head: dict, body: bytes = b"") -> tuple[int, dict, dict]:
    """One request as written, Content-Length and all (urllib would fix them up)."""
    conn = http.client.HTTPConnection(control.host, control.port, timeout=5)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for key, value in head.items():
            conn.putheader(key, value)
        conn.endheaders(body or None)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read())
    finally:
        conn.close()


def test_control_api_needs_a_callers_bearer_token(control):
    status, doc = call(f"{control.url}/v1/stop", "POST", caller=None)
    assert status == 401 and "Bearer" in doc["error"] and not control.target.stopped
    status, head, _ = raw(control, "GET", "/v1/services", {})
    assert status == 401 and head["WWW-Authenticate"].startswith("Bearer")
    forged = ClientCaller("admin", "0" * 64).bearer()  # the right form, a token not derived from the secret
    status, _, doc = raw(control, "POST", "/v1/stop", {"Authorization": forged, "Content-Type": "application/json",
                                                        "Content-Length": "0"})  # fmt: skip
    assert status == 401 and "does not verify" in doc["error"] and "0" * 64 not in doc["error"]
    # Known callers, each allowed its own routes: a runtime may nothing; the monitor may restart and scale, not stop.
    status, doc = call(f"{control.url}/v1/runtime/scale", "POST", b'{"replicas": 2}', caller="runtime")
    assert status == 403 and "'runtime'" in doc["error"] and control.target.replicas == 1
    status, doc = call(f"{control.url}/v1/stop", "POST", caller="monitor")
    assert status == 403 and "admin" in doc["error"] and not control.target.stopped
    assert call(f"{control.url}/v1/services", caller="admin")[0] == 200


def test_a_cross_site_text_plain_post_cannot_stop_the_suite(control):
    # What a web page can send without a CORS preflight: a "simple" POST, text/plain, no Authorization.
    status, doc = call(f"{control.url}/v1/stop", "POST", b"{}", caller=None, content_type="text/plain")
    assert status == 401 and not control.target.stopped
    # Even with a stolen token, the body must be JSON.
    status, doc = call(f"{control.url}/v1/stop", "POST", b"{}", caller="admin", content_type="text/plain")
    assert status == 415 and "application/json" in doc["error"] and not control.target.stopped
    status, doc = call(f"{control.url}/v1/stop", "POST", b"{}", caller="admin", content_type=None)
    assert status == 415 and not control.target.stopped
    assert call(f"{control.url}/v1/services")[0] == 200  # still serving


def test_bodies_need_a_length_that_is_not_negative(control):
    auth = headers("admin")
    for length, want in (("-1", 400), ("1e3", 400), ("+5", 400), ("٣".encode(), 400)):
        status, _, doc = raw(control, "POST", "/v1/runtime/scale", auth | {"Content-Length": length})
        assert status == want and "Content-Length" in doc["error"], length
    status, _, doc = raw(control, "POST", "/v1/runtime/scale", auth)  # no length at all
    assert status == 411 and "Content-Length" in doc["error"]
    status, _, doc = raw(control, "POST", "/v1/runtime/scale", auth | {"Transfer-Encoding": "chunked"},
                         b"f\r\n{\"replicas\": 9}\r\n0\r\n\r\n")  # fmt: skip
    assert status == 411 and control.target.replicas == 1
    status, _, doc = raw(control, "POST", "/v1/runtime/scale", auth | {"Content-Length": str(10**9)})
    assert status == 413
    assert call(f"{control.url}/v1/services")[0] == 200  # and it still answers


def test_replicas_are_capped(control):
    for replicas in (65, 10**9, 2**63):
        status, doc = call(f"{control.url}/v1/runtime/scale", "POST", json.dumps({"replicas": replicas}).encode())
        assert status == 400 and "0 to 64" in doc["error"], replicas
    assert control.target.replicas == 1
    assert call(f"{control.url}/v1/runtime/scale", "POST", b'{"replicas": 64}')[0] == 200


async def test_local_platform_acts_through_the_control_api(control):
    caller = ClientCaller.from_secret("monitor", SECRET)
    platform = LocalPlatform(control.url, SchedulerEjector("127.0.0.1:1"), caller=caller)
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
