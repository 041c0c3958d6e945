"""Batch jobs end to end: the Batch API on a real gateway, real runners, a private Redis.

Digits rows go through the gateway as batch-class requests; outputs are
checked against the same rows answered online, line by line and in order.
A runner killed with SIGKILL mid-job is replaced and the job resumes: every
line is in the output exactly once, and the tenant's metered requests show
that finished chunks were not sent again (only the two chunks in flight).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
import redis
import requests
import tritonclient.http as httpclient

from aiworks.demo.models import digits_split

from .conftest import wait_batch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENDPOINT = "/v2/models/digits/versions/1/infer"
ROWS = 2000


def _digits(rows: int) -> np.ndarray:
    _, x_test, _, _ = digits_split()
    x = x_test.astype(np.float32)
    return np.concatenate([x] * (rows // len(x) + 1))[:rows]


def _line(i: int, row: np.ndarray) -> bytes:
    request = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row.tolist()}],
               "outputs": [{"name": "label"}]}  # fmt: skip
    return orjson.dumps({"custom_id": f"row-{i}", **request})


def _jsonl(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


def _online_labels(batch, x: np.ndarray) -> list[int]:
    client = httpclient.InferenceServerClient(batch.suite.http_url)
    labels = []
    try:
        for start in range(0, len(x), 64):
            rows = x[start : start + 64]
            inp = httpclient.InferInput("input", list(rows.shape), "FP32")
            inp.set_data_from_numpy(rows)
            result = client.infer("digits", [inp], model_version="1", headers=batch.headers("alice"))
            labels.extend(int(v) for v in result.as_numpy("label").reshape(-1))
    finally:
        client.close()
    return labels


def _upload(batch, tenant: str, data: bytes, name: str = "input.jsonl") -> dict:
    reply = requests.post(f"{batch.base}/v1/files", headers=batch.headers(tenant), data={"purpose": "batch"},
                          files={"file": (name, data, "application/jsonl")}, timeout=60)  # fmt: skip
    assert reply.status_code == 200, reply.text
    return reply.json()


def _submit(batch, tenant: str, data: bytes, **extra) -> dict:
    uploaded = _upload(batch, tenant, data)
    body = {"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "completion_window": "24h", **extra}
    reply = requests.post(f"{batch.base}/v1/batches", headers=batch.headers(tenant), json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    doc = reply.json()
    assert doc["object"] == "batch" and doc["status"] == "validating" and doc["input_file_id"] == uploaded["id"]
    return doc


def _content(batch, tenant: str, file_id: str) -> list[dict]:
    reply = requests.get(f"{batch.base}/v1/files/{file_id}/content", headers=batch.headers(tenant), timeout=60)
    assert reply.status_code == 200, reply.text
    return [orjson.loads(line) for line in reply.content.splitlines()]


def _usage_rows(batch, tenant: str) -> int:
    """The rows the tenant was metered for on digits (the runner packs several lines into one request)."""
    reply = requests.get(f"{batch.base}/v2/usage", headers=batch.headers(tenant), timeout=10)
    assert reply.status_code == 200, reply.text
    return sum(t["rows"] for t in reply.json()["totals"] if t["model"] == "digits")


def _soon(check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _ended(doc: dict) -> bool:
    return doc["status"] in ("completed", "cancelled")


def test_a_2000_line_digits_job_completes_in_input_order(batch_suite, runners):
    x = _digits(ROWS)
    expected = _online_labels(batch_suite, x)
    job = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    runners("runner")
    started = time.monotonic()
    done = wait_batch(batch_suite, "alice", job["id"], _ended)
    elapsed = time.monotonic() - started
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": ROWS, "completed": ROWS, "failed": 0}
    assert done["completed_at"] >= done["in_progress_at"] >= done["created_at"]
    out = _content(batch_suite, "alice", done["output_file_id"])
    assert [o["line"] for o in out] == list(range(1, ROWS + 1))
    assert [o["custom_id"] for o in out] == [f"row-{i}" for i in range(ROWS)]
    labels = [o["response"]["outputs"][0]["data"][0] for o in out]
    assert labels == expected
    assert out[0]["response"]["model_name"] == "digits" and out[0]["response"]["model_version"] == "1"
    assert _content(batch_suite, "alice", done["error_file_id"]) == []
    assert _soon(lambda: not list((batch_suite.work / "files").rglob("*.parts")))  # parts go once the job ends
    print(f"\n2000-line digits job: {elapsed:.1f} s from the runner's start, {ROWS / elapsed:.0f} rows/s")


def test_the_official_openai_client_uploads_runs_and_downloads_a_job(batch_suite, runners):
    """The Batch API from the ``openai`` package, as an OpenAI user would call it: files, batches, content."""
    import openai

    x = _digits(200)
    expected = _online_labels(batch_suite, x)
    client = openai.OpenAI(base_url=f"{batch_suite.base}/v1", api_key=batch_suite.keys["alice"], max_retries=0)
    uploaded = client.files.create(file=("digits.jsonl", _jsonl([_line(i, row) for i, row in enumerate(x)])),
                                   purpose="batch")  # fmt: skip
    assert uploaded.id.startswith("file-") and uploaded.purpose == "batch" and uploaded.filename == "digits.jsonl"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h",
                                  metadata={"run": "openai-client"})  # fmt: skip
    assert batch.status == "validating" and batch.metadata == {"run": "openai-client"}
    runners("runner")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (200, 200, 0)
    assert batch.id in [b.id for b in client.batches.list()]
    # batches.list pages with `after` (one a page here) through the same jobs as one page of 100.
    paged_jobs = [b.id for b in client.batches.list(limit=1)]
    assert paged_jobs == [b.id for b in client.batches.list(limit=100).data] and batch.id in paged_jobs
    out = [orjson.loads(line) for line in client.files.content(batch.output_file_id).content.splitlines()]
    assert [o["custom_id"] for o in out] == [f"row-{i}" for i in range(200)]
    assert [o["response"]["outputs"][0]["data"][0] for o in out] == expected
    bob = openai.OpenAI(base_url=f"{batch_suite.base}/v1", api_key=batch_suite.keys["bob"], max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:  # another tenant's job does not exist for bob
        bob.batches.retrieve(batch.id)
    # Errors come in OpenAI's format, so the client's exception carries the reason, not just "Error code: 404".
    assert f"no batch '{batch.id}'" in refused.value.message and refused.value.body["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h",
                              metadata={"run": "x" * 513})  # fmt: skip
    assert "at most 512 characters" in bad.value.message and bad.value.body["code"] == "invalid_argument"
    # files.list pages through alice's files with `after` (two a page here), and nothing of bob's is there.
    paged = [f.id for f in client.files.list(limit=2)]
    whole = client.files.list().data
    assert paged == [f.id for f in whole] and len(set(paged)) == len(paged)
    assert {uploaded.id, batch.output_file_id} <= set(paged)
    assert [f.created_at for f in whole] == sorted((f.created_at for f in whole), reverse=True)
    outputs = [f.id for f in client.files.list(purpose="batch_output")]
    assert batch.output_file_id in outputs and uploaded.id not in outputs
    assert not {uploaded.id, batch.output_file_id} & {f.id for f in bob.files.list()}
    # files.delete: gone from the list and from storage; bob cannot delete alice's.
    with pytest.raises(openai.NotFoundError):
        bob.files.delete(batch.output_file_id)
    for file_id in (uploaded.id, batch.output_file_id):
        deleted = client.files.delete(file_id)
        assert (deleted.id, deleted.deleted) == (file_id, True)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
    assert not {uploaded.id, batch.output_file_id} & {f.id for f in client.files.list()}
    assert not list((batch_suite.work / "files").rglob(f"{uploaded.id}*"))


def test_a_jobs_input_cannot_be_deleted_until_the_job_ends(batch_suite):
    job = _submit(batch_suite, "carol", _jsonl([_line(0, _digits(1)[0])]))
    base, carol = batch_suite.base, batch_suite.headers("carol")
    reply = requests.delete(f"{base}/v1/files/{job['input_file_id']}", headers=carol, timeout=10)
    assert reply.status_code == 412, reply.text
    assert f"is the input of batch '{job['id']}', which is validating" in reply.text
    assert requests.get(f"{base}/v1/files/{job['input_file_id']}/content", headers=carol, timeout=10).status_code == 200
    for bad, reason in (("limit=0", "limit must be between 1 and 10000"), ("limit=x", "limit must be an integer"),
                        ("order=up", "order must be 'asc' or 'desc'")):  # fmt: skip
        reply = requests.get(f"{base}/v1/files?{bad}", headers=carol, timeout=10)
        assert reply.status_code == 400 and reason in reply.text, reply.text
    # Pages in either order, each file once.
    ids = []
    after = ""
    while True:
        page = requests.get(f"{base}/v1/files?limit=1&order=asc{after}", headers=carol, timeout=10).json()
        ids += [f["id"] for f in page["data"]]
        if not page["has_more"]:
            break
        after = f"&after={page['last_id']}"
    newest_first = requests.get(f"{base}/v1/files", headers=carol, timeout=10).json()["data"]
    assert ids == [f["id"] for f in reversed(newest_first)] and job["input_file_id"] in ids
    requests.post(f"{base}/v1/batches/{job['id']}/cancel", headers=carol, timeout=10)


def test_a_bad_line_among_packed_neighbours_is_charged_to_itself_alone(batch_suite, runners):
    """Lines 1-40 agree on everything but their rows, so the runner packs them into requests of many rows;
    line 7 carries text where FP32 numbers belong. The packed request holding it is refused; its lines are
    then sent one by one: line 7 alone lands in the error file, with the gateway's reason, the rest answered."""
    x = _digits(40)
    lines = [_line(i, row) for i, row in enumerate(x)]
    bad = orjson.loads(lines[6])
    bad["inputs"][0]["data"] = ["seven"] * 64
    lines[6] = orjson.dumps(bad)
    job = _submit(batch_suite, "alice", _jsonl(lines), chunk_size=40)
    runners("packer")
    done = wait_batch(batch_suite, "alice", job["id"], _ended)
    assert done["request_counts"] == {"total": 40, "completed": 39, "failed": 1}, done
    out = _content(batch_suite, "alice", done["output_file_id"])
    errors = _content(batch_suite, "alice", done["error_file_id"])
    assert [o["line"] for o in out] == [n for n in range(1, 41) if n != 7]
    assert [o["response"]["outputs"][0]["data"][0] for o in out] == [
        label for i, label in enumerate(_online_labels(batch_suite, x)) if i != 6
    ]
    assert [(e["line"], e["custom_id"], e["error"]["code"]) for e in errors] == [(7, "row-6", "400")], errors
    assert "input" in errors[0]["error"]["message"], errors


