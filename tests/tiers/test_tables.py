"""Parquet batch files (aiworks.batch.tables): the column-to-input rule, chunking, bad rows, and the output table."""

from __future__ import annotations

import io

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aiworks.batch.tables import ParquetInput, check_input, check_mapping, format_of, write_output
from aiworks.core.errors import InvalidArgument


def _write(path, table, row_group_size=None):
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def _lines(source: ParquetInput, chunk_size: int) -> list[list]:
    return [make() for make in source.chunks(chunk_size)]


def test_the_format_follows_the_extension_unless_given():
    assert format_of("rows.parquet") == "parquet" and format_of("ROWS.PQ") == "parquet"
    assert format_of("rows.jsonl") == "jsonl" and format_of("rows.bin", "parquet") == "parquet"
    with pytest.raises(InvalidArgument, match="format must be one of jsonl, parquet"):
        format_of("rows.jsonl", "csv")


def test_a_list_column_is_one_rows_tensor_and_chunks_cross_row_groups(tmp_path):
    rows = [[float(i), float(i) + 0.5] for i in range(7)]
    table = pa.table({"custom_id": [f"r{i}" for i in range(7)], "input": pa.array(rows, pa.list_(pa.float32()))})
    source = ParquetInput(_write(tmp_path / "a.parquet", table, row_group_size=2), {})
    assert source.total == 7
    chunks = _lines(source, 3)
    assert [len(c) for c in chunks] == [3, 3, 1]
    lines = [line for chunk in chunks for line in chunk]
    assert [line.number for line in lines] == list(range(1, 8))
    assert [line.custom_id for line in lines] == [f"r{i}" for i in range(7)]
    assert lines[4].request == {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2], "data": [4.0, 4.5]}],
        "parameters": {"priority": "batch"},
    }


def test_scalar_columns_mapped_to_one_input_keep_the_mappings_order(tmp_path):
    table = pa.table({"b": pa.array([2, 20], pa.int64()), "a": pa.array([1, 10], pa.int64()),
                      "flag": [True, False]})  # fmt: skip
    path = _write(tmp_path / "s.parquet", table)
    source = ParquetInput(path, check_mapping({"x": ["a", "b"], "on": "flag"}))
    first, second = _lines(source, 10)[0]
    assert first.custom_id is None
    assert first.request["inputs"] == [{"name": "x", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]},
                                       {"name": "on", "datatype": "BOOL", "shape": [1, 1], "data": [True]}]  # fmt: skip
    assert second.request["inputs"][0]["data"] == [10, 20]


def test_nulls_make_a_row_an_error_and_the_others_go_on(tmp_path):
    table = pa.table({"input": pa.array([[1.0], None, [None], [], [2.0]], pa.list_(pa.float64()))})
    lines = _lines(ParquetInput(_write(tmp_path / "n.parquet", table), {}), 10)[0]
    assert [line.error for line in lines] == [
        None, "column 'input' is null", "column 'input' has a null value (input 'input')",
        "column 'input' is an empty list", None,
    ]  # fmt: skip
    assert lines[4].request["inputs"][0]["datatype"] == "FP64"
    scalars = pa.table({"c0": [1.0, None], "c1": [2.0, 3.0]})
    lines = _lines(ParquetInput(_write(tmp_path / "s.parquet", scalars), {"v": ["c0", "c1"]}), 10)[0]
    assert lines[0].error is None and lines[1].error == "column 'c0' has a null value (input 'v')"


