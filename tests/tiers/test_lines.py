"""One input line to a request or a refusal; chunk bounds fixed by the input."""

from __future__ import annotations

import orjson

from aiworks.batch.lines import chunk_bounds, parse_line, split_lines

PATH = "/v2/models/iris/infer"
REQUEST = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}


def test_an_oip_request_with_custom_id_is_sent_as_batch_class():
    line = parse_line(7, orjson.dumps({**REQUEST, "custom_id": "row-7", "parameters": {"priority": 1}}), PATH)
    assert line.error is None and line.custom_id == "row-7" and line.number == 7
    assert "custom_id" not in line.request
    assert line.request["parameters"] == {"priority": "batch"}  # a line cannot jump into the online classes


def test_the_openai_line_shape_is_accepted_and_its_url_checked():
    line = parse_line(1, orjson.dumps({"custom_id": "a", "method": "POST", "url": PATH, "body": REQUEST}), PATH)
    assert line.error is None and line.request["inputs"] == REQUEST["inputs"]
    other = parse_line(2, orjson.dumps({"custom_id": "b", "url": "/v2/models/digits/infer", "body": REQUEST}), PATH)
    assert other.request is None and "not this job's endpoint" in other.error


def test_malformed_lines_say_why():
    cases = {
        b"{not json": "malformed JSON",
        b"[1, 2]": "JSON object, not list",
        b'{"inputs": []}': "'inputs' must be a non-empty list",
        b'{"custom_id": 5, "inputs": [{}]}': "custom_id must be a string",
        b'{"inputs": [{}], "parameters": 3}': "'parameters' must be a JSON object",
        b"   ": "empty line",
    }
    for raw, reason in cases.items():
        line = parse_line(3, raw, PATH)
        assert line.request is None and reason in line.error, (raw, line.error)


def test_chunks_cover_every_line_once():
    bounds = chunk_bounds(1001, 100)
    assert bounds[0] == (0, 100) and bounds[-1] == (1000, 1001) and len(bounds) == 11
    covered = [i for start, end in bounds for i in range(start, end)]
    assert covered == list(range(1001))
    assert chunk_bounds(0, 100) == []


def test_split_lines_keeps_inner_empty_lines_and_drops_the_final_newline():
    assert split_lines(b"a\n\nb\r\n") == [b"a", b"", b"b"]
    assert split_lines(b"a") == [b"a"]
    assert split_lines(b"") == []