def test_a_killed_runner_is_replaced_and_every_line_appears_exactly_once(batch_suite, runners):
    x = _digits(ROWS)
    lines = [_line(i, row) for i, row in enumerate(x)]
    lines[10] = b"{broken"  # a malformed line in a finished chunk: in the error file once, not twice
    job = _submit(batch_suite, "carol", _jsonl(lines), chunk_size=50)
    first = runners("first")
    wait_batch(batch_suite, "carol", job["id"], lambda d: d["chunks"]["done"] >= 8)
    first.kill()
    killed_at = wait_batch(batch_suite, "carol", job["id"], lambda d: True)
    assert killed_at["status"] == "in_progress" and killed_at["chunks"]["done"] < killed_at["chunks"]["total"]
    runners("second")
    done = wait_batch(batch_suite, "carol", job["id"], _ended)
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": ROWS, "completed": ROWS - 1, "failed": 1}
    out = _content(batch_suite, "carol", done["output_file_id"])
    errors = _content(batch_suite, "carol", done["error_file_id"])
    assert [o["line"] for o in out] == [n for n in range(1, ROWS + 1) if n != 11]
    assert [(e["line"], e["custom_id"]) for e in errors] == [(11, None)]
    assert "malformed JSON" in errors[0]["error"]["message"]
    # Finished chunks were not sent again: at most the two chunks in flight at the kill were.
    deadline = time.monotonic() + 10
    while (sent := _usage_rows(batch_suite, "carol")) < ROWS - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ROWS - 1 <= sent <= ROWS - 1 + 2 * 50, sent


