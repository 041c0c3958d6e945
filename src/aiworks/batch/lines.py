"""One line of a batch input file: an Open Inference Protocol request, or the reason it is not one.

A line is a JSON object, either an OIP request (``inputs``, optional
``outputs``, ``parameters``, ``id``) with an optional ``custom_id``, or the
OpenAI batch shape ``{"custom_id": ..., "method": "POST", "url": ..., "body":
<OIP request>}``. The class is always ``batch``: a line's own ``priority`` is
replaced, so a batch job never competes as online traffic.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import orjson

from aiworks.core.errors import AIWorksError

log = logging.getLogger(__name__)

BATCH_PRIORITY = "batch"
MAX_CUSTOM_ID_CHARS = 256


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, as an editor shows it
    custom_id: str | None
    request: dict | None  # None: refused, see error
    error: str | None = None


def parse_line(number: int, raw: bytes, infer_path: str) -> Line:
    """``raw`` (one line, without its newline) as a request for ``infer_path``, or why not."""
    if not raw.strip():
        return Line(number, None, None, "empty line")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Line(number, None, None, f"malformed JSON: {exc}")
    if not isinstance(doc, dict):
        return Line(number, None, None, f"a line must be a JSON object, not {type(doc).__name__}")
    custom_id = doc.get("custom_id")
    if custom_id is not None and (not isinstance(custom_id, str) or len(custom_id) > MAX_CUSTOM_ID_CHARS):
        return Line(number, None, None, f"custom_id must be a string of at most {MAX_CUSTOM_ID_CHARS} characters")
    if "body" in doc:
        url = doc.get("url")
        if url is not None and url != infer_path:
            return Line(number, custom_id, None, f"url '{str(url)[:200]}' is not this job's endpoint {infer_path}")
        if doc.get("method", "POST") != "POST":
            return Line(number, custom_id, None, "method must be POST")
        request = doc["body"]
        if not isinstance(request, dict):
            return Line(number, custom_id, None, "body must be a JSON object (an OIP inference request)")
    else:
        request = {k: v for k, v in doc.items() if k != "custom_id"}
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        return Line(number, custom_id, None, "not an inference request: 'inputs' must be a non-empty list")
    parameters = request.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        return Line(number, custom_id, None, "'parameters' must be a JSON object")
    request = {**request, "parameters": {**(parameters or {}), "priority": BATCH_PRIORITY}}
    return Line(number, custom_id, request)


def chunk_bounds(total_lines: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` line indexes (0-based) of each chunk: fixed by the input, so a resumed job agrees."""
    return [(start, min(start + chunk_size, total_lines)) for start in range(0, total_lines, chunk_size)]


_SCAN = 8 << 20  # bytes looked at a time for newlines (a byte of comparison each, while it runs)
# The line ends of S3 objects scanned lately, by (URL, ETag): a job resumed at its next turn on the same runner
# (aiworks.batch.runner, turn_s) does not scan its input again. At most this many bytes of them are kept.
_KEPT_ENDS_BYTES = 128 << 20
_kept_ends: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()


def _keep_ends(key: tuple[str, str], ends: np.ndarray) -> None:
    _kept_ends[key] = ends
    _kept_ends.move_to_end(key)
    while len(_kept_ends) > 1 and sum(e.nbytes for e in _kept_ends.values()) > _KEPT_ENDS_BYTES:
        _kept_ends.popitem(last=False)


# A kept copy of an object's line ends (LineIndex's ``keep_url``): this header, padded to _HEADER_BYTES, then the
# ends as little-endian int64. The header names the object's size and ETag: a copy of another version is not used.
_HEADER = b"aiworks-line-ends 1 %d %s"
_HEADER_BYTES = 256


