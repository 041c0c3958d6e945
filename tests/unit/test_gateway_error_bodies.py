"""A failure nobody foresaw still answers in the protocol of the route asked: OpenAI's error object under
``/v1/`` (what the ``openai`` client reads), OIP's ``{"error": "..."}`` elsewhere; the body names the
exception's type and never its text (which may hold anything)."""

from __future__ import annotations

from starlette.testclient import TestClient

from aiworks.gateway.http_app import create_app


class BrokenDataPlane:
    """The one call both routes make fails with an exception no handler expects."""

    def authenticate(self, headers):
        return None

    async def repository_index(self, ready_only, headers):
        raise RuntimeError("secret-bearing detail that must not leave the process")


def test_an_unexpected_failure_is_a_500_in_the_routes_own_format():
    app = create_app(BrokenDataPlane(), max_request_bytes=1 << 20)
    with TestClient(app, raise_server_exceptions=False) as client:
        openai = client.get("/v1/models")
        oip = client.post("/v2/repository/index")
    assert openai.status_code == 500 and openai.json() == {"error": {
        "message": "internal error: RuntimeError", "type": "server_error", "param": None, "code": "internal"}}
    assert oip.status_code == 500 and oip.json() == {"error": "internal error: RuntimeError"}
    assert "secret" not in openai.text + oip.text
