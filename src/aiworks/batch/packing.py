"""Several input lines in one request: the batch dimension, so a row costs the gateway a fraction of a request.

A batch job's lines are usually one row each, and every request costs the
gateway (parsing, authentication, limits, routing) what an online request
costs it. The runner therefore sends neighbouring lines that agree on
everything but their rows as one request: their tensors joined along the
first (batch) dimension, as a client batching by hand would, and the answer
split back into one response per line. Only for a model that batches
(``max_batch_size`` > 0 in its config), at most ``max_rows`` rows a request.

Lines pack together when their requests have the same inputs (names,
datatypes, every dimension but the first, the same JSON layout of ``data``:
flat or nested, and the same input parameters), the same ``parameters`` and
the same requested ``outputs``. A line's own ``id`` does not matter: each
split response carries its line's ``id`` back. :func:`split_response` returns
None when an answer cannot be split by rows (an output without the batch
dimension); the runner then sends those lines one by one, as it does when a
packed request is refused, so an error is still charged to the line at fault.
"""

from __future__ import annotations

import math

import orjson

from aiworks.batch.lines import Line


def _rows(request: dict) -> int | None:
    """The line's rows (the first dimension, the same for every input), or None when it cannot be packed."""
    rows = None
    for tensor in request["inputs"]:
        shape = tensor.get("shape") if isinstance(tensor, dict) else None
        data = tensor.get("data") if isinstance(tensor, dict) else None
        if not isinstance(shape, list) or not shape or not isinstance(data, list):
            return None
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            return None
        if rows is None:
            rows = shape[0]
        elif shape[0] != rows:
            return None
    return rows if rows else None


def signature(request: dict) -> bytes | None:
    """What lines must share to travel in one request (None: this line travels alone)."""
    if _rows(request) is None:
        return None
    inputs = [
        (t.get("name"), t.get("datatype"), t["shape"][1:], bool(t["data"]) and isinstance(t["data"][0], list),
         t.get("parameters"))
        for t in request["inputs"]
    ]  # fmt: skip
    try:
        return orjson.dumps([inputs, request.get("parameters"), request.get("outputs")], option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return None


def groups(lines: list[Line], max_rows: int) -> list[list[Line]]:
    """``lines`` (in order) as runs of neighbours that can share a request, each of at most ``max_rows`` rows.

    A refused line (no request), or one that cannot be packed, is a group of its own.
    """
    out: list[list[Line]] = []
    current: list[Line] = []
    key, rows = None, 0
    for line in lines:
        sig = signature(line.request) if line.request is not None and max_rows > 1 else None
        n = _rows(line.request) if sig is not None else None
        if sig is not None and sig == key and rows + n <= max_rows:
            current.append(line)
            rows += n
            continue
        if current:
            out.append(current)
        if sig is None or n > max_rows:
            out.append([line])
            current, key, rows = [], None, 0
        else:
            current, key, rows = [line], sig, n
    if current:
        out.append(current)
    return out


def packed_request(group: list[Line]) -> dict:
    """One request carrying every line of ``group`` (they share a :func:`signature`)."""
    first = group[0].request
    inputs = []
    for i, tensor in enumerate(first["inputs"]):
        data: list = []
        rows = 0
        for line in group:
            mine = line.request["inputs"][i]
            data.extend(mine["data"])
            rows += mine["shape"][0]
        inputs.append({**tensor, "shape": [rows, *tensor["shape"][1:]], "data": data})
    request = {k: v for k, v in first.items() if k not in ("inputs", "id")}
    request["inputs"] = inputs
    return request


def split_response(group: list[Line], content: bytes) -> list[bytes] | None:
    """The packed answer ``content`` as one response per line of ``group`` (JSON), or None if it cannot be split."""
    try:
        doc = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    outputs = doc.get("outputs") if isinstance(doc, dict) else None
    if not isinstance(outputs, list):
        return None
    counts = [_rows(line.request) for line in group]
    total = sum(counts)
    pieces: list[list[dict]] = [[] for _ in group]
    for out in outputs:
        shape, data = out.get("shape"), out.get("data")
        if not isinstance(shape, list) or not shape or shape[0] != total or not isinstance(data, list):
            return None
        nested = bool(data) and isinstance(data[0], list)
        per_row = 1 if nested else math.prod(shape[1:])
        if len(data) != total * per_row:
            return None
        at = 0
        for k, rows in enumerate(counts):
            pieces[k].append({**out, "shape": [rows, *shape[1:]], "data": data[at : at + rows * per_row]})
            at += rows * per_row
    base = {k: v for k, v in doc.items() if k not in ("outputs", "id")}
    responses = []
    for line, outs in zip(group, pieces):
        response = {**base, "outputs": outs}
        if "id" in line.request:
            response["id"] = line.request["id"]
        responses.append(orjson.dumps(response))
    return responses
