"""A batch job whose input and results are S3 objects on a real S3-compatible server (SeaweedFS).

The job is submitted through the transport-agnostic core (as an operator's
tool would, naming s3:// locations); the runner reads and writes the
objects with the storage initializer's S3 client, signed with SigV4.
"""

from __future__ import annotations

import asyncio
import io

import orjson
import pytest
from deploy.storage_servers import SeaweedS3

from aiworks.batch.jobs import JobStore
from aiworks.batch.service import BatchService
from aiworks.storage.s3 import S3Client, S3Config

from .conftest import wait_batch
from .test_batch_jobs import _digits, _jsonl, _line, _soon

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """One SeaweedFS for the module (each start and stop costs seconds); the tests keep to keys of their own."""
    server = SeaweedS3(tmp_path_factory.mktemp("s3"), bucket="jobs")
    server.start()
    yield server
    server.stop()


def _submit(batch_suite, **kwargs):
    async def go():
        store = JobStore.from_url(batch_suite.redis_url)
        try:
            service = BatchService(store, None)
            return await service.submit("alice", "digits", credential=f"Bearer {batch_suite.keys['alice']}", **kwargs)
        finally:
            await store.close()

    return asyncio.run(go())


def _digits_job(batch_suite, s3, monkeypatch, name: str, rows: int, chunk_size: int):
    """A job of ``rows`` digits lines at ``s3://jobs/in/{name}.jsonl``, its results under ``s3://jobs/{name}/``."""
    for variable, value in s3.env().items():
        monkeypatch.setenv(variable, value)  # the submission checks the input exists, with these credentials
    s3.put(f"in/{name}.jsonl", _jsonl([_line(i, row) for i, row in enumerate(_digits(rows))]))
    return _submit(batch_suite, input_url=f"s3://jobs/in/{name}.jsonl", output_url=f"s3://jobs/{name}/result.jsonl",
                   error_url=f"s3://jobs/{name}/errors.jsonl", chunk_size=chunk_size)  # fmt: skip


def test_a_job_reads_and_writes_s3(batch_suite, runners, s3, monkeypatch):
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)  # the submission checks the input exists, with these credentials
    x = _digits(300)
    s3.put("in/digits.jsonl", _jsonl([_line(i, row) for i, row in enumerate(x)]) + b"[]\n")
    with pytest.raises(Exception, match="input file does not exist"):
        _submit(batch_suite, input_url="s3://jobs/in/missing.jsonl", output_url="s3://jobs/o", error_url="s3://jobs/e")
    job = _submit(batch_suite, input_url="s3://jobs/in/digits.jsonl", output_url="s3://jobs/out/result.jsonl",
                  error_url="s3://jobs/out/errors.jsonl", chunk_size=64)  # fmt: skip
    runners("s3-runner", env=s3.env())
    done = wait_batch(batch_suite, "alice", job.id, lambda d: d["status"] in ("completed", "cancelled"))
    assert done["status"] == "completed" and done["request_counts"] == {"total": 301, "completed": 300, "failed": 1}
    client = S3Client("jobs", S3Config(endpoint=s3.endpoint, access_key=s3.env()["AWS_ACCESS_KEY_ID"],
                                       secret_key=s3.env()["AWS_SECRET_ACCESS_KEY"]))  # fmt: skip
    out, err = io.BytesIO(), io.BytesIO()
    client.download("out/result.jsonl", out, 1 << 30)
    client.download("out/errors.jsonl", err, 1 << 30)
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert [o["line"] for o in lines] == list(range(1, 301))
    assert [orjson.loads(line)["line"] for line in err.getvalue().splitlines()] == [301]
    # The chunks' parts go right after the job ends (after: a runner that dies between leaves parts, never a job
    # without them).
    assert _soon(lambda: not list(client.list("out/result.jsonl.parts/")))


