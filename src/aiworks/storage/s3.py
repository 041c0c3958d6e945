"""Small S3 client: ListObjectsV2, GetObject, PutObject (multipart above 5 GiB) and DeleteObject, signed with AWS
Signature Version 4.

Only what the storage initializer and the batch jobs (docs/tiers.md) need, over the standard library, so the
runtime image carries no AWS SDK. Configuration follows the AWS SDKs'
standard environment variables:

- ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``:
  credentials; none set: unsigned requests (a public bucket);
- ``AWS_REGION`` or ``AWS_DEFAULT_REGION`` (default ``us-east-1``);
- ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``: an S3-compatible server
  (MinIO, SeaweedFS, Ceph); requests then use path-style addressing, as
  such servers expect. Without one: AWS, virtual-hosted style.
- ``AWS_CA_BUNDLE``: CA file that signs the endpoint's certificate.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import BinaryIO
from xml.sax.saxutils import escape

from aiworks.core.errors import AIWorksError, NotFound, PermissionDenied, Status

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_UNSIGNED = "UNSIGNED-PAYLOAD"
_CHUNK = 1 << 20
SINGLE_PUT_MAX = 5 << 30  # S3's largest PutObject
PART_BYTES = 64 << 20  # a multipart upload's part (S3: 5 MiB to 5 GiB each, but the last)
MAX_PARTS = 10_000  # S3's most parts of one upload


@dataclass(frozen=True)
class S3Config:
    """Where the objects are and who reads them."""

    region: str = "us-east-1"
    endpoint: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    session_token: str | None = None
    ca_bundle: str | None = None
    timeout_s: float = 60.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Config:
        env = os.environ if env is None else env
        return cls(
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            endpoint=(env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None),
            access_key=env.get("AWS_ACCESS_KEY_ID") or None,
            secret_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
            session_token=env.get("AWS_SESSION_TOKEN") or None,
            ca_bundle=env.get("AWS_CA_BUNDLE") or None,
        )


def _sign(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _quote(text: str, safe: str = "-_.~") -> str:
    return urllib.parse.quote(text, safe=safe)


def sigv4_headers(
    config: S3Config, method: str, url: str, *, now: dt.datetime | None = None, payload_hash: str = _EMPTY_SHA256
) -> dict[str, str]:
    """The headers that sign one request (AWS Signature Version 4, service ``s3``).

    ``url`` carries its query already encoded; the canonical query sorts it.
    """
    parts = urllib.parse.urlsplit(url)
    now = now or dt.datetime.now(dt.UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    if config.session_token:
        headers["x-amz-security-token"] = config.session_token
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query))
    signed = sorted(headers)
    canonical = "\n".join(
        [
            method,
            _quote(urllib.parse.unquote(parts.path) or "/", safe="-_.~/"),
            canonical_query,
            "".join(f"{name}:{headers[name].strip()}\n" for name in signed),
            ";".join(signed),
            payload_hash,
        ]
    )
    scope = f"{day}/{config.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _sign(_sign(_sign(_sign(f"AWS4{config.secret_key}".encode(), day), config.region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={config.access_key}/{scope}, SignedHeaders={';'.join(signed)}, "
        f"Signature={signature}"
    )
    del headers["host"]  # urllib sets it from the URL
    return headers


class S3Client:
    """Lists, downloads, writes and deletes objects of one bucket."""

    def __init__(self, bucket: str, config: S3Config | None = None):
        self.bucket = bucket
        self.config = config or S3Config.from_env()
        self._context = ssl.create_default_context(cafile=self.config.ca_bundle) if self.config.ca_bundle else None

    def _url(self, key: str = "", query: dict[str, str] | None = None) -> str:
        path = "/" + _quote(key, safe="-_.~/")
        if self.config.endpoint:  # path style: what S3-compatible servers expect
            url = self.config.endpoint.rstrip("/") + "/" + _quote(self.bucket) + path
        elif self.config.region == "us-east-1":
            url = f"https://{self.bucket}.s3.amazonaws.com{path}"
        else:
            url = f"https://{self.bucket}.s3.{self.config.region}.amazonaws.com{path}"
        if query:
            url += "?" + "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query.items()))
        return url

    def _open(self, url: str, method: str = "GET", body: bytes | BinaryIO | None = None, length: int | None = None,
              extra: Mapping[str, str] | None = None):  # fmt: skip
        headers = {}
        payload = _UNSIGNED if self.config.access_key or body is not None else _EMPTY_SHA256
        if self.config.access_key and self.config.secret_key:
            headers = sigv4_headers(self.config, method, url, payload_hash=payload)
        if length is not None:  # a file as the body: urllib would send it chunked, which S3 refuses
            headers["Content-Length"] = str(length)
        headers.update(extra or {})  # unsigned headers (Range, If-Match): SigV4 needs only host and x-amz-*
        request = urllib.request.Request(url, data=body, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.config.timeout_s, context=self._context)
        except urllib.error.HTTPError as exc:
            raise _error(exc, self.bucket) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AIWorksError(f"S3 endpoint unreachable ({url.split('?')[0]}): {reason}", Status.UNAVAILABLE) from None

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix``."""
        token = None
        while True:
            query = {"list-type": "2", "prefix": prefix}
            if token:
                query["continuation-token"] = token
            with self._open(self._url(query=query)) as reply:
                root = ET.fromstring(reply.read())
            ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            for item in root.iter(f"{ns}Contents"):
                yield item.findtext(f"{ns}Key", ""), int(item.findtext(f"{ns}Size", "0"))
            if root.findtext(f"{ns}IsTruncated", "false") != "true":
                return
            token = root.findtext(f"{ns}NextContinuationToken")
            if not token:
                return

    def upload(self, key: str, body: bytes) -> None:
        """Write one object (PutObject), replacing any of the same key."""
        with self._open(self._url(key), "PUT", body) as reply:
            reply.read()

    def upload_file(self, key: str, body: BinaryIO, size: int, *, single_max: int = SINGLE_PUT_MAX,
                    part_bytes: int = PART_BYTES) -> None:  # fmt: skip
        """Write one object from an open file of ``size`` bytes, streamed from where it stands.

        Up to ``single_max`` (S3's limit of one PutObject, 5 GiB): one PutObject. Larger: a multipart upload
        of parts of ``part_bytes`` or more (as many as S3's 10,000 parts need), each streamed from the file
        with its own Content-Length, so no part is held in memory; one that fails aborts the upload, so no
        parts are left behind to be billed."""
        if size <= single_max:
            with self._open(self._url(key), "PUT", body, length=size) as reply:
                reply.read()
            return
        part_bytes = max(part_bytes, -(-size // MAX_PARTS))
        with self._open(self._url(key, {"uploads": ""}), "POST", b"") as reply:
            upload_id = _find(ET.fromstring(reply.read()), "UploadId")
        if not upload_id:
            raise AIWorksError(f"S3 gave no UploadId for s3://{self.bucket}/{key}", Status.UNAVAILABLE)
        try:
            etags = []
            for number, start in enumerate(range(0, size, part_bytes), 1):
                length = min(part_bytes, size - start)
                query = {"partNumber": str(number), "uploadId": upload_id}
                with self._open(self._url(key, query), "PUT", _Window(body, length), length=length) as reply:
                    reply.read()
                    etags.append(reply.headers.get("ETag", ""))
            parts = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{escape(tag)}</ETag></Part>"
                            for n, tag in enumerate(etags, 1))  # fmt: skip
            document = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
            with self._open(self._url(key, {"uploadId": upload_id}), "POST", document) as reply:
                root = ET.fromstring(reply.read())  # S3 may answer 200 with an <Error> once it has begun
            if root.tag.rpartition("}")[2] == "Error":
                raise AIWorksError(f"S3 refused to complete s3://{self.bucket}/{key}: {_find(root, 'Code')} "
                                   f"{_find(root, 'Message')}", Status.UNAVAILABLE)  # fmt: skip
        except BaseException:
            try:
                with self._open(self._url(key, {"uploadId": upload_id}), "DELETE") as reply:
                    reply.read()
            except AIWorksError:
                pass  # the first error is the one to report; a bucket lifecycle rule cleans what is left
            raise

    def delete(self, key: str) -> None:
        """Remove one object (DeleteObject); a missing key is no error."""
        with self._open(self._url(key), "DELETE") as reply:
            reply.read()

    def exists(self, key: str) -> bool:
        """Whether ``key`` names an object (HeadObject)."""
        try:
            with self._open(self._url(key), "HEAD") as reply:
                reply.read()
        except NotFound:
            return False
        return True

    def head(self, key: str) -> tuple[int, str]:
        """``(size, ETag)`` of one object (HeadObject)."""
        with self._open(self._url(key), "HEAD") as reply:
            reply.read()
            return int(reply.headers.get("Content-Length", "0")), reply.headers.get("ETag", "")

    def read_range(self, key: str, start: int, end: int, etag: str = "") -> bytes:
        """Bytes ``[start, end)`` of one object (a ranged GetObject); with ``etag``, only of that version of it
        (``If-Match``: a 412 from S3, an error here, once the object has been replaced)."""
        if end <= start:
            return b""
        extra = {"Range": f"bytes={start}-{end - 1}"}
        if etag:
            extra["If-Match"] = etag
        with self._open(self._url(key), extra=extra) as reply:
            data = reply.read()
        if len(data) != end - start:
            raise AIWorksError(f"s3://{self.bucket}/{key}: asked for bytes {start}-{end - 1}, got {len(data)}",
                               Status.UNAVAILABLE)  # fmt: skip
        return data

    def stream(self, key: str) -> Iterator[bytes]:
        """One object's bytes in blocks, as they arrive (GetObject)."""
        with self._open(self._url(key)) as reply:
            while chunk := reply.read(_CHUNK):
                yield chunk

    def download(self, key: str, out: BinaryIO, max_bytes: int) -> int:
        """Stream one object into ``out``; returns its size."""
        written = 0
        for chunk in self.stream(key):
            written += len(chunk)
            if written > max_bytes:
                raise AIWorksError(f"s3://{self.bucket}/{key} is larger than {max_bytes} bytes", Status.PAYLOAD_TOO_LARGE)
            out.write(chunk)
        return written


class _Window:
    """The next ``length`` bytes of a file, as a body urllib sends block by block (it reads to the end)."""

    def __init__(self, file: BinaryIO, length: int):
        self.file = file
        self.left = length

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        data = self.file.read(self.left if n < 0 else min(n, self.left))
        self.left -= len(data)
        return data


def _find(root: ET.Element, name: str) -> str:
    """The text of the first ``name`` under ``root``, whatever its namespace."""
    for element in root.iter():
        if element.tag.rpartition("}")[2] == name:
            return element.text or ""
    return ""


def _error(exc: urllib.error.HTTPError, bucket: str) -> AIWorksError:
    """An S3 error reply as the suite's error, with S3's own code and message."""
    code = message = ""
    try:
        root = ET.fromstring(exc.read())
        code, message = root.findtext("Code", ""), root.findtext("Message", "")
    except ET.ParseError:
        pass
    text = f"S3 refused ({exc.code} {code or exc.reason}{': ' + message if message else ''}) for bucket '{bucket}'"
    if exc.code == 404:
        return NotFound(text)
    if exc.code in (401, 403):
        return PermissionDenied(text + "; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    if exc.code == 412:  # a condition (If-Match) the object no longer meets
        return AIWorksError(text, Status.FAILED_PRECONDITION)
    return AIWorksError(text, Status.UNAVAILABLE if exc.code >= 500 else Status.INVALID_ARGUMENT)
