"""InferFastPath: which requests it takes, and that its answers keep the HTTP contract.

The full path (auth, limits, codec, scheduler) runs in the e2e, tenancy and
qos tests over real processes; here the inference itself is replaced, to pin
the routing and the error answers of the ASGI layer alone.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from aiworks.core.errors import NotFound, ResourceExhausted, Unauthenticated
from aiworks.gateway import http_app
from aiworks.gateway.http_app import InferFastPath


class Recorder:
    """Stands in for the FastAPI app: records what it was given and answers 299."""

    def __init__(self):
        self.paths: list[tuple[str, str]] = []

    async def __call__(self, scope, receive, send):
        self.paths.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def call(app, method: str, path: str, body: bytes = b"{}", *, disconnect: bool = False) -> dict:
    scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-length", b"%d" % len(body))]}
    sent: list[dict] = []

    async def receive():
        if disconnect:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    if not sent:
        return {}
    start, body_msg = sent
    return {"status": start["status"], "headers": dict(start["headers"]), "body": body_msg["body"]}


@pytest.fixture
def fast(monkeypatch):
    taken: list[tuple[str, str, bytes]] = []
    outcome: dict = {"result": (b'{"outputs": []}', None, None)}

    async def fake_infer(dataplane, max_request_bytes, model, version, headers, body_stream, submit_async=None):
        body = b"".join([chunk async for chunk in body_stream])
        taken.append((model, version, body))
        if isinstance(outcome["result"], BaseException):
            raise outcome["result"]
        return outcome["result"]

    monkeypatch.setattr(http_app, "_infer", fake_infer)
    recorder = Recorder()
    return InferFastPath(recorder, dataplane=None, max_request_bytes=1 << 20), recorder, taken, outcome


def test_takes_only_post_infer_routes(fast):
    app, recorder, taken, _ = fast
    assert call(app, "POST", "/v2/models/digits/versions/2/infer", b"x")["status"] == 200
    assert call(app, "POST", "/v2/models/iris/infer", b"y")["status"] == 200
    assert taken == [("digits", "2", b"x"), ("iris", "", b"y")]
    for method, path in [
        ("GET", "/v2/models/iris/infer"),
        ("POST", "/v2/repository/index"),
        ("POST", "/v2/models/a/b/infer"),
        ("POST", "/v2/models/iris/infer/extra"),
    ]:
        assert call(app, method, path)["status"] == 299
    assert len(recorder.paths) == 4 and len(taken) == 2


def test_json_and_binary_answers_carry_their_headers(fast):
    app, _, _, outcome = fast
    answer = call(app, "POST", "/v2/models/iris/infer")
    assert answer["headers"][b"content-type"] == b"application/json"
    assert answer["headers"][b"content-length"] == str(len(answer["body"])).encode()
    assert b"content-encoding" not in answer["headers"]
    outcome["result"] = (b'{"outputs":[]}' + b"\0" * 8, 14, None)
    answer = call(app, "POST", "/v2/models/iris/infer")
    assert answer["headers"][b"content-type"] == b"application/octet-stream"
    assert answer["headers"][b"inference-header-content-length"] == b"14"
    outcome["result"] = (b"compressed", 14, "gzip")  # the header's length counts the decompressed body
    answer = call(app, "POST", "/v2/models/iris/infer")
    assert answer["headers"][b"content-encoding"] == b"gzip"
    assert answer["headers"][b"inference-header-content-length"] == b"14"
    assert answer["headers"][b"content-length"] == b"10"


@pytest.mark.parametrize(
    ("error", "status", "header"),
    [
        (ResourceExhausted("queue of 'iris' is full", retry_after_s=2.2), 429, (b"retry-after", b"3")),
        (Unauthenticated("API key is not recognised"), 401, (b"www-authenticate", b'Bearer realm="aiworks"')),
        (NotFound("unknown model 'nope'"), 404, None),
    ],
)
def test_errors_leave_through_the_one_table(fast, error, status, header):
    app, _, _, outcome = fast
    outcome["result"] = error
    answer = call(app, "POST", "/v2/models/iris/infer")
    assert answer["status"] == status
    assert orjson.loads(answer["body"]) == {"error": error.message}
    if header is not None:
        assert answer["headers"][header[0]] == header[1]


def test_an_unexpected_failure_is_a_500_that_names_it(fast):
    app, _, _, outcome = fast
    outcome["result"] = KeyError("boom")
    answer = call(app, "POST", "/v2/models/iris/infer")
    assert answer["status"] == 500 and orjson.loads(answer["body"]) == {"error": "internal error: KeyError"}


def test_a_client_gone_before_its_body_gets_no_answer(fast):
    app, _, taken, _ = fast
    assert call(app, "POST", "/v2/models/iris/infer", disconnect=True) == {}
    assert taken == []
