"""Read-only Google Cloud Storage client over the JSON API (objects.list, objects.get ?alt=media).

Configuration follows Google's client libraries:

- ``STORAGE_EMULATOR_HOST`` (``http://host:port``): an emulator such as
  fake-gcs-server; requests go there, unauthenticated.
- Otherwise requests go to ``https://storage.googleapis.com`` with an access
  token from the metadata server (``GCE_METADATA_HOST``, default
  ``metadata.google.internal``), which is how a GKE pod with Workload
  Identity, or a GCE VM, gets one. Service-account key files are not read:
  on GKE bind the pod's Kubernetes ServiceAccount to a Google one instead.
- ``GCS_ANONYMOUS=true``: no token at all (public buckets).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from typing import BinaryIO

from aiworks.core.errors import AIWorksError, NotFound, PermissionDenied, Status

_CHUNK = 1 << 20
_TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"


class GCSClient:
    """Lists and downloads objects of one bucket."""

    def __init__(self, bucket: str, env: Mapping[str, str] | None = None, timeout_s: float = 60.0):
        env = os.environ if env is None else env
        self.bucket = bucket
        self.timeout_s = timeout_s
        emulator = env.get("STORAGE_EMULATOR_HOST", "")
        if emulator and "://" not in emulator:
            emulator = "http://" + emulator
        self.base = (emulator or "https://storage.googleapis.com").rstrip("/")
        self.anonymous = bool(emulator) or env.get("GCS_ANONYMOUS", "").lower() in ("1", "true", "yes")
        self.metadata_host = env.get("GCE_METADATA_HOST") or "metadata.google.internal"
        self._token: tuple[str, float] | None = None

    def _bearer(self) -> dict[str, str]:
        if self.anonymous:
            return {}
        if self._token is None or self._token[1] < time.monotonic() + 60:
            request = urllib.request.Request(
                f"http://{self.metadata_host}{_TOKEN_PATH}", headers={"Metadata-Flavor": "Google"}
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    doc = json.load(reply)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                raise AIWorksError(
                    f"no Google access token from the metadata server ({self.metadata_host}): {exc}; on GKE use "
                    "Workload Identity, or set GCS_ANONYMOUS=true for a public bucket",
                    Status.UNAVAILABLE,
                ) from None
            self._token = (doc["access_token"], time.monotonic() + float(doc.get("expires_in", 300)))
        return {"Authorization": f"Bearer {self._token[0]}"}

    def _open(self, url: str):
        request = urllib.request.Request(url, headers=self._bearer())
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise _error(exc, self.bucket) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AIWorksError(f"GCS unreachable ({self.base}): {reason}", Status.UNAVAILABLE) from None

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """``(name, size)`` of every object under ``prefix``."""
        token = ""
        bucket = urllib.parse.quote(self.bucket, safe="")
        while True:
            query = {"prefix": prefix, "fields": "items(name,size),nextPageToken"}
            if token:
                query["pageToken"] = token
            url = f"{self.base}/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(query)}"
            with self._open(url) as reply:
                doc = json.load(reply)
            for item in doc.get("items", []):
                yield item["name"], int(item.get("size", 0))
            token = doc.get("nextPageToken", "")
            if not token:
                return

    def download(self, name: str, out: BinaryIO, max_bytes: int) -> int:
        """Stream one object into ``out``; returns its size."""
        bucket = urllib.parse.quote(self.bucket, safe="")
        url = f"{self.base}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"
        written = 0
        with self._open(url) as reply:
            while chunk := reply.read(_CHUNK):
                written += len(chunk)
                if written > max_bytes:
                    raise AIWorksError(f"gs://{self.bucket}/{name} is larger than {max_bytes} bytes", Status.PAYLOAD_TOO_LARGE)
                out.write(chunk)
        return written


def _error(exc: urllib.error.HTTPError, bucket: str) -> AIWorksError:
    message = ""
    try:
        message = json.loads(exc.read()).get("error", {}).get("message", "")
    except (ValueError, AttributeError):
        pass
    text = f"GCS refused ({exc.code} {message or exc.reason}) for bucket '{bucket}'"
    if exc.code == 404:
        return NotFound(text)
    if exc.code in (401, 403):
        return PermissionDenied(text)
    return AIWorksError(text, Status.UNAVAILABLE if exc.code >= 500 else Status.INVALID_ARGUMENT)