def test_malformed_lines_go_to_the_error_file_and_the_job_goes_on(batch_suite, runners):
    x = _digits(6)
    lines = [
        _line(0, x[0]),
        b"not json at all",
        orjson.dumps({"custom_id": "no-inputs", "outputs": []}),
        _line(3, x[3]),
        orjson.dumps(
            {
                "custom_id": "bad-shape",
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}],
            }
        ),  # fmt: skip
        b"",
        _line(6, x[5]),
    ]
    job = _submit(batch_suite, "alice", _jsonl(lines), chunk_size=3)
    runners("runner")
    done = wait_batch(batch_suite, "alice", job["id"], _ended)
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 7, "completed": 3, "failed": 4}
    out = _content(batch_suite, "alice", done["output_file_id"])
    assert [(o["line"], o["custom_id"]) for o in out] == [(1, "row-0"), (4, "row-3"), (7, "row-6")]
    errors = {e["line"]: e for e in _content(batch_suite, "alice", done["error_file_id"])}
    assert sorted(errors) == [2, 3, 5, 6]
    assert "malformed JSON" in errors[2]["error"]["message"]
    assert "'inputs' must be a non-empty list" in errors[3]["error"]["message"]
    assert errors[5]["error"]["code"] == "400" and errors[5]["custom_id"] == "bad-shape"  # the gateway refused it
    assert errors[6]["error"]["message"] == "empty line"


