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
from .test_batch_jobs import _digits, _jsonl, _line

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def s3(tmp_path):
    server = SeaweedS3(tmp_path / "s3", bucket="jobs")
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