def _kept_copy(data, keep_url: str) -> np.ndarray | None:
    """The line ends kept at ``keep_url`` for this version of ``data``, if a copy is there and is whole."""
    from aiworks.batch import objects

    try:
        raw = objects.read_bytes(keep_url, max_bytes=_HEADER_BYTES + 8 * (len(data) + 1))
    except AIWorksError:
        return None  # none kept yet (or unreadable: the scan makes it again)
    header = (_HEADER % (len(data), data.etag.encode())).ljust(_HEADER_BYTES)
    if raw[:_HEADER_BYTES] != header or (len(raw) - _HEADER_BYTES) % 8:
        return None
    ends = np.frombuffer(raw, dtype="<i8", offset=_HEADER_BYTES).astype(np.int64, copy=False)
    if len(data) and (not len(ends) or ends[-1] not in (len(data) - 1, len(data)) or ends[0] < 0):
        return None
    if len(ends) > 1 and not (np.diff(ends) > 0).all():  # not a copy of a scan: never trusted
        return None
    return ends


def _keep_copy(data, keep_url: str, ends: np.ndarray) -> None:
    from aiworks.batch import objects

    header = (_HEADER % (len(data), data.etag.encode())).ljust(_HEADER_BYTES)
    try:
        objects.write_bytes(keep_url, header + ends.astype("<i8", copy=False).tobytes())
    except AIWorksError as exc:  # the job runs on; a runner that resumes it scans the input again
        log.warning("the line ends of %s were not kept at %s: %s", data.url, keep_url, exc.message)


class LineIndex:
    """The lines of a file, taken a slice at a time: where each line ends is all that is kept.

    ``data`` is the file's bytes as a buffer (a mapped local file), or a
    source read in ranges (``objects.Ranged``: an S3 object), which gives
    ``blocks()`` to scan and is sliced once a chunk.

    A final newline ends the last line rather than starting an empty one;
    an inner empty line is a line. Nothing is split into objects up front:
    8 bytes a line are kept (80 MB for ten million lines), and a chunk's
    lines are copied out only when it is sent. An S3 object's line ends stay
    kept after it (at most 128 MiB of them, the least recent dropped first),
    so a job resumed at its next turn does not scan the same version again.
    With ``keep_url``, they are also written there once scanned (8 bytes a
    line, beside the job's parts), so a job resumed on another runner, after
    a turn or a runner's death, reads them instead of the whole object.
    """

    def __init__(self, data, keep_url: str | None = None):
        self._data = data
        size = len(data)
        ends = []
        key = (data.url, data.etag) if hasattr(data, "etag") else None  # one version of an S3 object
        if key in _kept_ends:
            self._ends = _kept_ends[key]
            _kept_ends.move_to_end(key)
            self.total = len(self._ends)
            return
        if key is not None and keep_url is not None:
            kept = _kept_copy(data, keep_url)
            if kept is not None:
                self._ends, self.total = kept, len(kept)
                _keep_ends(key, kept)
                return
        if hasattr(data, "blocks"):  # read in ranges: scan the blocks as they arrive
            at = 0
            for block in data.blocks(_SCAN):
                ends.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10) + at)
                at += len(block)
        elif size:
            view = np.frombuffer(data, dtype=np.uint8)
            try:
                ends = [np.flatnonzero(view[at : at + _SCAN] == 10) + at for at in range(0, size, _SCAN)]
            finally:
                del view  # a mapped file cannot close while an array still points into it
        newlines = np.concatenate(ends) if ends else np.empty(0, np.int64)
        if size and (not len(newlines) or newlines[-1] != size - 1):
            newlines = np.append(newlines, size)  # the last line has no newline of its own
        self._ends = newlines.astype(np.int64)
        self.total = len(self._ends)
        if key is not None:
            _keep_ends(key, self._ends)
            if keep_url is not None:
                _keep_copy(data, keep_url, self._ends)

    def lines(self, start: int, end: int) -> list[bytes]:
        """Lines ``[start, end)`` (0-based), each without its newline (nor a ``\\r`` before it): the span they
        cover is read once (one ranged read from a ranged source)."""
        end = min(end, self.total)
        if start >= end:
            return []
        ends = self._ends
        first = 0 if start == 0 else int(ends[start - 1]) + 1
        span = self._data[first : int(ends[end - 1])]
        out = []
        begin = 0
        for i in range(start, end):
            stop = int(ends[i]) - first
            line = span[begin:stop]
            out.append(line[:-1] if line.endswith(b"\r") else line)
            begin = stop + 1
        return out