def test_cancel_stops_within_a_chunk_and_keeps_what_finished(batch_suite, runners):
    x = _digits(ROWS)
    job = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]), chunk_size=20)
    runners("runner")
    wait_batch(batch_suite, "alice", job["id"], lambda d: d["chunks"]["done"] >= 2)
    # While it runs, Redis holds where each finished chunk's lines are, not the lines: they are in a part beside
    # the output file, written before the chunk was recorded.
    store = redis.Redis.from_url(batch_suite.redis_url, decode_responses=True)
    output_url = store.hget(f"aiworks:batch:job:{job['id']}", "output_url")
    parts = store.hgetall(f"aiworks:batch:chunks:{job['id']}")
    assert len(parts) >= 2 and all(re.fullmatch(r"o:\d+", k) for k in parts), parts
    for key, part in parts.items():
        assert re.fullmatch(r"\d{8}\.runner-[0-9a-f]+\.o", part) and int(part[:8]) == int(key[2:]), part
        lines = (Path(output_url + ".parts") / (part[:-2] + ".out")).read_bytes().splitlines()
        assert [orjson.loads(line)["line"] for line in lines] == list(range(int(key[2:]) * 20 + 1, int(key[2:]) * 20 + 21))
    reply = requests.post(f"{batch_suite.base}/v1/batches/{job['id']}/cancel", headers=batch_suite.headers("alice"))
    assert reply.status_code == 200 and reply.json()["status"] in ("cancelling", "cancelled"), reply.text
    at_cancel = reply.json()["chunks"]["done"]
    done = wait_batch(batch_suite, "alice", job["id"], _ended)
    assert done["status"] == "cancelled" and done["cancelled_at"] >= done["cancelling_at"]
    assert done["chunks"]["done"] <= at_cancel + 1  # the chunk being answered at the cancel may finish, no more
    counts = done["request_counts"]
    assert counts["completed"] == 20 * done["chunks"]["done"] < ROWS
    out = _content(batch_suite, "alice", done["output_file_id"])
    assert [o["line"] for o in out] == list(range(1, counts["completed"] + 1))
    again = requests.post(f"{batch_suite.base}/v1/batches/{job['id']}/cancel", headers=batch_suite.headers("alice"))
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_a_file_is_served_in_blocks_and_one_gone_from_storage_is_a_404(batch_suite):
    data = b"".join(b'{"n": %d, "pad": "%s"}\n' % (i, b"x" * 200) for i in range(60_000))  # 13 MB: several blocks
    uploaded = _upload(batch_suite, "alice", data)
    url = f"{batch_suite.base}/v1/files/{uploaded['id']}/content"
    reply = requests.get(url, headers=batch_suite.headers("alice"), timeout=60)
    assert reply.status_code == 200 and reply.content == data
    assert reply.headers["content-type"].startswith("application/jsonl")
    stored = redis.Redis.from_url(batch_suite.redis_url, decode_responses=True).hget(
        f"aiworks:batch:file:{uploaded['id']}", "url"
    )
    Path(stored).unlink()
    reply = requests.get(url, headers=batch_suite.headers("alice"), timeout=60)
    assert reply.status_code == 404 and "no longer in storage" in reply.text, reply.text


