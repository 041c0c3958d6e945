"""Parquet batch jobs end to end: the Batch API and the CLI on a real gateway, real runners, a private Redis.

The same digits rows go in as a JSONL job and as a Parquet job; every output
tensor of every row must be equal. Bad rows go to the JSONL error file with
their row numbers while the job goes on; a column that is not in the file is
refused at submission.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests

from .conftest import wait_batch
from .test_batch_jobs import ENDPOINT, _content, _digits, _ended, _jsonl, _online_labels, _upload

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _parquet(table: pa.Table, row_group_size: int = 100) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=row_group_size)
    return sink.getvalue()


def _list_table(x: np.ndarray) -> pa.Table:
    """The row's tensor in one list column named as the model's input."""
    return pa.table({"custom_id": [f"row-{i}" for i in range(len(x))],
                     "input": pa.array(list(x), pa.list_(pa.float32()))})  # fmt: skip


def _scalar_table(x: np.ndarray) -> pa.Table:
    """One float column per pixel, c0..c63."""
    return pa.table({f"c{j}": pa.array(x[:, j], pa.float32()) for j in range(x.shape[1])})


def _create(batch, tenant: str, file_id: str, **extra) -> requests.Response:
    body = {"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "24h", **extra}
    return requests.post(f"{batch.base}/v1/batches", headers=batch.headers(tenant), json=body, timeout=30)


def _table_content(batch, tenant: str, file_id: str) -> pa.Table:
    reply = requests.get(f"{batch.base}/v1/files/{file_id}/content", headers=batch.headers(tenant), timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/vnd.apache.parquet"
    return pq.read_table(io.BytesIO(reply.content))


def test_a_parquet_digits_job_answers_as_the_jsonl_job_does(batch_suite, runners):
    x = _digits(300)
    lines = [orjson.dumps({"custom_id": f"row-{i}", "inputs": [
        {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row.tolist()}]}) for i, row in enumerate(x)]  # fmt: skip
    as_jsonl = _create(batch_suite, "alice", _upload(batch_suite, "alice", _jsonl(lines))["id"], chunk_size=64)
    uploaded = _upload(batch_suite, "alice", _parquet(_list_table(x)), name="digits.parquet")
    as_parquet = _create(batch_suite, "alice", uploaded["id"], chunk_size=64)  # chunks cross the row groups of 100
    assert as_jsonl.status_code == 200 and as_parquet.status_code == 200, (as_jsonl.text, as_parquet.text)
    runners("parquet-runner")
    jsonl_done = wait_batch(batch_suite, "alice", as_jsonl.json()["id"], _ended)
    done = wait_batch(batch_suite, "alice", as_parquet.json()["id"], _ended)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 300, "completed": 300, "failed": 0}
    assert _content(batch_suite, "alice", done["error_file_id"]) == []
    table = _table_content(batch_suite, "alice", done["output_file_id"])
    expected = _content(batch_suite, "alice", jsonl_done["output_file_id"])
    assert table.schema.names == ["row", "custom_id", "label", "probabilities"]
    assert table.schema.field("label").type == pa.int64()
    assert table.schema.field("probabilities").type == pa.list_(pa.float32())
    assert table.column("row").to_pylist() == list(range(1, 301))
    assert table.column("custom_id").to_pylist() == [f"row-{i}" for i in range(300)]
    want = {name: [next(o["data"] for o in e["response"]["outputs"] if o["name"] == name) for e in expected]
            for name in ("label", "probabilities")}  # fmt: skip
    assert table.column("label").to_pylist() == [w[0] for w in want["label"]]
    # Equal up to float32 rounding: the runtime batches rows with different neighbours in the two jobs.
    np.testing.assert_allclose(table.column("probabilities").to_pylist(), want["probabilities"], rtol=1e-4, atol=1e-6)
    assert len(set(table.column("label").to_pylist())) == 10  # real answers: every digit appears


def test_bad_rows_go_to_the_error_file_with_their_row_numbers_and_the_job_goes_on(batch_suite, runners):
    x = _digits(6)
    rows = [list(r) for r in x]
    rows[1] = None  # a null tensor
    rows[2] = rows[2][:63]  # one element short: the gateway refuses the shape
    rows[4] = rows[4][:10] + [None] + rows[4][11:]  # a null element
    table = pa.table({"custom_id": [f"r{i}" for i in range(6)], "input": pa.array(rows, pa.list_(pa.float32()))})
    uploaded = _upload(batch_suite, "alice", _parquet(table), name="bad.parquet")
    reply = _create(batch_suite, "alice", uploaded["id"], chunk_size=4)
    assert reply.status_code == 200, reply.text
    runners("bad-rows-runner")
    done = wait_batch(batch_suite, "alice", reply.json()["id"], _ended)
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 6, "completed": 3, "failed": 3}
    out = _table_content(batch_suite, "alice", done["output_file_id"])
    assert out.column("row").to_pylist() == [1, 4, 6] and out.column("custom_id").to_pylist() == ["r0", "r3", "r5"]
    errors = {e["line"]: e for e in _content(batch_suite, "alice", done["error_file_id"])}
    assert sorted(errors) == [2, 3, 5]
    assert errors[2]["custom_id"] == "r1" and errors[2]["error"]["message"] == "column 'input' is null"
    assert errors[3]["error"]["code"] == "400" and errors[3]["custom_id"] == "r2"
    assert errors[5]["error"]["message"] == "column 'input' has a null value (input 'input')"


def test_a_column_not_in_the_file_is_refused_at_submission(batch_suite):
    uploaded = _upload(batch_suite, "bob", _parquet(_scalar_table(_digits(3))), name="cols.parquet")
    mapping = {"input": [f"c{j}" for j in range(63)] + ["pixel_63"]}
    reply = _create(batch_suite, "bob", uploaded["id"], input_columns=mapping)
    assert reply.status_code == 400 and "column 'pixel_63' is not in the file" in reply.text, reply.text
    mixed = _create(batch_suite, "bob", uploaded["id"], input_columns={"input": "c0"}, format="jsonl")
    assert mixed.status_code == 400 and "input_columns applies to Parquet input only" in mixed.text
    jsonl = _upload(batch_suite, "bob", b'{"inputs": []}\n', name="rows.jsonl")
    not_parquet = _create(batch_suite, "bob", jsonl["id"], format="parquet")
    assert not_parquet.status_code == 400 and "not a readable Parquet file" in not_parquet.text
    listed = requests.get(f"{batch_suite.base}/v1/batches", headers=batch_suite.headers("bob"), timeout=10)
    assert all(b["input_file_id"] != uploaded["id"] for b in listed.json()["data"])  # nothing was queued


def test_the_cli_submits_a_parquet_file_of_scalar_columns(batch_suite, runners, tmp_path):
    x = _digits(200)
    path = tmp_path / "pixels.parquet"
    path.write_bytes(_parquet(_scalar_table(x), row_group_size=64))
    env = {**os.environ, "AIWORKS_API_KEY": batch_suite.keys["bob"], "AIWORKS_GATEWAY_URL": batch_suite.base}
    cli = [sys.executable, "-m", "aiworks", "batch"]
    runners("cli-parquet-runner")
    columns = "input=" + ",".join(f"c{j}" for j in range(64))
    submitted = subprocess.run(cli + ["submit", str(path), "-m", "digits", "-x", "1", "--chunk-size", "50",
                                      "--input-column", columns, "--wait", "-o", "json"],
                               env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    doc = json.loads(submitted.stdout)
    assert doc["status"] == "completed" and doc["request_counts"]["completed"] == 200, doc
    assert "200/200 100%" in submitted.stderr
    out = tmp_path / "answers.parquet"
    results = subprocess.run(cli + ["results", doc["id"], "--out", str(out)], env=env, capture_output=True,
                             text=True, timeout=30)  # fmt: skip
    assert results.returncode == 0, results.stderr
    table = pq.read_table(out)
    assert table.column("row").to_pylist() == list(range(1, 201))
    assert table.column("custom_id").null_count == 200
    assert table.column("label").to_pylist() == _online_labels(batch_suite, x)
    refused = subprocess.run(cli + ["submit", str(path), "-m", "digits", "--input-column", "input=c0,nope"], env=env,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    assert refused.returncode != 0 and "400" in refused.stderr and "'nope'" in refused.stderr
