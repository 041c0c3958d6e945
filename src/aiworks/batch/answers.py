"""The gateway's answers to a batch runner, made into the job's output and error lines.

An answer's ``online_load`` parameter is the runtime's signal to the pacer
(:mod:`aiworks.batch.pacing`), taken off before the answer becomes an output
line, so the line is the answer an online caller gets.
"""

from __future__ import annotations

import orjson

from aiworks.batch.lines import Line
from aiworks.core.options import ONLINE_LOAD

MAX_BACKOFF_S = 5.0  # the longest Retry-After a runner honours before trying a line again
_ONLINE_LOAD_KEY = b'"' + ONLINE_LOAD.encode() + b'"'
# The gateway's usual answer (compact JSON, "parameters" last, the signal its only entry) ends with one of these:
# taken off as bytes, without parsing the answer. Two closing braces: the top level's "parameters", nothing nested.
_ONLINE_LOAD_TAILS = {
    value: b',"parameters":{' + _ONLINE_LOAD_KEY + b":" + orjson.dumps(value) + b"}}" for value in (True, False)
}


def take_online_load(response: bytes) -> tuple[bool | None, bytes]:
    """The runtime's ``online_load`` signal in a JSON answer (None: absent), and the answer without it.

    The signal is for the pacer, not the job's output: the output line is the
    answer as an online caller gets it. Answers without it pass untouched.
    """
    if _ONLINE_LOAD_KEY not in response:
        return None, response
    for value, tail in _ONLINE_LOAD_TAILS.items():
        if response.endswith(tail):
            return value, response[: -len(tail)] + b"}"
    try:
        doc = orjson.loads(response)
    except orjson.JSONDecodeError:
        return None, response
    parameters = doc.get("parameters") if isinstance(doc, dict) else None
    if not isinstance(parameters, dict) or ONLINE_LOAD not in parameters:
        return None, response
    online = parameters.pop(ONLINE_LOAD)
    if not parameters:
        del doc["parameters"]
    return (online if isinstance(online, bool) else None), orjson.dumps(doc)


def output_line(line: Line, response: bytes) -> bytes:
    if b"\n" in response:
        response = orjson.dumps(orjson.loads(response))
    head = orjson.dumps({"line": line.number, "custom_id": line.custom_id})
    return head[:-1] + b',"response":' + response + b"}\n"


def error_line(line: Line, code: str, message: str) -> bytes:
    doc = {"line": line.number, "custom_id": line.custom_id, "error": {"code": code, "message": message}}
    return orjson.dumps(doc) + b"\n"


def gateway_error(status: int, content: bytes) -> str:
    try:
        doc = orjson.loads(content)
    except orjson.JSONDecodeError:
        return f"HTTP {status}"
    message = doc.get("error") if isinstance(doc, dict) else None
    return str(message)[:500] if message else f"HTTP {status}"


def retry_after(value: str | None) -> float | None:
    try:
        return min(MAX_BACKOFF_S, max(0.05, float(value))) if value else None
    except ValueError:
        return None