def test_a_large_upload_does_not_hold_the_gateway_for_other_callers(batch_suite):
    """A 100 MB upload streams to the files store: the gateway answers other calls throughout (the whole body
    parsed at once held its event loop about 5 s per 100 MB)."""
    data = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}\n' * 1_100_000
    result: dict = {}

    def upload() -> None:
        result["reply"] = requests.post(f"{batch_suite.base}/v1/files", headers=batch_suite.headers("alice"),
                                        data={"purpose": "batch"}, files={"file": ("big.jsonl", data)}, timeout=300)  # fmt: skip

    uploader = threading.Thread(target=upload)
    slowest = 0.0
    with requests.Session() as session:
        uploader.start()
        while uploader.is_alive():
            started = time.perf_counter()
            assert session.get(f"{batch_suite.base}/v2/health/ready", timeout=30).status_code == 200
            slowest = max(slowest, time.perf_counter() - started)
            time.sleep(0.02)
    uploader.join()
    reply = result["reply"]
    assert reply.status_code == 200, reply.text
    assert reply.json()["bytes"] == len(data) and reply.json()["filename"] == "big.jsonl"
    print(f"\n{len(data) / 1e6:.0f} MB upload: the slowest health answer meanwhile took {slowest * 1e3:.0f} ms")
    assert slowest < 1.0
    content = requests.get(f"{batch_suite.base}/v1/files/{reply.json()['id']}/content",
                           headers=batch_suite.headers("alice"), timeout=120)  # fmt: skip
    assert content.status_code == 200 and content.content == data


def test_a_tenant_sees_only_its_own_files_and_jobs(batch_suite):
    job = _submit(batch_suite, "alice", _jsonl([_line(0, _digits(1)[0])]))
    base, bob = batch_suite.base, batch_suite.headers("bob")
    for path in (f"/v1/batches/{job['id']}", f"/v1/files/{job['input_file_id']}",
                 f"/v1/files/{job['input_file_id']}/content"):  # fmt: skip
        reply = requests.get(base + path, headers=bob, timeout=10)
        assert reply.status_code == 404, (path, reply.text)
        assert requests.get(base + path, timeout=10).status_code == 401
    assert requests.post(f"{base}/v1/batches/{job['id']}/cancel", headers=bob, timeout=10).status_code == 404
    listed = requests.get(f"{base}/v1/batches", headers=bob, timeout=10).json()["data"]
    assert job["id"] not in [b["id"] for b in listed]
    # bob cannot start a job on alice's file either
    body = {"input_file_id": job["input_file_id"], "endpoint": ENDPOINT}
    assert requests.post(f"{base}/v1/batches", headers=bob, json=body, timeout=10).status_code == 404
    mine = requests.get(f"{base}/v1/batches", headers=batch_suite.headers("alice"), timeout=10).json()["data"]
    assert job["id"] in [b["id"] for b in mine]


