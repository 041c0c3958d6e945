"""The one stand-in of the box: a Kubernetes API server, because there is no cluster here.

It is deliberately thin. It serves over HTTPS with its own CA, as an API
server does, what the release's code calls: Secrets (get, create, replace:
the install hook), pods and Deployments (list by label selector, delete a
pod, scale a Deployment: the monitor's Kubernetes platform). Tokens must be
ones the box mounted into a pod; RBAC is not evaluated (the chart's Roles are
checked by the render tests instead). Objects are plain JSON as the API
returns them; pods and Deployments come from the box's own records.
"""

from __future__ import annotations

import base64
import json
import re
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors (``a=b,c=d``), which is what the suite's code sends."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, _, value = term.partition("=")
        if labels.get(key) != value.lstrip("="):
            return False
    return True


class FakeAPIServer:
    """HTTPS on ``address:443``; ``pods()`` and ``deployments()`` are the box's objects, read per request."""

    def __init__(
        self,
        address: str,
        cert: Path,
        key: Path,
        tokens: dict[str, str],
        pods: Callable[[], list[dict]],
        deployments: Callable[[], list[dict]],
        delete_pod: Callable[[str], bool],
        scale: Callable[[str, int], bool],
        port: int = 443,
    ):
        self.secrets: dict[tuple[str, str], dict] = {}
        self.tokens = tokens  # token -> "system:serviceaccount:<ns>:<name>"
        self.calls: list[tuple[str, str, str]] = []  # (who, method, path)
        self._lock = threading.Lock()
        self._version = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._reply(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                                   "reason": reason, "code": code})  # fmt: skip

            def _handle(self, method: str) -> None:
                scheme, _, token = self.headers.get("Authorization", "").partition(" ")
                who = api.tokens.get(token.strip()) if scheme.lower() == "bearer" else None
                if who is None:
                    return self._status(401, "Unauthorized", "Unauthorized")
                url = urlsplit(self.path)
                api.calls.append((who, method, url.path))
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                selector = parse_qs(url.query).get("labelSelector", [""])[0]
                if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/secrets(?:/([^/]+))?", url.path):
                    return api._secrets(self, method, m.group(1), m.group(2), body)
                if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?", url.path):
                    if method == "GET" and not m.group(2):
                        items = [p for p in pods() if selector_matches(selector, p["metadata"].get("labels", {}))]
                        return self._reply(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
                    if method == "DELETE" and m.group(2):
                        if delete_pod(m.group(2)):
                            return self._reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})
                        return self._status(404, "NotFound", f'pods "{m.group(2)}" not found')
                if m := re.fullmatch(r"/apis/apps/v1/namespaces/([^/]+)/deployments(?:/([^/]+)/scale)?", url.path):
                    if method == "GET" and not m.group(2):
                        items = [d for d in deployments() if selector_matches(selector, d["metadata"].get("labels", {}))]
                        return self._reply(200, {"kind": "DeploymentList", "apiVersion": "apps/v1", "metadata": {},
                                                 "items": items})  # fmt: skip
                    if method == "PATCH" and m.group(2):
                        replicas = int(body["spec"]["replicas"])
                        if scale(m.group(2), replicas):
                            return self._reply(200, {"kind": "Scale", "apiVersion": "autoscaling/v1",
                                                     "metadata": {"name": m.group(2)}, "spec": {"replicas": replicas}})
                        return self._status(404, "NotFound", f'deployments "{m.group(2)}" not found')
                return self._status(404, "NotFound", f"the box's API server does not serve {method} {url.path}")

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PUT(self) -> None:
                self._handle("PUT")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

        self.server = ThreadingHTTPServer((address, port), Handler)
        self.port = self.server.server_address[1]
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self._thread = threading.Thread(target=self.server.serve_forever, name="apiserver", daemon=True)
        self._thread.start()

    def _secrets(self, handler, method: str, namespace: str, name: str | None, body: dict | None) -> None:
        with self._lock:
            if method == "GET" and name:
                found = self.secrets.get((namespace, name))
                if found is None:
                    return handler._status(404, "NotFound", f'secrets "{name}" not found')
                return handler._reply(200, found)
            if method == "POST" and not name:
                key = (namespace, body["metadata"]["name"])
                if key in self.secrets:
                    return handler._status(409, "AlreadyExists", f'secrets "{key[1]}" already exists')
                return handler._reply(201, self._store(key, body))
            if method == "PUT" and name:
                current = self.secrets.get((namespace, name))
                if current is None:
                    return handler._status(404, "NotFound", f'secrets "{name}" not found')
                if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                    return handler._status(409, "Conflict", "the object has been modified")
                return handler._reply(200, self._store((namespace, name), body))
        return handler._status(405, "MethodNotAllowed", f"{method} on secrets")

    def _store(self, key: tuple[str, str], body: dict) -> dict:
        self._version += 1
        body = json.loads(json.dumps(body))
        body["metadata"]["namespace"] = key[0]
        body["metadata"]["resourceVersion"] = str(self._version)
        self.secrets[key] = body
        return body

    def put_secret(self, namespace: str, name: str, data: dict[str, bytes]) -> None:
        """A Secret that exists before the install (an operator's)."""
        with self._lock:
            self._store((namespace, name), {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                                            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}})

    def secret_data(self, namespace: str, name: str) -> dict[str, bytes] | None:
        with self._lock:
            found = self.secrets.get((namespace, name))
        if found is None:
            return None
        return {k: base64.b64decode(v) for k, v in (found.get("data") or {}).items()}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
