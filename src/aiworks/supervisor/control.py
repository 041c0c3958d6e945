"""The supervisor's local control API: how the monitor acts on ``aiworks up``.

The monitor must not own the processes (the supervisor does: it started
them, it stops them), yet it decides when one is restarted or how many
runtimes run. So the supervisor answers a few HTTP calls on 127.0.0.1:

    GET  /v1/services                    every child: name, kind, pid, alive, addresses, replica id
    POST /v1/services/<name>/restart     restart one child (stopped first if it still runs)
    POST /v1/runtime/scale  {"replicas": N}   start or stop runtime replicas to reach N
    POST /v1/stop                        stop the whole suite, as Ctrl-C does
    GET  /healthz

The server is the standard library's threaded HTTP server: the supervisor is
synchronous and these calls are rare. The handler only translates HTTP and
JSON; :class:`ControlTarget` (the :class:`Supervisor`) does the work, and its
errors map to HTTP codes through :mod:`aiworks.core.errors`.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024


class ControlTarget(Protocol):
    """What the control API drives (the supervisor)."""

    def describe(self) -> dict[str, Any]: ...

    def restart(self, name: str) -> dict[str, Any]: ...

    def scale_runtimes(self, replicas: int) -> dict[str, Any]: ...

    def request_stop(self) -> None: ...


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:
        log.debug("control API: " + format, *args)

    def _reply(self, status: int, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise InvalidArgument(f"body over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return {}
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise InvalidArgument(f"body is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise InvalidArgument("body must be a JSON object")
        return doc

    def _dispatch(self, method: str) -> None:
        target = self.server.target
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            body = self._body() if method == "POST" else {}
            if method == "GET" and path == "/v1/services":
                doc = target.describe()
            elif method == "GET" and path == "/healthz":
                doc = {"status": "ok"}
            elif method == "POST" and path.startswith("/v1/services/") and path.endswith("/restart"):
                doc = target.restart(path[len("/v1/services/") : -len("/restart")])
            elif method == "POST" and path == "/v1/runtime/scale":
                replicas = body.get("replicas")
                if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                    raise InvalidArgument('body must be {"replicas": N} with N a whole number >= 0')
                doc = target.scale_runtimes(replicas)
            elif method == "POST" and path == "/v1/stop":
                target.request_stop()
                doc = {"stopping": True}
            else:
                raise NotFound(f"no route {method} {path or '/'}")
        except AIWorksError as exc:
            self._reply(exc.status.http, {"error": exc.message})
        except Exception as exc:  # a bug: answer, keep serving
            log.exception("control API %s %s failed", method, path)
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}"})
        else:
            self._reply(HTTPStatus.OK, doc)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], target: ControlTarget):
        super().__init__(address, _Handler)
        self.target = target


class ControlServer:
    """The control API on ``host:port`` (0: a free port), served from a thread of its own."""

    def __init__(self, target: ControlTarget, host: str = "127.0.0.1", port: int = 0):
        self._server = _Server((host, port), target)
        self.host = host
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="aiworks-control", daemon=True)
        self._thread.start()
        log.info("control API on %s", self.url)

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        self._server.server_close()