def test_bad_submissions_are_refused_with_the_reason(batch_suite):
    base, alice = batch_suite.base, batch_suite.headers("alice")
    reply = requests.post(f"{base}/v1/batches", headers=alice, timeout=10,
                          json={"input_file_id": "file_missing", "endpoint": ENDPOINT})  # fmt: skip
    assert reply.status_code == 404 and "no file" in reply.json()["error"]["message"]
    uploaded = _upload(batch_suite, "alice", b"{}\n")
    for body, reason in (
        ({"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions"}, "endpoint must be"),
        ({"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "completion_window": "soon"}, "completion_window"),
        ({"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "chunk_size": 0}, "chunk_size"),
        ({"endpoint": ENDPOINT}, "input_file_id is required"),
        # metadata as OpenAI's Batch API bounds it: 16 pairs, 64-character keys, string values of 512 at most
        ({"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "metadata": {str(i): "v" for i in range(17)}},
         "at most 16"),
        ({"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "metadata": {"k" * 65: "v"}}, "longer than 64"),
        ({"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "metadata": {"run": "x" * 513}}, "at most 512"),
        ({"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "metadata": {"run": {"nested": 1}}}, "a string"),
    ):
        reply = requests.post(f"{base}/v1/batches", headers=alice, json=body, timeout=10)
        assert reply.status_code == 400 and reason in reply.json()["error"]["message"], reply.text
    wrong = requests.post(f"{base}/v1/files", headers=alice, data={"purpose": "fine-tune"},
                          files={"file": ("x.jsonl", b"{}", "application/jsonl")}, timeout=10)  # fmt: skip
    assert wrong.status_code == 400 and "purpose must be 'batch'" in wrong.json()["error"]["message"]
    assert requests.post(f"{base}/v1/files", headers=alice, data=b"{}", timeout=10).status_code == 400
    # A tenant may not run a batch on a model it may not use.
    other = {"input_file_id": uploaded["id"], "endpoint": "/v2/models/secret/infer"}
    assert requests.post(f"{base}/v1/batches", headers=alice, json=other, timeout=10).status_code == 403


def test_the_cli_submits_shows_progress_and_fetches_results(batch_suite, runners, tmp_path):
    import json
    import os
    import subprocess
    import sys

    x = _digits(300)
    path = tmp_path / "digits.jsonl"
    path.write_bytes(_jsonl([_line(i, row) for i, row in enumerate(x)]))
    env = {**os.environ, "AIWORKS_API_KEY": batch_suite.keys["bob"], "AIWORKS_GATEWAY_URL": batch_suite.base}
    cli = [sys.executable, "-m", "aiworks", "batch"]
    runners("cli-runner")
    submitted = subprocess.run(cli + ["submit", str(path), "-m", "digits", "-x", "1", "--chunk-size", "30", "--wait",
                                      "-o", "json"], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    doc = json.loads(submitted.stdout)
    assert doc["status"] == "completed" and doc["request_counts"]["completed"] == 300
    assert "300/300 100%" in submitted.stderr and "rows/s" in submitted.stderr and "ETA" in submitted.stderr
    status = subprocess.run(cli + ["status", doc["id"]], env=env, capture_output=True, text=True, timeout=30)
    assert status.returncode == 0 and f"{doc['id']}  completed  300 ok, 0 failed of 300" in status.stdout
    results = subprocess.run(cli + ["results", doc["id"]], env=env, capture_output=True, text=True, timeout=30)
    assert [json.loads(line)["line"] for line in results.stdout.splitlines()] == list(range(1, 301))
    other = {**env, "AIWORKS_API_KEY": batch_suite.keys["alice"]}
    hidden = subprocess.run(cli + ["status", doc["id"]], env=other, capture_output=True, text=True, timeout=30)
    assert hidden.returncode != 0 and "404" in hidden.stderr
    missing = subprocess.run(cli + ["submit", str(tmp_path / "nope.jsonl"), "-m", "digits"], env=env,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    assert missing.returncode != 0 and "does not exist" in missing.stderr
    # Files: listed (all pages), the job's output file written to a file, then deleted; alice sees none of it.
    out = tmp_path / "out.jsonl"
    saved = subprocess.run(cli + ["results", doc["id"], "--out", str(out)], env=env, capture_output=True, text=True,
                           timeout=30)  # fmt: skip
    assert saved.returncode == 0 and out.read_text() == results.stdout
    listed = subprocess.run(cli + ["files", "-o", "json"], env=env, capture_output=True, text=True, timeout=30)
    files = {f["id"]: f for f in json.loads(listed.stdout)}
    assert files[doc["output_file_id"]]["purpose"] == "batch_output" and files[doc["input_file_id"]]["purpose"] == "batch"
    table = subprocess.run(cli + ["files", "--purpose", "batch_output"], env=env, capture_output=True, text=True,
                           timeout=30)  # fmt: skip
    assert doc["output_file_id"] in table.stdout and doc["input_file_id"] not in table.stdout
    refused = subprocess.run(cli + ["delete-file", doc["output_file_id"]], env=other, capture_output=True, text=True,
                             timeout=30)  # fmt: skip
    assert refused.returncode != 0 and "404" in refused.stderr
    deleted = subprocess.run(cli + ["delete-file", doc["output_file_id"], doc["input_file_id"]], env=env,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    assert deleted.returncode == 0 and deleted.stdout.splitlines() == [
        f"{doc['output_file_id']}  deleted", f"{doc['input_file_id']}  deleted"]  # fmt: skip
    gone = subprocess.run(cli + ["results", doc["id"]], env=env, capture_output=True, text=True, timeout=30)
    assert gone.returncode != 0 and "404" in gone.stderr


def test_aiworks_status_shows_jobs_not_yet_ended(batch_suite):
    import subprocess
    import sys

    from e2e.e2e_support import tool_env

    job = _submit(batch_suite, "alice", _jsonl([_line(0, _digits(1)[0])]))  # no runner: it stays queued
    supervisor = batch_suite.suite.supervisor
    shown = subprocess.run(
        [sys.executable, "-m", "aiworks", "status", "--scheduler", supervisor.scheduler_address,
         "--redis-url", batch_suite.redis_url], env=tool_env(supervisor), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    [row] = [line for line in shown.stdout.splitlines() if job["id"] in line]
    assert "alice" in row and "validating" in row and ENDPOINT in row
    assert "ASYNC REQUESTS queued:" in shown.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "aiworks", "status", "--scheduler-address", supervisor.scheduler_address,
         "--redis-url", batch_suite.redis_url, "-o", "json"], env=tool_env(supervisor), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert job["id"] in [j["id"] for j in doc["batch_jobs"]] and "replicas" in doc["scheduler"]
    reply = requests.post(f"{batch_suite.base}/v1/batches/{job['id']}/cancel", headers=batch_suite.headers("alice"))
    assert reply.json()["status"] == "cancelling"


def _ready(batch, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{batch.base}/v2/models/digits/versions/1/ready", headers=batch.headers("alice"),
                            timeout=2).status_code == 200:  # fmt: skip
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise AssertionError("the suite did not become ready again")


def test_a_job_survives_kill_9_of_the_gateway_and_of_the_runtime(batch_suite, runners):
    import os
    import signal

    supervisor = batch_suite.suite.supervisor
    x = _digits(ROWS)
    job = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]), chunk_size=25)
    runners("runner")
    for name in ("gateway", "runtime-0"):
        at_kill = wait_batch(batch_suite, "alice", job["id"], lambda d: d["chunks"]["done"] >= 3 or _ended(d))
        assert at_kill["status"] == "in_progress", (name, at_kill)  # the kill lands mid-job
        os.kill(supervisor.child(name).process.pid, signal.SIGKILL)
        time.sleep(1.0)  # the runner meets refused connections (gateway) or 503s (runtime) and keeps retrying
        supervisor.restart(name)
        _ready(batch_suite)
    done = wait_batch(batch_suite, "alice", job["id"], _ended, timeout_s=180)
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": ROWS, "completed": ROWS, "failed": 0}
    out = _content(batch_suite, "alice", done["output_file_id"])
    assert [o["line"] for o in out] == list(range(1, ROWS + 1))
