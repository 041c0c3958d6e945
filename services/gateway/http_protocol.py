"""uvicorn's httptools protocol with a bound on the request line and headers.

httptools (llhttp) has no limit of its own on how much of a request's head it
buffers, so a client could send megabytes of headers before authentication
is even looked at. Bytes received while a request's head is incomplete are
counted; past ``max_head_bytes`` the connection gets ``431 Request Header
Fields Too Large`` (OIP's ``{"error": ...}`` body, or OpenAI's under
``/v1/`` once the request line was read) and is closed. The count
errs on the safe side: the chunk that completes a head may also hold the
start of its body, and counts in full (at most one read, 256 KiB).
"""

from __future__ import annotations

import logging
import time

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aiworks.core import metrics
from aiworks.gateway.openai_routes import openai_error_body

log = logging.getLogger(__name__)

_WARN_EVERY_S = 60.0
# scope["extensions"][ABORT_EXTENSION](): close the connection at once, discarding what is unsent.
ABORT_EXTENSION = "aiworks.abort"


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` refusing a request head longer than ``max_head_bytes``."""

    max_head_bytes = 64 * 1024
    _warned_at = -_WARN_EVERY_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            self._refuse()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        # How an app ends a connection whose peer stopped reading (result streams drop slow subscribers).
        self.scope.setdefault("extensions", {})[ABORT_EXTENSION] = self.transport.abort
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True

    def _refuse(self) -> None:
        metrics.GATEWAY_REFUSED.labels("header_too_large").inc()
        now = time.monotonic()
        cls = type(self)
        if now - cls._warned_at >= _WARN_EVERY_S:
            cls._warned_at = now
            log.warning(
                "refused a request head over %d bytes from %s (setting max_header_bytes; counted in "
                "aiworks_gateway_refused_requests_total)",
                self.max_head_bytes,
                self.client[0] if self.client else "?",
            )
        message = f"request line and headers exceed the limit of {self.max_head_bytes} bytes (setting max_header_bytes)"
        if getattr(self, "url", b"").startswith(b"/v1/"):  # the request line was read: OpenAI's error body there
            body = openai_error_body(431, message, "request_header_fields_too_large")
        else:
            body = orjson.dumps({"error": message})
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


def bounded_protocol(max_head_bytes: int) -> type[BoundedHttpToolsProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, bounding heads at ``max_head_bytes``."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"max_head_bytes": max_head_bytes})
