"""Rotating the internal token file on a running suite, with no restart (docs/security.md, "Rotating the
internal token").

``aiworks up``'s processes (the supervisor, scheduler, runtime, cache, gateway and monitor) all read one token
file. ``aiworks certs --internal-token FILE --rotate-internal-token at-once`` and then ``retire`` are taken by
each within its reload interval (0.3 s here; 10 s by default), seen on each one's ``/metrics``; the suite
serves throughout, the monitor still acts through the control API, no child is restarted, and after
``retire`` the old secret's tokens are refused by the internal services and both control APIs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
import requests
from e2e_support import start_suite

from aiworks.core.rpc import blocking_channel
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc
from aiworks.security.callers import ClientCaller, read_secrets, token_key_id

IRIS = [5.1, 3.5, 1.4, 0.2]


@pytest.fixture(scope="module")
def suite(model_repository, tmp_path_factory):
    s = start_suite(model_repository, tmp_path_factory.mktemp("rotation") / "logs", replicas=1, monitor=True,
                    token_reload_s=0.3)  # fmt: skip
    yield s
    s.supervisor.stop()


def _serves(suite) -> bool:
    body = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": IRIS}]}
    reply = requests.post(f"{suite.base}/v2/models/iris/infer", json=body, timeout=10)
    return reply.status_code == 200 and reply.json()["outputs"][0]["data"] == [0]


def _held(url: str) -> dict[str, str]:
    """key id -> role, from a /metrics page's aiworks_internal_token_info."""
    text = requests.get(url, timeout=5).text
    held = {}
    for line in text.splitlines():
        if line.startswith("aiworks_internal_token_info{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
            held[labels["key_id"].strip('"')] = labels["role"].strip('"')
    return held


def _metrics_urls(suite) -> dict[str, str]:
    sup = suite.supervisor
    urls = {c.name: f"http://127.0.0.1:{c.metrics_port}/metrics" for c in sup.children if c.metrics_port}
    assert {"gateway", "scheduler", "runtime-0", "cache", "monitor"} <= set(urls), urls
    return urls


def _until_all_hold(suite, expected: dict[str, str], timeout_s: float = 20.0) -> None:
    urls = _metrics_urls(suite)
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {name: _held(url) for name, url in urls.items()}
        if all(held == expected for held in seen.values()):
            return
        assert time.monotonic() < deadline, f"not every process holds {expected}: {seen}"
        time.sleep(0.2)


def _rotate(suite, step: str) -> None:
    done = subprocess.run([sys.executable, "-m", "aiworks", "certs", "--internal-token", str(suite.supervisor.token_file),
                           "--rotate-internal-token", step], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr


def _control_status(suite, caller: ClientCaller) -> int:
    request = urllib.request.Request(f"{suite.supervisor.control_url}/v1/services",
                                     headers={"Authorization": caller.bearer()})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _scheduler_status(suite, caller: ClientCaller) -> grpc.StatusCode:
    with blocking_channel(suite.supervisor.scheduler_address, caller=caller) as channel:
        try:
            scheduler_pb2_grpc.SchedulerServiceStub(channel).Status(pb.StatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_the_internal_token_rotates_without_a_restart(suite):
    sup = suite.supervisor
    pids = {c.name: c.process.pid for c in sup.children}
    [old] = read_secrets(sup.token_file)
    old_admin = ClientCaller.from_secret("admin", old)
    _until_all_hold(suite, {token_key_id(old): "current"})
    assert _serves(suite)

    _rotate(suite, "at-once")  # one machine: the new secret is presented at once, the old still accepted
    new, _ = read_secrets(sup.token_file)
    _until_all_hold(suite, {token_key_id(new): "current", token_key_id(old): "previous"})
    assert _serves(suite)
    assert _scheduler_status(suite, old_admin) == grpc.StatusCode.OK  # a tool that read the file before

    _rotate(suite, "retire")
    _until_all_hold(suite, {token_key_id(new): "current"})
    assert all(_serves(suite) for _ in range(20)), "the gateway's calls to the runtime and scheduler"
    new_admin = ClientCaller.from_secret("admin", new)
    assert _scheduler_status(suite, new_admin) == grpc.StatusCode.OK
    assert _scheduler_status(suite, old_admin) == grpc.StatusCode.UNAUTHENTICATED
    assert _control_status(suite, new_admin) == 200 and _control_status(suite, old_admin) == 401
    monitor_post = requests.post(f"{sup.monitor_url}/v1/rollouts", json={}, timeout=10,
                                 headers={"Authorization": old_admin.bearer()})  # fmt: skip
    assert monitor_post.status_code == 401, monitor_post.text
    # The monitor still discovers the replicas through the control API, with its own (new) token.
    time.sleep(2.0)
    with urllib.request.urlopen(f"{sup.monitor_url}/v1/replicas", timeout=5) as resp:
        assert [r["replica"] for r in json.load(resp)["replicas"]] == ["runtime-0"]
    assert {c.name: c.process.pid for c in sup.children} == pids and all(c.restarts == 0 for c in sup.children)
    for child in sup.children:
        text = child.log_path.read_text()
        assert old.decode() not in text and new.decode() not in text
        assert old_admin.token not in text and new_admin.token not in text
    assert "internal token file" in (sup.config.log_dir / "runtime-0.log").read_text()
