"""The supervisor's local control API: how the monitor acts on ``aiworks up``.

The monitor must not own the processes (the supervisor does: it started
them, it stops them), yet it decides when one is restarted or how many
runtimes run. So the supervisor answers a few HTTP calls on 127.0.0.1:

    GET  /v1/services                    every child: name, kind, pid, alive, addresses, replica id
    POST /v1/services/<name>/restart     restart one child (stopped first if it still runs)
    POST /v1/runtime/scale  {"replicas": N}   start or stop runtime replicas to reach N
    POST /v1/stop                        stop the whole suite, as Ctrl-C does
    GET  /healthz

Every route but ``/healthz`` needs ``Authorization: Bearer <caller>.<token>``
(the token derived from the installation's secret file, which the monitor and
the CLI read: :mod:`aiworks.security.callers`), and every POST a JSON
content type and a ``Content-Length``, so a web page cannot drive it
cross-site. ``replicas`` is capped (``max_replicas``).

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

from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound, PayloadTooLarge
from aiworks.security.callers import CallerAuth, check_control_request

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
DEFAULT_MAX_REPLICAS = 64

# Who may call each route (docs/security.md): the monitor acts, the operator's CLI may do all.
_READ = frozenset({"monitor", "admin", "supervisor"})
_ACT = frozenset({"monitor", "admin"})
_STOP = frozenset({"admin"})


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

    def _reply(self, status: int, doc: dict[str, Any], *, close: bool = False) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", 'Bearer realm="aiworks-control"')
        if close:  # a body left unread: this connection cannot carry another request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _check(self, method: str, allowed: frozenset[str], what: str) -> None:
        check_control_request(self.server.auth, self.headers, allowed=allowed, what=what, body=method == "POST")

    def _body(self) -> dict[str, Any]:
        length = int(self.headers["Content-Length"])  # checked by _check: present, digits only
        if length > MAX_BODY_BYTES:
            raise PayloadTooLarge(f"body over {MAX_BODY_BYTES} bytes")
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

    def _route(self, method: str, path: str) -> tuple[frozenset[str], Any]:
        """The callers allowed on a route, and what it does with the JSON body."""
        target = self.server.target
        if method == "GET" and path == "/v1/services":
            return _READ, lambda body: target.describe()
        if method == "POST" and path.startswith("/v1/services/") and path.endswith("/restart"):
            return _ACT, lambda body: target.restart(path[len("/v1/services/") : -len("/restart")])
        if method == "POST" and path == "/v1/runtime/scale":
            return _ACT, self._scale
        if method == "POST" and path == "/v1/stop":
            return _STOP, lambda body: (target.request_stop(), {"stopping": True})[1]
        raise NotFound(f"no route {method} {path or '/'}")

    def _scale(self, body: dict[str, Any]) -> dict[str, Any]:
        replicas, most = body.get("replicas"), self.server.max_replicas
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 0 <= replicas <= most:
            raise InvalidArgument(f'body must be {{"replicas": N}} with N a whole number from 0 to {most}')
        return self.server.target.scale_runtimes(replicas)

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        body_read = method != "POST"
        try:
            if method == "GET" and path == "/healthz":
                doc = {"status": "ok"}
            else:
                allowed, action = self._route(method, path)
                self._check(method, allowed, f"{method} {path}")
                body = self._body() if method == "POST" else {}
                body_read = True
                doc = action(body)
        except AIWorksError as exc:
            self._reply(exc.status.http, {"error": exc.message}, close=not body_read)
        except Exception as exc:  # a bug: answer, keep serving
            log.exception("control API %s %s failed", method, path)
            error = {"error": f"{type(exc).__name__}: {exc}"}
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, error, close=not body_read)
        else:
            self._reply(HTTPStatus.OK, doc)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], target: ControlTarget, auth: CallerAuth | None, max_replicas: int):
        super().__init__(address, _Handler)
        self.target = target
        self.auth = auth
        self.max_replicas = max_replicas


class ControlServer:
    """The control API on ``host:port`` (0: a free port), served from a thread of its own.

    ``auth`` checks the bearer tokens (``None``: every route but /healthz is
    refused); ``max_replicas`` caps ``POST /v1/runtime/scale``.
    """

    def __init__(
        self,
        target: ControlTarget,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        auth: CallerAuth | None = None,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
    ):
        self._server = _Server((host, port), target, auth, max_replicas)
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
