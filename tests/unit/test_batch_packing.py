"""Packing a batch job's lines into one request along the batch dimension, and splitting the answer back."""

from __future__ import annotations

import orjson

from aiworks.batch.lines import Line, parse_line
from aiworks.batch.packing import groups, packed_request, signature, split_response

PATH = "/v2/models/digits/infer"


def line(number: int, doc: dict) -> Line:
    return parse_line(number, orjson.dumps(doc), PATH)


def row(value: float, *, nested: bool = False, rows: int = 1, **extra) -> dict:
    data = [[value] * 4] * rows if nested else [value] * 4 * rows
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": data}], **extra}


def test_neighbours_that_agree_share_a_request_up_to_max_rows_in_input_order():
    lines = [line(i + 1, row(float(i))) for i in range(5)]
    assert [[x.number for x in g] for g in groups(lines, 2)] == [[1, 2], [3, 4], [5]]
    assert [[x.number for x in g] for g in groups(lines, 1)] == [[1], [2], [3], [4], [5]]


def test_what_differs_besides_rows_breaks_a_group_and_refused_lines_travel_alone():
    lines = [
        line(1, row(1.0)), line(2, row(2.0, id="a")),  # a line's id does not matter
        line(3, row(3.0, parameters={"timeout": 5})),  # its parameters do
        line(4, row(4.0, nested=True)),  # nor does the JSON layout of data mix
        Line(5, None, None, "malformed JSON"), line(6, row(6.0, rows=3)), line(7, row(7.0)),
        line(8, {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [1.0] * 8},
                            {"name": "y", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4}]}),
    ]  # fmt: skip
    assert [[x.number for x in g] for g in groups(lines, 8)] == [[1, 2], [3], [4], [5], [6, 7], [8]]
    assert signature(lines[7].request) is None  # inputs that disagree on rows cannot be packed
    assert [[x.number for x in g] for g in groups(lines[5:7], 3)] == [[6], [7]]  # 3 + 1 rows > 3


def test_the_packed_request_joins_rows_and_the_answer_splits_back_per_line():
    group = [line(1, row(1.0, id="first")), line(2, row(2.0, rows=2)), line(3, row(3.0))]
    request = packed_request(group)
    (x,) = request["inputs"]
    assert x["shape"] == [4, 4] and x["data"] == [1.0] * 4 + [2.0] * 8 + [3.0] * 4 and "id" not in request
    assert request["parameters"] == {"priority": "batch"}
    answer = {"model_name": "digits", "model_version": "2", "outputs": [
        {"name": "label", "datatype": "INT64", "shape": [4, 1], "data": [1, 2, 2, 3]},
        {"name": "p", "datatype": "FP32", "shape": [4, 2], "data": [1, 1, 2, 2, 2, 2, 3, 3]}]}  # fmt: skip
    first, second, third = (orjson.loads(r) for r in split_response(group, orjson.dumps(answer)))
    assert first["id"] == "first" and "id" not in second
    assert first["outputs"][0] == {"name": "label", "datatype": "INT64", "shape": [1, 1], "data": [1]}
    assert second["outputs"][1]["shape"] == [2, 2] and second["outputs"][1]["data"] == [2, 2, 2, 2]
    assert third["outputs"][0]["data"] == [3] and third["model_version"] == "2"
    nested = {**answer, "outputs": [{"name": "p", "datatype": "FP32", "shape": [4, 2],
                                      "data": [[1, 1], [2, 2], [2, 2], [3, 3]]}]}  # fmt: skip
    assert orjson.loads(split_response(group, orjson.dumps(nested))[1])["outputs"][0]["data"] == [[2, 2], [2, 2]]


def test_an_answer_without_the_batch_dimension_is_not_split():
    group = [line(1, row(1.0)), line(2, row(2.0))]
    whole = {"outputs": [{"name": "sum", "datatype": "FP32", "shape": [1], "data": [3.0]}]}
    assert split_response(group, orjson.dumps(whole)) is None
    short = {"outputs": [{"name": "y", "datatype": "FP32", "shape": [2, 3], "data": [1.0] * 5}]}
    assert split_response(group, orjson.dumps(short)) is None
    assert split_response(group, b"not json") is None
