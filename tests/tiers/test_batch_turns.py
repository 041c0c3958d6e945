"""Runners take jobs in turns: one tenant's long job cannot hold the only runner while another tenant's waits.

The real suite and a real ``aiworks batch runner``, with a turn of 1 s
(``AIWORKS_BATCH_TURN_S``; 60 s by default) and a runner slowed to one line
a request, two in flight, so alice's job lasts several turns.
"""

from __future__ import annotations

import pytest
import redis
import requests

from .conftest import wait_batch
from .test_batch_jobs import _content, _digits, _jsonl, _line, _submit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SLOW_RUNNER = {"AIWORKS_BATCH_TURN_S": "1", "AIWORKS_BATCH_PACK_ROWS": "1", "AIWORKS_BATCH_CONCURRENCY": "2"}


def test_a_long_job_lets_another_tenants_job_run_in_its_turn(batch_suite, runners):
    """alice's 4,000-line job is running on the one runner when bob submits 40 lines: bob's job is done while
    alice's is still in progress, and alice's then ends with every line once, in order."""
    x = _digits(4000)
    long = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]), chunk_size=100)
    runner = runners("turns", env=SLOW_RUNNER)
    wait_batch(batch_suite, "alice", long["id"], lambda d: d["request_counts"]["completed"] > 0)
    short = _submit(batch_suite, "bob", _jsonl([_line(i, row) for i, row in enumerate(x[:40])]))
    done = wait_batch(batch_suite, "bob", short["id"], lambda d: d["status"] == "completed", timeout_s=30)
    assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    meanwhile = requests.get(f"{batch_suite.base}/v1/batches/{long['id']}", headers=batch_suite.headers("alice"),
                             timeout=10).json()  # fmt: skip
    assert meanwhile["status"] == "in_progress" and meanwhile["request_counts"]["completed"] < 4000, meanwhile
    ended = wait_batch(batch_suite, "alice", long["id"], lambda d: d["status"] == "completed")
    assert ended["request_counts"] == {"total": 4000, "completed": 4000, "failed": 0}
    out = _content(batch_suite, "alice", ended["output_file_id"])
    assert [o["custom_id"] for o in out] == [f"row-{i}" for i in range(4000)]
    assert _content(batch_suite, "alice", ended["error_file_id"]) == []
    assert "its turn of 1 s is over and another job waits" in runner.log.read_text()


def test_a_job_alone_keeps_its_runner_past_its_turn(batch_suite, runners):
    """With nothing else waiting a job is not let go at the end of its turn: it runs to its end in one turn."""
    store = redis.Redis.from_url(batch_suite.redis_url, decode_responses=True)
    try:
        assert not store.smembers("aiworks:batch:active"), "a job of another test is still active"
    finally:
        store.close()
    x = _digits(1500)
    job = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    runner = runners("alone", env=SLOW_RUNNER)
    ended = wait_batch(batch_suite, "alice", job["id"], lambda d: d["status"] == "completed")
    assert ended["request_counts"] == {"total": 1500, "completed": 1500, "failed": 0}
    assert f"batch job {job['id']}: its turn" not in runner.log.read_text()
