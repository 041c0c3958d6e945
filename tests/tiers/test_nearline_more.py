"""Nearline, continued: ``"async": true`` in the body, the class deadline, and signed callbacks.

Against the tier suite (tests/tiers/conftest.py: a private redis-server, the
gateway with asynchronous requests and a 120 s class deadline that requests
shorten with ``parameters.timeout``) and real ``aiworks nearline worker``
processes. Callbacks go to a real HTTP server in this process that checks
each signature with the tenant's secret.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import redis
import requests

from .conftest import CALLBACK_SECRET
from .test_batch_jobs import _digits
from .test_nearline import _body, _post, _result

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _records(batch) -> int:
    client = redis.Redis.from_url(batch.redis_url)
    try:
        return len(client.keys("aiworks:async:req:*"))
    finally:
        client.close()


def _infer(batch, tenant: str, body: bytes | dict, headers: dict | None = None) -> requests.Response:
    headers = {**batch.headers(tenant), **(headers or {})}
    url = f"{batch.base}/v2/models/digits/versions/1/infer"
    if isinstance(body, dict):
        return requests.post(url, json=body, headers=headers, timeout=30)
    return requests.post(url, data=body, headers=headers, timeout=30)


def _binary(row: np.ndarray, params: dict) -> tuple[bytes, dict]:
    import orjson

    header = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64],
                                       "parameters": {"binary_data_size": 256}}],
                           "outputs": [{"name": "label", "parameters": {"binary_data": False}}], **params})  # fmt: skip
    return header + row.astype("<f4").tobytes(), {"inference-header-content-length": str(len(header)),
                                                  "content-type": "application/octet-stream"}  # fmt: skip


def test_async_true_in_the_body_queues_the_request_and_the_replay_is_never_queued_again(batch_suite, workers):
    row = _digits(1)[0]
    sync = _post(batch_suite, "carol", _body(row), prefer=False).json()["outputs"]
    before = _records(batch_suite)
    top = _infer(batch_suite, "carol", {**_body(row), "async": True})
    nested = _infer(batch_suite, "carol", {**_body(row), "parameters": {"async": True}})
    binary = _infer(batch_suite, "carol", *_binary(row, {"async": True}))
    for reply in (top, nested, binary):
        assert reply.status_code == 202, reply.text
        assert reply.headers["location"] == f"/v2/requests/{reply.json()['id']}"
        assert "preference-applied" not in reply.headers  # no Prefer was sent
    # "async": false and a mere mention of "async" are answered at once, as always.
    assert _same(_infer(batch_suite, "carol", {**_body(row), "async": False}).json()["outputs"], sync)
    assert _same(_infer(batch_suite, "carol", {**_body(row), "parameters": {"tag": "async"}}).json()["outputs"], sync)
    bad = _infer(batch_suite, "carol", {**_body(row), "async": "yes"})
    assert bad.status_code == 400 and "'async' must be true or false" in bad.json()["error"]
    workers("body-flag")
    for reply in (top, nested):
        answer = _result(batch_suite, "carol", reply.json()["id"])
        assert answer.status_code == 200 and _same(answer.json()["outputs"], sync)
    answer = _result(batch_suite, "carol", binary.json()["id"])
    assert answer.status_code == 200, answer.text
    label = [o for o in sync if o["name"] == "label"][0]["data"]
    assert [o for o in answer.json()["outputs"] if o["name"] == "label"][0]["data"] == label
    # Three queued, three records: a replay that were queued again would have made a fourth (and a 202 result).
    assert _records(batch_suite) == before + 3


def _same(outputs: list[dict], expected: list[dict]) -> bool:
    """Same outputs as a synchronous call (floats within rounding: batched with other requests or not)."""
    got, want = ({o["name"]: o["data"] for o in outs} for outs in (outputs, expected))
    return got.keys() == want.keys() and all(np.allclose(got[k], want[k], rtol=1e-4, atol=1e-6) for k in want)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(port: int, name: str, label: str) -> float:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(rf'^{name}\{{status="{label}"\}} ([0-9.e+]+)$', text, re.M)
    return float(found[1]) if found else 0.0


def test_a_request_taken_after_its_deadline_is_answered_504_and_not_run(batch_suite, workers):
    row = _digits(1)[0]
    late = _infer(batch_suite, "carol", {**_body(row), "async": True, "parameters": {"timeout": 200_000}})
    in_time = _infer(batch_suite, "carol", {**_body(row), "async": True, "parameters": {"timeout": 60_000_000}})
    assert late.status_code == 202 and in_time.status_code == 202
    time.sleep(0.6)  # no worker yet: the 200 ms deadline passes in the queue
    port = _free_port()
    workers("deadline", "--metrics-port", str(port))
    expired = _result(batch_suite, "carol", late.json()["id"])
    assert expired.status_code == 504 and expired.headers["aiworks-request-status"] == "expired"
    assert "deadline of 200 ms" in expired.json()["error"] and "not run" in expired.json()["error"]
    assert _result(batch_suite, "carol", in_time.json()["id"]).status_code == 200
    deadline = time.monotonic() + 20
    while _metric(port, "aiworks_nearline_requests_total", "expired") < 1:
        assert time.monotonic() < deadline, "no expired request counted"
        time.sleep(0.2)


class _Hooks(BaseHTTPRequestHandler):
    """/hook: 200; /flaky: 503 twice, then 200; /redirect: 302 to /hook. Every call is recorded with its check."""

    calls: list[dict] = []
    flaky = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        stamp, given = self.headers["aiworks-timestamp"], self.headers["aiworks-signature"]
        mac = hmac.new(CALLBACK_SECRET.encode(), stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
        _Hooks.calls.append({"path": self.path, "body": body, "valid": hmac.compare_digest(given, "sha256=" + mac),
                             "fresh": abs(time.time() - int(stamp)) < 60, "headers": dict(self.headers)})  # fmt: skip
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("location", "/hook")
        elif self.path == "/flaky" and _Hooks.flaky < 2:
            _Hooks.flaky += 1
            self.send_response(503)
        else:
            self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hooks():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hooks)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Hooks.calls, _Hooks.flaky = [], 0
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _callback_status(batch, request_id: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        answer = _result(batch, "alice", request_id)
        if "aiworks-callback-status" in answer.headers:
            return answer.headers["aiworks-callback-status"]
        assert time.monotonic() < deadline, "the callback's outcome was never recorded"
        time.sleep(0.1)


def test_results_are_posted_signed_to_allow_listed_callbacks(batch_suite, workers, hooks):
    row = _digits(1)[0]
    body = {**_body(row), "async": True}
    ok = _infer(batch_suite, "alice", body, {"aiworks-callback": f"{hooks}/hook"})
    flaky = _infer(batch_suite, "alice", body, {"aiworks-callback": f"{hooks}/flaky"})
    moved = _infer(batch_suite, "alice", body, {"aiworks-callback": f"{hooks}/redirect"})
    assert [r.status_code for r in (ok, flaky, moved)] == [202, 202, 202]
    # Refused at submission, naming the host: one alice has not listed, and bob, who lists none.
    other = _infer(batch_suite, "alice", body, {"aiworks-callback": "https://hooks.example.com/x"})
    assert other.status_code == 400 and "'hooks.example.com'" in other.json()["error"]
    bob = _infer(batch_suite, "bob", body, {"aiworks-callback": f"{hooks}/hook"})
    assert bob.status_code == 400 and "'127.0.0.1'" in bob.json()["error"]
    workers("callbacks")
    assert _callback_status(batch_suite, ok.json()["id"]) == "delivered"
    assert _callback_status(batch_suite, flaky.json()["id"]) == "delivered"  # after two 503s and backoff
    assert _callback_status(batch_suite, moved.json()["id"]) == "failed: HTTP 302"
    by_path = {}
    for call in _Hooks.calls:
        by_path.setdefault(call["path"], []).append(call)
    assert sorted(by_path) == ["/flaky", "/hook", "/redirect"]  # /hook once: the redirect was not followed
    assert len(by_path["/hook"]) == 1 and len(by_path["/flaky"]) == 3 and len(by_path["/redirect"]) == 1
    assert all(call["valid"] and call["fresh"] for call in _Hooks.calls)
    delivered = by_path["/hook"][0]
    stored = _result(batch_suite, "alice", ok.json()["id"])
    assert delivered["body"] == stored.content and delivered["headers"]["aiworks-request-id"] == ok.json()["id"]
    assert delivered["headers"]["aiworks-request-status"] == "completed"
    assert delivered["headers"]["aiworks-result-status"] == "200"


class _Gateway(BaseHTTPRequestHandler):
    """Stands where the worker expects the gateway: records what it is sent, answers 200."""

    seen: list[tuple[str, dict, bytes, float]] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        _Gateway.seen.append((self.path, dict(self.headers), body, time.monotonic()))
        answer = b'{"outputs": [], "recorded": true}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def test_the_worker_sends_the_time_left_as_the_timeout_and_no_async_key(batch_suite, workers):
    import orjson

    row = _digits(1)[0]
    json_req = _infer(batch_suite, "carol", {**_body(row), "async": True, "parameters": {"timeout": 5_000_000}})
    body, headers = _binary(row, {"parameters": {"async": True, "timeout": 5_000_000}})
    binary_req = _infer(batch_suite, "carol", body, headers)
    assert json_req.status_code == 202 and binary_req.status_code == 202, binary_req.text
    submitted = time.monotonic()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    _Gateway.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        workers("recorded", "--gateway-url", f"http://127.0.0.1:{server.server_address[1]}")
        for reply in (json_req, binary_req):
            assert _result(batch_suite, "carol", reply.json()["id"]).json()["recorded"] is True
    finally:
        server.shutdown()
        server.server_close()
    assert len(_Gateway.seen) == 2
    for path, sent_headers, sent, arrived in _Gateway.seen:
        queued_us = (arrived - submitted) * 1e6  # at least this long in the queue (the worker started meanwhile)
        assert path == "/v2/models/digits/versions/1/infer" and "prefer" not in {k.lower() for k in sent_headers}
        length = {k.lower(): v for k, v in sent_headers.items()}.get("inference-header-content-length")
        header = orjson.loads(sent[: int(length)] if length else sent)
        assert "async" not in header and "async" not in header["parameters"]
        assert queued_us > 100_000
        assert 0 < header["parameters"]["timeout"] <= 5_000_000 - queued_us + 100_000  # the time left, not all 5 s
        if length:
            assert sent[int(length):] == row.astype("<f4").tobytes()