def test_a_parquet_job_reads_and_writes_s3_and_answers_as_the_jsonl_job(batch_suite, runners, s3, monkeypatch):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    x = _digits(200)
    table = pa.table({"custom_id": [f"row-{i}" for i in range(200)], "input": pa.array(list(x), pa.list_(pa.float32()))})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=64)
    s3.put("in/digits.parquet", sink.getvalue())
    s3.put("in/digits.jsonl", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    with pytest.raises(Exception, match="column 'pixels' is not in the file"):
        _submit(batch_suite, input_url="s3://jobs/in/digits.parquet", output_url="s3://jobs/o", error_url="s3://jobs/e",
                input_columns={"input": "pixels"})  # fmt: skip
    jobs = [
        _submit(batch_suite, input_url=f"s3://jobs/in/digits.{form}", output_url=f"s3://jobs/out/result.{form}",
                error_url=f"s3://jobs/out/errors-{form}.jsonl", chunk_size=50)  # fmt: skip
        for form in ("parquet", "jsonl")
    ]
    assert [job.format for job in jobs] == ["parquet", "jsonl"]  # by the input's extension
    runners("s3-parquet-runner", env=s3.env())
    for job in jobs:
        done = wait_batch(batch_suite, "alice", job.id, lambda d: d["status"] in ("completed", "cancelled"))
        assert done["status"] == "completed" and done["request_counts"] == {"total": 200, "completed": 200, "failed": 0}
    client = S3Client("jobs", S3Config(endpoint=s3.endpoint, access_key=s3.env()["AWS_ACCESS_KEY_ID"],
                                       secret_key=s3.env()["AWS_SECRET_ACCESS_KEY"]))  # fmt: skip
    out, expected = io.BytesIO(), io.BytesIO()
    client.download("out/result.parquet", out, 1 << 30)
    client.download("out/result.jsonl", expected, 1 << 30)
    answers = pq.read_table(io.BytesIO(out.getvalue()))
    lines = [orjson.loads(line) for line in expected.getvalue().splitlines()]
    assert answers.column("row").to_pylist() == [o["line"] for o in lines] == list(range(1, 201))
    assert answers.column("custom_id").to_pylist() == [o["custom_id"] for o in lines]
    labels = [o["response"]["outputs"][0]["data"][0] for o in lines]  # the JSONL lines ask for label only
    assert answers.column("label").to_pylist() == labels and len(set(labels)) == 10
    assert np.asarray(answers.column("probabilities").to_pylist()).shape == (200, 10)


class _Breaks(io.BytesIO):
    """A file that fails once ``after`` bytes have been read (a disk error mid-upload)."""

    def __init__(self, data: bytes, after: int):
        super().__init__(data)
        self.after = after

    def read(self, n: int = -1) -> bytes:
        if self.tell() >= self.after:
            raise OSError("the disk went away")
        return super().read(n)


def test_an_object_over_the_single_put_limit_goes_up_in_parts_and_a_failed_one_leaves_none(s3):
    """An output over S3's 5 GiB PutObject limit is a multipart upload (here the limits are shrunk to 5 MiB so a
    12 MiB file takes three parts); one whose source fails midway is aborted, leaving no parts to be billed."""
    env = s3.env()
    client = S3Client("jobs", S3Config(endpoint=s3.endpoint, access_key=env["AWS_ACCESS_KEY_ID"],
                                       secret_key=env["AWS_SECRET_ACCESS_KEY"]))  # fmt: skip
    data = bytes(range(256)) * (12 * 4096) + b"tail"  # 12 MiB and 4 bytes: parts of 5, 5 and 2 MiB + 4 bytes
    client.upload_file("big/big.jsonl", io.BytesIO(data), len(data), single_max=5 << 20, part_bytes=5 << 20)
    back = io.BytesIO()
    assert client.download("big/big.jsonl", back, 1 << 30) == len(data) and back.getvalue() == data
    assert list(client.list("big/")) == [("big/big.jsonl", len(data))]

    with pytest.raises(Exception, match="the disk went away"):  # (the client names it as the endpoint's failure)
        client.upload_file("big/broken.jsonl", _Breaks(data, 7 << 20), len(data), single_max=5 << 20,
                           part_bytes=5 << 20)  # fmt: skip
    assert not client.exists("big/broken.jsonl")
    with client._open(client._url("", {"uploads": ""})) as reply:  # ListMultipartUploads: none left open
        listing = reply.read().decode()
    assert "<UploadId>" not in listing, listing


def test_an_s3_input_is_read_in_ranges_of_one_version_and_a_replaced_one_is_named(s3, monkeypatch):
    """The runner reads an s3:// input in ranges (no copy on disk): the scan in blocks, then one ranged read a
    chunk, each pinned to the object's ETag, so an input replaced mid-job is an error that says so."""
    from aiworks.batch import objects
    from aiworks.batch.lines import LineIndex

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    lines = [b'{"n": %d}' % i for i in range(1000)]
    s3.put("in/lines.jsonl", b"\n".join(lines) + b"\n")
    with objects.mapped("s3://jobs/in/lines.jsonl") as data:
        assert isinstance(data, objects.Ranged)
        index = LineIndex(data)
        assert index.total == 1000
        assert index.lines(0, 3) == lines[:3] and index.lines(998, 1000) == lines[998:]
        s3.put("in/lines.jsonl", b"another file\n")
        with pytest.raises(Exception, match="was replaced while the job read it"):
            index.lines(500, 600)


def test_a_resumed_s3_input_is_not_scanned_again_unless_it_changed(s3, monkeypatch):
    """A job let go at the end of its turn and resumed by the same runner opens its input again: the line ends of
    the same version of the object (its URL and ETag) are kept, so it is not scanned again; a new version is."""
    from aiworks.batch import objects
    from aiworks.batch.lines import LineIndex

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    scans = []
    real_blocks = objects.Ranged.blocks
    monkeypatch.setattr(objects.Ranged, "blocks", lambda self, *a: scans.append(self.etag) or real_blocks(self, *a))
    lines = [b'{"n": %d}' % i for i in range(500)]
    s3.put("in/resumed.jsonl", b"\n".join(lines) + b"\n")
    for _ in range(2):
        with objects.mapped("s3://jobs/in/resumed.jsonl") as data:
            index = LineIndex(data)
            assert index.total == 500 and index.lines(250, 252) == lines[250:252]
    assert len(scans) == 1, "the second open read the object again"
    s3.put("in/resumed.jsonl", b"\n".join(lines[:10]) + b"\n")
    with objects.mapped("s3://jobs/in/resumed.jsonl") as data:
        assert LineIndex(data).total == 10
    assert len(scans) == 2 and scans[0] != scans[1]


def test_another_runner_reads_the_kept_line_ends_instead_of_scanning_the_object(s3, monkeypatch):
    """A job resumed on another runner (after a turn, or a runner's death) opens its input afresh: the line ends
    the first scan wrote beside the job's parts are read (8 bytes a line) instead of the whole object; a copy made
    for another version of the object is not used."""
    from aiworks.batch import lines as lines_module
    from aiworks.batch import objects
    from aiworks.batch.lines import LineIndex

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    scans = []
    real_blocks = objects.Ranged.blocks
    monkeypatch.setattr(objects.Ranged, "blocks", lambda self, *a: scans.append(self.etag) or real_blocks(self, *a))
    rows = [b'{"n": %d, "pad": "%s"}' % (i, b"x" * (i % 7)) for i in range(700)]
    s3.put("in/kept.jsonl", b"\n".join(rows) + b"\n")
    keep = "s3://jobs/kept/result.jsonl.parts/line-ends"
    with objects.mapped("s3://jobs/in/kept.jsonl") as data:
        first = LineIndex(data, keep_url=keep)
        assert first.total == 700 and len(scans) == 1
    assert objects.exists(keep)
    lines_module._kept_ends.clear()  # another runner: nothing kept in its memory
    with objects.mapped("s3://jobs/in/kept.jsonl") as data:
        again = LineIndex(data, keep_url=keep)
        assert again.total == 700 and again.lines(0, 700) == rows and again.lines(350, 352) == rows[350:352]
    assert len(scans) == 1, "the resumed job scanned the object again"
    s3.put("in/kept.jsonl", b"\n".join(rows[:20]) + b"\n")  # another version: the copy names the old one
    lines_module._kept_ends.clear()
    with objects.mapped("s3://jobs/in/kept.jsonl") as data:
        assert LineIndex(data, keep_url=keep).total == 20
    assert len(scans) == 2


def test_a_job_whose_s3_input_is_replaced_while_it_runs_fails_saying_so(batch_suite, runners, s3, monkeypatch):
    import time

    import requests

    job = _digits_job(batch_suite, s3, monkeypatch, "moving", 20_000, chunk_size=100)
    runners("s3-moving", env=s3.env(), args=("--concurrency", "1"))
    url, alice = f"{batch_suite.base}/v1/batches/{job.id}", batch_suite.headers("alice")
    deadline = time.monotonic() + 60
    while (doc := requests.get(url, headers=alice, timeout=10).json())["request_counts"]["completed"] == 0:
        assert time.monotonic() < deadline and doc["status"] in ("validating", "in_progress"), doc
        time.sleep(0.05)
    assert doc["status"] == "in_progress", doc
    s3.put("in/moving.jsonl", b"a different file\n")
    ended = wait_batch(batch_suite, "alice", job.id, lambda d: d["status"] not in ("validating", "in_progress"))
    assert ended["status"] == "failed", ended
    message = ended["errors"]["data"][0]["message"]
    assert "cannot read the input file" in message and "was replaced while the job read it" in message, message


def test_a_job_pauses_while_its_s3_store_is_down_and_finishes_when_it_is_back(batch_suite, runners, s3, monkeypatch):
    """The S3 server stopped mid-job (an outage, not a bad file): the runner pauses the job, keeping its finished
    chunks, rather than failing it, and the job completes with every line once the server is back. Last in the
    module: the server is restarted under it."""
    import time

    job = _digits_job(batch_suite, s3, monkeypatch, "outage", 3000, chunk_size=50)
    # One line a request, one at a time: slow enough to stop the server mid-job.
    runner = runners("s3-outage", env={**s3.env(), "AIWORKS_BATCH_ADAPTIVE": "false", "AIWORKS_BATCH_CONCURRENCY": "1",
                                       "AIWORKS_BATCH_PACK_ROWS": "1"})  # fmt: skip
    wait_batch(batch_suite, "alice", job.id, lambda d: d["chunks"]["done"] >= 3)
    s3.stop()
    try:
        assert _soon(lambda: "paused: cannot" in runner.log.read_text(), timeout_s=60), runner.log.read_text()[-3000:]
        time.sleep(1.0)
        held = wait_batch(batch_suite, "alice", job.id, lambda d: True)
        assert held["status"] == "in_progress" and 3 <= held["chunks"]["done"] < 60, held  # paused, not failed
    finally:
        s3.start()
    done = wait_batch(batch_suite, "alice", job.id, lambda d: d["status"] == "completed", timeout_s=180)
    assert done["request_counts"] == {"total": 3000, "completed": 3000, "failed": 0}
    client = S3Client("jobs", S3Config(endpoint=s3.endpoint, access_key=s3.env()["AWS_ACCESS_KEY_ID"],
                                       secret_key=s3.env()["AWS_SECRET_ACCESS_KEY"]))  # fmt: skip
    out = io.BytesIO()
    client.download("outage/result.jsonl", out, 1 << 30)
    assert [orjson.loads(line)["line"] for line in out.getvalue().splitlines()] == list(range(1, 3001))
