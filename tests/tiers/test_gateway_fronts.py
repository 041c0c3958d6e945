"""The gateway's tier routes without the rest of the suite: off unless configured, and out of the way.

The full behaviour runs against real processes in test_batch_jobs.py and
test_nearline.py; here only the wiring: no Batch API routes on a gateway
without a file store, the async front passing every other request through
untouched, and the multipart parser of ``POST /v1/files``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from fuzz.test_multipart import parse_cut

from aiworks.core.errors import InvalidArgument
from aiworks.gateway.async_routes import AsyncInferFront
from aiworks.gateway.auth import generate_api_key
from aiworks.gateway.http_app import create_app
from aiworks.gateway.multipart import PART_END, FormStream, Part, boundary_of


def test_a_gateway_without_a_batch_store_has_no_batch_routes():
    app = create_app(None, max_request_bytes=1 << 20)  # the dataplane is only used by requests
    paths = set(app.app.openapi()["paths"])
    assert "/v2/models/{model}/infer" in paths
    assert not [p for p in paths if p.startswith(("/v1/files", "/v1/batches"))]  # /v1/completions etc. stay
    assert not isinstance(app, AsyncInferFront)  # nor the async front, without a queue


def _call(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    seen = []

    async def inner(scope, receive, send):
        seen.append((scope["method"], scope["path"]))

    front = AsyncInferFront(inner, dataplane=None, queue=None, max_request_bytes=1024, max_backlog=1)
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(front(scope, None, None))
    return seen


def test_the_async_front_passes_through_what_is_not_async():
    plain = [(b"content-type", b"application/json")]
    assert _call("POST", "/v2/models/iris/infer", plain) == [("POST", "/v2/models/iris/infer")]
    prefer = [(b"prefer", b"respond-async")]
    assert _call("POST", "/v2/repository/index", prefer) == [("POST", "/v2/repository/index")]
    assert _call("GET", "/v2/models/iris", prefer) == [("GET", "/v2/models/iris")]


def _form(content_type: str, body: bytes, step: int | None = None) -> list:
    """The events of a body fed whole, or ``step`` bytes at a time; the parts' bytes joined."""
    return parse_cut(body, list(range(step, len(body), step)) if step else [], boundary_of(content_type))


def test_multipart_uploads_are_parsed_as_they_arrive_and_bad_ones_refused():
    body = (
        b"preamble\r\n--XX\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        b"--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
        b"Content-Type: application/jsonl\r\n\r\n{\"a\": 1}\r\n--X\n{\"b\": 2}\n\r\n--XX--\r\nepilogue"
    )
    expected = [Part("purpose", None), b"batch", PART_END, Part("file", "in.jsonl"),
                b'{"a": 1}\r\n--X\n{"b": 2}\n', PART_END]  # fmt: skip
    content_type = 'multipart/form-data; boundary="XX"'
    for step in (None, 1, 2, 3, 5, 7, 64):  # every split of a delimiter across chunks
        assert _form(content_type, body, step) == expected, step
    with pytest.raises(InvalidArgument, match="multipart/form-data"):
        boundary_of("application/json")
    for bad in ("multipart/form-data", "multipart/form-data; boundary*=utf-8''%E2%82%AC", "multipart/form-data; boundary=" + "a" * 71):
        with pytest.raises(InvalidArgument, match="boundary"):
            boundary_of(bad)
    with pytest.raises(InvalidArgument, match="closing boundary"):
        _form(content_type, body[: body.index(b"--XX--")])
    with pytest.raises(InvalidArgument, match="headers exceed"):
        FormStream(b"XX").feed(b"--XX\r\n" + b"A" * 20_000)
    with pytest.raises(InvalidArgument, match="without a name"):
        _form(content_type, b"--XX\r\nContent-Disposition: form-data\r\n\r\nx\r\n--XX--")
    # what stays buffered inside a part is at most a delimiter's length, whatever the chunk
    form = FormStream(b"XX")
    form.feed(b"--XX\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\n")
    assert sum(len(e) for e in form.feed(b"y" * 1_000_000)) >= 1_000_000 - 6
