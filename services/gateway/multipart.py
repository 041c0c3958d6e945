"""A multipart/form-data body (RFC 7578) parsed as it arrives, so an upload streams to storage.

The gateway's event loop must not stop for one large upload: the whole body
parsed at once by the standard library's MIME parser held the loop about
5 s per 100 MB. Here each chunk costs one ``bytes.find`` for the boundary
over what is buffered, and what is buffered is bounded: a part's headers
(``MAX_HEADER_BYTES``) or, inside a part's body, a delimiter's length.

:meth:`FormStream.feed` returns events in order: :class:`Part` when a part's
headers are in, its body as ``bytes`` pieces, :data:`PART_END` when it ends.
:meth:`FormStream.finish` checks that the closing delimiter came.
"""

from __future__ import annotations

import email.parser
import email.policy
import re
from dataclasses import dataclass

from aiworks.core.errors import InvalidArgument

MAX_HEADER_BYTES = 16 * 1024  # one part's headers
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")  # RFC 2046's bchars
PART_END = object()


@dataclass(frozen=True)
class Part:
    name: str
    filename: str | None


def boundary_of(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data`` content type, or a 400 naming what is wrong."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidArgument("POST /v1/files takes multipart/form-data with fields 'purpose' and 'file'")
    header = email.parser.HeaderParser(policy=email.policy.HTTP).parsestr(f"Content-Type: {content_type}\r\n\r\n")
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not _BOUNDARY.fullmatch(boundary):
        raise InvalidArgument("multipart/form-data without a boundary of 1 to 70 characters (RFC 2046's set)")
    return boundary.encode("ascii")


class FormStream:
    """The state of one multipart body being parsed; feed it the body's chunks in order."""

    def __init__(self, boundary: bytes):
        self._first = b"--" + boundary  # the first delimiter may open the body without a line break before it
        self._delimiter = b"\r\n--" + boundary
        self._buffer = b""
        self._state = "preamble"  # preamble, after (a delimiter), headers, body, done

    def feed(self, chunk: bytes) -> list[object]:
        events: list[object] = []
        buffer = self._buffer + chunk if self._buffer else chunk
        while True:
            state = self._state
            if state == "preamble":
                at = buffer.find(self._first)
                if at < 0:
                    buffer = buffer[-len(self._first) :]  # a preamble is ignored; keep what may start the delimiter
                    break
                buffer = buffer[at + len(self._first) :]
                self._state = "after"
            elif state == "after":  # "--": the end; else optional spaces, then a line break, then a part
                if len(buffer) < 2:
                    break
                if buffer.startswith(b"--"):
                    self._state, buffer = "done", b""
                    break
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > 256:
                        raise InvalidArgument("malformed multipart body: no line break after a boundary")
                    break
                if buffer[:end].strip(b" \t"):
                    raise InvalidArgument("malformed multipart body: text after a boundary")
                buffer = buffer[end + 2 :]
                self._state = "headers"
            elif state == "headers":
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(buffer) > MAX_HEADER_BYTES:
                        raise InvalidArgument(f"a multipart part's headers exceed {MAX_HEADER_BYTES} bytes")
                    break
                events.append(_part(buffer[:end]))
                buffer = buffer[end + 4 :]
                self._state = "body"
            elif state == "body":
                at = buffer.find(self._delimiter)
                if at < 0:
                    keep = len(self._delimiter) - 1  # the start of a delimiter split across chunks
                    if len(buffer) > keep:
                        events.append(buffer[:-keep])
                        buffer = buffer[-keep:]
                    break
                if at:
                    events.append(buffer[:at])
                events.append(PART_END)
                buffer = buffer[at + len(self._delimiter) :]
                self._state = "after"
            else:  # done: an epilogue is ignored
                buffer = b""
                break
        self._buffer = buffer
        return events

    def finish(self) -> None:
        if self._state != "done":
            raise InvalidArgument("malformed multipart body: it ends before its closing boundary")


def _part(raw: bytes) -> Part:
    headers = email.parser.BytesHeaderParser(policy=email.policy.HTTP).parsebytes(raw + b"\r\n\r\n")
    if headers.get_content_disposition() != "form-data":
        raise InvalidArgument("a multipart part without 'Content-Disposition: form-data'")
    name = headers.get_param("name", header="content-disposition")
    if not isinstance(name, str):
        raise InvalidArgument("a multipart part without a name")
    return Part(name, headers.get_filename())