@pytest.mark.parametrize(
    ("table", "mapping", "message"),
    [
        (pa.table({"a": [1.0]}), {"input": ["a", "missing_col"]}, "column 'missing_col' is not in the file"),
        (pa.table({"a": [1.0], "b": [1]}), {"input": ["a", "b"]}, "mix types"),
        (pa.table({"a": pa.array([{"x": 1}])}), {}, "column 'a' of input 'a' is struct"),
        (pa.table({"a": pa.array([[b"x"]])}), {}, "no tensor datatype holds"),
        (pa.table({"custom_id": [1], "a": [1.0]}), {}, "column 'custom_id' must be a string column"),
        (pa.table({"custom_id": ["x"]}), {}, "no column besides custom_id"),
    ],
)
def test_a_file_that_does_not_fit_is_refused_naming_the_column(tmp_path, table, mapping, message):
    path = _write(tmp_path / "bad.parquet", table)
    with pytest.raises(InvalidArgument, match=message):
        check_input(path, check_mapping(mapping))


def test_mappings_and_files_that_are_not_parquet_are_refused(tmp_path):
    for bad in ([], {"x": []}, {"x": [""]}, {"x": 3}, {f"i{n}": "c" for n in range(65)}):
        with pytest.raises(InvalidArgument, match="input_columns"):
            check_mapping(bad)
    (tmp_path / "t.parquet").write_bytes(b'{"inputs": []}\n')
    with pytest.raises(InvalidArgument, match="not a readable Parquet file"):
        check_input(str(tmp_path / "t.parquet"), {})


def _out(line: int, custom_id, label: int, probabilities: list[float]) -> bytes:
    response = {"model_name": "m", "outputs": [
        {"name": "label", "datatype": "INT64", "shape": [1], "data": [label]},
        {"name": "probabilities", "datatype": "FP32", "shape": [1, 2], "data": probabilities},
    ]}  # fmt: skip
    return orjson.dumps({"line": line, "custom_id": custom_id, "response": response}) + b"\n"


def test_the_output_table_has_row_custom_id_and_a_column_per_output():
    chunks = [_out(1, "a", 3, [0.25, 0.75]) + _out(3, None, 1, [0.5, 0.5]), b"", _out(4, "d", 0, [1.0, 0.0])]
    table = pq.read_table(io.BytesIO(write_output(chunks)))
    assert table.schema.names == ["row", "custom_id", "label", "probabilities"]
    assert table.schema.field("label").type == pa.int64()
    assert table.schema.field("probabilities").type == pa.list_(pa.float32())
    assert table.to_pylist() == [
        {"row": 1, "custom_id": "a", "label": 3, "probabilities": [0.25, 0.75]},
        {"row": 3, "custom_id": None, "label": 1, "probabilities": [0.5, 0.5]},
        {"row": 4, "custom_id": "d", "label": 0, "probabilities": [1.0, 0.0]},
    ]
    assert pq.ParquetFile(io.BytesIO(write_output(chunks))).metadata.num_row_groups == 2  # one per chunk with rows
    empty = pq.read_table(io.BytesIO(write_output([b""])))
    assert empty.num_rows == 0 and empty.schema.names == ["row", "custom_id"]


def test_without_pyarrow_a_parquet_job_is_refused_with_501_naming_the_extra(tmp_path):
    import subprocess
    import sys

    path = _write(tmp_path / "a.parquet", pa.table({"input": [1.0]}))
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"  # as if the parquet extra were not installed
        "from aiworks.batch.tables import check_input\n"
        "from aiworks.core.errors import AIWorksError\n"
        "try:\n"
        f"    check_input({path!r}, {{}})\n"
        "except AIWorksError as exc:\n"
        "    print(exc.status.http, exc.message)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("501 ") and "aiworks[parquet]" in done.stdout, done.stdout


def test_rows_larger_than_a_request_are_refused_from_the_footer(tmp_path):
    zeros = pa.array([np.zeros(9_000_000, np.float32)], pa.list_(pa.float32()))  # 36 MB a row, a few KB compressed
    path = _write(tmp_path / "big.parquet", pa.table({"input": zeros}))
    assert (tmp_path / "big.parquet").stat().st_size < 1 << 20
    with pytest.raises(InvalidArgument, match="bytes a row decoded, more than the 33554432"):
        check_input(path, {})
    with pytest.raises(InvalidArgument, match="bytes a row decoded"):
        ParquetInput(path, {})