def test_async_in_the_body_without_a_queue_is_refused_naming_the_setting():
    """An explicit body flag is not a preference: with no queue it is a 400, never a silent synchronous answer."""
    from starlette.testclient import TestClient

    from aiworks.gateway.dataplane import GatewayDataPlane

    app = create_app(GatewayDataPlane(scheduler=None, routing=None), max_request_bytes=1 << 20)
    inputs = [{"name": "input", "datatype": "FP32", "shape": [1, 1], "data": [0.0]}]
    with TestClient(app) as client:
        for body in ({"async": True, "inputs": inputs}, {"inputs": inputs, "parameters": {"async": True}}):
            reply = client.post("/v2/models/digits/infer", json=body)
            assert reply.status_code == 400, reply.text
            assert "AIWORKS_GATEWAY_ASYNC_REQUESTS" in reply.json()["error"]
        binary = b'{"async":true,"inputs":[{"name":"input","datatype":"FP32","shape":[1,1],' \
                 b'"parameters":{"binary_data_size":4}}]}'  # fmt: skip
        reply = client.post("/v2/models/digits/infer", content=binary + b"\x00" * 4,
                            headers={"inference-header-content-length": str(len(binary))})  # fmt: skip
        assert reply.status_code == 400 and "AIWORKS_GATEWAY_ASYNC_REQUESTS" in reply.json()["error"]
        wrong = client.post("/v2/models/digits/infer", json={"async": 1, "inputs": inputs})
        assert wrong.status_code == 400 and "'async' must be true or false" in wrong.json()["error"]


def test_the_flag_parse_keeps_the_parsers_bounds_and_messages():
    """Only a body mentioning "async" is parsed twice: within the same value cap, and errors left to the parser."""
    from aiworks.core.errors import PayloadTooLarge
    from aiworks.gateway.filters import InputLimits
    from aiworks.nearline.body import take_async_flag

    limits = InputLimits(max_listed_values=10)
    hostile = b'{"async": true, "inputs": [' + b"0," * 100 + b"0]}"
    with pytest.raises(PayloadTooLarge, match="max_listed_values"):
        take_async_flag(hostile, None, limits)
    broken = b'{"async": true, "inputs": ['
    assert take_async_flag(broken, None, limits).body is broken  # the parser reports the malformed JSON
    assert take_async_flag(b'{"async": true}', "x9", limits).flag is None  # and the bad header length


def test_a_queue_store_that_cannot_be_reached_is_a_503_with_retry_after_not_a_500():
    """Redis down (or every pooled connection busy under a burst): the caller is told to come back, by status."""
    from types import SimpleNamespace

    from aiworks.nearline.queue import AsyncQueue
    from aiworks.supervisor.supervisor import free_port

    queue = AsyncQueue.from_url(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    caller = SimpleNamespace(authenticate=lambda headers: SimpleNamespace(tenant_id="t"),
                             refuse_work_token=lambda principal, what: None)  # fmt: skip
    front = AsyncInferFront(None, dataplane=caller, queue=queue, max_request_bytes=1024, max_backlog=1)
    sent = []

    async def send(message):
        sent.append(message)

    async def run():
        scope = {"type": "http", "method": "GET", "path": "/v2/requests/req_abc", "headers": []}
        await front(scope, None, send)
        await queue.close()

    asyncio.run(run())
    start, body = sent
    assert start["status"] == 503, sent
    assert (b"retry-after", b"1") in start["headers"]
    assert b"unreachable or busy" in body["body"]


def test_a_gateway_with_tenants_and_a_tier_will_not_start_without_the_credential_key(tmp_path):
    """It would have to keep callers' credentials in Redis in clear: it stops first, naming the setting."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - id: acme\n    api_keys: ['{generate_api_key()[1]}']\n")
    command = [sys.executable, "-m", "aiworks", "gateway", "--scheduler-address", "127.0.0.1:1", "--metrics-port", "0"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIWORKS_GATEWAY_")}
    for tier in ({"AIWORKS_GATEWAY_BATCH_FILES_URL": str(tmp_path / "files")},
                 {"AIWORKS_GATEWAY_ASYNC_REQUESTS": "true"}):  # fmt: skip
        env = {**base, "AIWORKS_GATEWAY_TENANTS_FILE": str(tenants), **tier}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE" in done.stderr, done.stderr
        missing = {**env, "AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE": str(tmp_path / "nowhere")}
        done = subprocess.run(command, env=missing, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0, done.stderr
        assert f"AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE: credential key file {tmp_path / 'nowhere'} does not exist" in (
            done.stderr
        )
