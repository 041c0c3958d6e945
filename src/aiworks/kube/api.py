"""A thin in-cluster Kubernetes API client: the Secrets the chart's install hook reads and writes.

Only what the hook needs (get, create and replace a Secret), over the
standard library, so the hook runs in the gateway image without the
Kubernetes client. It reads the pod's in-cluster configuration as every
client does: ``KUBERNETES_SERVICE_HOST`` / ``KUBERNETES_SERVICE_PORT`` and the
ServiceAccount folder (token, ``ca.crt``, ``namespace``) that the kubelet
mounts at :data:`SERVICE_ACCOUNT_DIR`.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from aiworks.core.errors import AIWorksError, Status

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class Secret:
    """One Secret: its name, decoded data, labels and resourceVersion (for a replace)."""

    name: str
    data: dict[str, bytes]
    labels: dict[str, str]
    resource_version: str = ""


class KubeAPI:
    """Calls the API server with the pod's ServiceAccount token."""

    def __init__(self, server: str, token: str, ca_file: Path, namespace: str, timeout_s: float = 10.0):
        self.server = server.rstrip("/")
        self.namespace = namespace
        self._token = token
        self._context = ssl.create_default_context(cafile=str(ca_file))
        self._timeout_s = timeout_s

    @classmethod
    def in_cluster(cls, env: Mapping[str, str] | None = None, account_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeAPI:
        env = os.environ if env is None else env
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise AIWorksError(
                "not in a Kubernetes pod: KUBERNETES_SERVICE_HOST is not set", Status.FAILED_PRECONDITION
            )
        try:
            token = (account_dir / "token").read_text().strip()
            namespace = (account_dir / "namespace").read_text().strip()
        except OSError as exc:
            raise AIWorksError(
                f"no ServiceAccount token in {account_dir} ({exc.strerror}); the pod needs "
                "automountServiceAccountToken: true",
                Status.FAILED_PRECONDITION,
            ) from None
        server_host = f"[{host}]" if ":" in host else host
        return cls(f"https://{server_host}:{port}", token, account_dir / "ca.crt", namespace)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self._token}", "Accept": "application/json",
                     **({"Content-Type": "application/json"} if data else {})},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s, context=self._context) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and method == "GET":
                return None
            detail = ""
            try:
                detail = json.load(exc).get("message", "")
            except ValueError:
                pass
            status = {403: Status.PERMISSION_DENIED, 409: Status.ALREADY_EXISTS, 404: Status.NOT_FOUND}.get(
                exc.code, Status.UNAVAILABLE
            )
            raise AIWorksError(f"Kubernetes API: {method} {path}: {exc.code} {detail or exc.reason}", status) from None
        except (urllib.error.URLError, OSError) as exc:
            raise AIWorksError(f"Kubernetes API unreachable ({self.server}): {getattr(exc, 'reason', exc)}",
                               Status.UNAVAILABLE) from None

    def _secrets(self, name: str = "") -> str:
        return f"/api/v1/namespaces/{self.namespace}/secrets" + (f"/{name}" if name else "")

    def get_secret(self, name: str) -> Secret | None:
        doc = self._call("GET", self._secrets(name))
        if doc is None:
            return None
        meta = doc.get("metadata", {})
        data = {k: base64.b64decode(v) for k, v in (doc.get("data") or {}).items()}
        return Secret(name, data, dict(meta.get("labels") or {}), meta.get("resourceVersion", ""))

    def put_secret(self, secret: Secret, *, secret_type: str = "Opaque") -> None:
        """Create the Secret, or replace it when ``secret.resource_version`` names the version read."""
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": secret_type,
            "metadata": {"name": secret.name, "namespace": self.namespace, "labels": secret.labels},
            "data": {k: base64.b64encode(v).decode() for k, v in secret.data.items()},
        }
        if secret.resource_version:
            body["metadata"]["resourceVersion"] = secret.resource_version
            self._call("PUT", self._secrets(secret.name), body)
        else:
            self._call("POST", self._secrets(), body)
