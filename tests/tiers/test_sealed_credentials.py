"""The callers' credentials that wait in Redis with batch jobs and asynchronous requests are sealed.

The gateway keeps each submitter's ``Authorization`` value until a batch
runner or a nearline worker sends it (aiworks.security.sealing). Here every
key of the suite's real Redis is read while a job and a request wait, and
the tenant's API key is nowhere in it; runners and workers given the key
file run them as the tenant; one without it says so instead.
"""

from __future__ import annotations

import time

import pytest
import redis
import requests

from aiworks.security.sealing import is_sealed

from .conftest import wait_batch
from .test_batch_jobs import _digits, _jsonl, _line, _submit
from .test_nearline import _body, _post, _result

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _everything_in(url: str) -> bytes:
    """Every key and value of the Redis at ``url``, as one blob (strings, hashes, lists, sets, zsets, streams)."""
    client = redis.Redis.from_url(url)
    out = []
    try:
        for key in client.scan_iter(count=1000):
            out.append(key)
            kind = client.type(key)
            if kind == b"string":
                out.append(client.get(key) or b"")
            elif kind == b"hash":
                out.extend(b for item in client.hgetall(key).items() for b in item)
            elif kind == b"list":
                out.extend(client.lrange(key, 0, -1))
            elif kind == b"set":
                out.extend(client.smembers(key))
            elif kind == b"zset":
                out.extend(client.zrange(key, 0, -1))
            elif kind == b"stream":
                out.extend(b for _, fields in client.xrange(key) for item in fields.items() for b in item)
    finally:
        client.close()
    return b"\n".join(out)


def _job_doc(batch, job_id: str, until, timeout_s: float = 60.0, tenant: str = "bob") -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        doc = requests.get(f"{batch.base}/v1/batches/{job_id}", headers=batch.headers(tenant), timeout=10).json()
        if until(doc):
            return doc
        assert time.monotonic() < deadline, doc
        time.sleep(0.05)


def test_no_api_key_is_in_redis_while_jobs_and_requests_wait_and_they_still_run_as_their_tenant(
    batch_suite, runners, workers
):
    key = batch_suite.keys["alice"]
    x = _digits(20)
    job = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    queued = _post(batch_suite, "alice", _body(x[0]))
    assert queued.status_code == 202, queued.text

    stored = _everything_in(batch_suite.redis_url)
    assert key.encode() not in stored, "an API key in clear in Redis"
    client = redis.Redis.from_url(batch_suite.redis_url, decode_responses=True)
    try:
        secret = client.get(f"aiworks:batch:secret:{job['id']}")
        entries = client.xrange("aiworks:async:requests:alice")
    finally:
        client.close()
    assert secret and is_sealed(secret)
    mine = [fields for _, fields in entries if fields["id"] == queued.json()["id"]]
    assert mine and is_sealed(mine[0]["credential"])
    # The queued request's token lives until its deadline (120 s in this suite) and a minute, not for the hour
    # its result is kept: a worker never sends it later.
    from aiworks.security.sealing import Sealer
    from aiworks.security.work_tokens import WorkTokens

    opened = Sealer.from_file(batch_suite.credential_key).open(mine[0]["credential"], f"request {mine[0]['id']}")
    claims = WorkTokens.from_file(batch_suite.credential_key).verify(opened.removeprefix("Bearer "))
    assert claims.work == "async" and claims.work_id == ""
    assert 120 + 60 <= claims.expires_at - claims.issued_at <= 120 + 62, claims

    # Given the gateway's key file, the runner and the worker open them and act as alice: her model, her usage.
    runners("runner")
    workers("worker")
    done = wait_batch(batch_suite, "alice", job["id"], lambda d: d["status"] == "completed")
    assert done["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
    answer = _result(batch_suite, "alice", queued.json()["id"])
    assert answer.status_code == 200 and answer.headers["aiworks-request-status"] == "completed"


def test_a_runner_or_worker_without_the_key_says_so_rather_than_sending_anything(batch_suite, runners, workers):
    x = _digits(5)
    job = _submit(batch_suite, "bob", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    queued = _post(batch_suite, "bob", _body(x[0]))
    assert queued.status_code == 202, queued.text

    runners("keyless", env={"AIWORKS_BATCH_CREDENTIAL_KEY_FILE": ""})
    failed = _job_doc(batch_suite, job["id"], lambda d: d["status"] not in ("validating", "in_progress"))
    assert failed["status"] == "failed", failed
    message = failed["errors"]["data"][0]["message"]
    assert "credential" in message and "no credential key file" in message, message
    assert batch_suite.keys["bob"] not in message

    workers("keyless", "--credential-key-file", "")
    answer = _result(batch_suite, "bob", queued.json()["id"])
    assert answer.status_code == 500 and answer.headers["aiworks-request-status"] == "failed"
    assert "no credential key file" in answer.json()["error"], answer.text


def test_what_waits_is_a_work_token_that_runs_inference_only(batch_suite):
    """Opened with the key file, a job's stored credential is a token the gateway minted, not alice's key; it
    runs her job's model and nothing else (no other model, no Batch or Files API, no async queue, no streams,
    no results)."""
    from aiworks.security.sealing import Sealer

    x = _digits(3)
    job = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    client = redis.Redis.from_url(batch_suite.redis_url, decode_responses=True)
    try:
        sealed = client.get(f"aiworks:batch:secret:{job['id']}")
    finally:
        client.close()
    opened = Sealer.from_file(batch_suite.credential_key).open(sealed, f"batch job {job['id']}")
    assert opened.startswith("Bearer aiwt1.") and batch_suite.keys["alice"] not in opened
    as_job = {"authorization": opened}
    base = batch_suite.base
    answer = requests.post(f"{base}/v2/models/digits/infer", json=_body(x[0]), headers=as_job, timeout=10)
    assert answer.status_code == 200, answer.text
    refused = {
        "batches": requests.get(f"{base}/v1/batches", headers=as_job, timeout=10),
        "files": requests.get(f"{base}/v1/files", headers=as_job, timeout=10),
        "async": requests.post(f"{base}/v2/models/digits/infer", json=_body(x[0]),
                               headers={**as_job, "prefer": "respond-async"}, timeout=10),  # fmt: skip
        "result": requests.get(f"{base}/v2/requests/req_x", headers=as_job, timeout=10),
        "stream": requests.get(f"{base}/v2/streams/alarms", headers=as_job, timeout=10),
    }
    other = requests.post(f"{base}/v2/models/iris/infer", headers=as_job, timeout=10, json={
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}]})
    refused["another model of the tenant"] = other
    for what, response in refused.items():
        assert response.status_code == 403 and "work token" in response.text, (what, response.text)
    requests.post(f"{base}/v1/batches/{job['id']}/cancel", headers=batch_suite.headers("alice"), timeout=10)


def test_a_cancelled_jobs_work_token_runs_nothing_more(batch_suite, runners):
    """Once a job has ended, every gateway refuses its work token, which would otherwise run the job's model as
    its tenant until the token's expiry (the completion window): one taken from a cancelled job is worthless."""
    from aiworks.security.sealing import Sealer

    x = _digits(3)
    job = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    opened = Sealer.from_file(batch_suite.credential_key).open(_stored_credential(batch_suite, job["id"]),
                                                               f"batch job {job['id']}")  # fmt: skip
    as_job = {"authorization": opened}
    infer = f"{batch_suite.base}/v2/models/digits/infer"
    assert requests.post(infer, json=_body(x[0]), headers=as_job, timeout=10).status_code == 200
    cancel = requests.post(f"{batch_suite.base}/v1/batches/{job['id']}/cancel", headers=batch_suite.headers("alice"),
                           timeout=10)  # fmt: skip
    assert cancel.status_code == 200 and cancel.json()["status"] == "cancelling", cancel.text
    runners("ends-the-cancel")
    _job_doc(batch_suite, job["id"], lambda d: d["status"] == "cancelled", tenant="alice")
    deadline = time.monotonic() + 10  # the gateway reads ended jobs every second
    while (answer := requests.post(infer, json=_body(x[0]), headers=as_job, timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "the cancelled job's token still runs inference"
        time.sleep(0.1)
    assert answer.status_code == 401, answer.text
    assert f"batch job '{job['id']}' has ended" in answer.text and opened.split()[1] not in answer.text
    # Another job's token, the same tenant's, still runs.
    other = _submit(batch_suite, "alice", _jsonl([_line(0, x[0])]))
    theirs = Sealer.from_file(batch_suite.credential_key).open(_stored_credential(batch_suite, other["id"]),
                                                               f"batch job {other['id']}")  # fmt: skip
    assert requests.post(infer, json=_body(x[0]), headers={"authorization": theirs}, timeout=10).status_code == 200
    requests.post(f"{batch_suite.base}/v1/batches/{other['id']}/cancel", headers=batch_suite.headers("alice"),
                  timeout=10)  # fmt: skip


def test_a_job_submitted_with_a_short_lived_jwt_runs_to_its_end_after_the_jwt_expired(batch_suite, runners):
    """The job runs with its work token, not the JWT: before work tokens, every line after the JWT's expiry was
    a 401. The JWT lives 3 s; no runner starts until it is dead."""
    import jwt

    from .test_batch_jobs import ENDPOINT, _upload

    secret = (batch_suite.work / "jwt-key").read_bytes().strip()
    expiry = int(time.time()) + 3
    short = jwt.encode({"tenant": "bob", "sub": "bob-laptop", "iss": "tier-tests", "aud": "aiworks", "exp": expiry},
                       secret, algorithm="HS256")  # fmt: skip
    as_bob = {"authorization": f"Bearer {short}"}
    x = _digits(10)
    uploaded = _upload(batch_suite, "bob", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    reply = requests.post(f"{batch_suite.base}/v1/batches", headers=as_bob, timeout=30,
                          json={"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "completion_window": "24h"})
    assert reply.status_code == 200, reply.text
    time.sleep(max(0.0, expiry + 1.2 - time.time()))
    expired = requests.get(f"{batch_suite.base}/v1/batches", headers=as_bob, timeout=10)
    assert expired.status_code == 401 and "expired" in expired.text, expired.text  # the JWT is dead
    runners("after-the-jwt")
    done = wait_batch(batch_suite, "bob", reply.json()["id"], lambda d: d["status"] == "completed")
    assert done["request_counts"] == {"total": 10, "completed": 10, "failed": 0}


def test_a_job_whose_token_the_gateway_refuses_stops_and_accounts_for_every_line(batch_suite, runners):
    """A 401 (the submitting key revoked, the tenant removed, the token from another installation) would refuse
    every further line the same: the job stops after the chunks in flight and ends failed, saying why, with
    every line it did not answer in the error file. Here the stored token is swapped for one another
    installation minted, sealed as the gateway would."""
    from aiworks.security.sealing import Sealer
    from aiworks.security.work_tokens import WorkTokens

    from .test_batch_jobs import _content

    x = _digits(1000)
    job = _submit(batch_suite, "carol", _jsonl([_line(i, row) for i, row in enumerate(x)]), chunk_size=100)
    foreign = WorkTokens(b"another-installations-credential-key-0123").mint(
        tenant="carol", method="api_key", subject="sha256:000000000000", work="batch", model="digits",
        lifetime_s=3600)  # fmt: skip
    context = f"batch job {job['id']}"
    client = redis.Redis.from_url(batch_suite.redis_url, decode_responses=True)
    try:
        client.set(f"aiworks:batch:secret:{job['id']}",
                   Sealer.from_file(batch_suite.credential_key).seal(f"Bearer {foreign}", context))  # fmt: skip
    finally:
        client.close()
    runners("refused", env={"AIWORKS_BATCH_AUTH_RETRY_S": "1"})  # a 401 lasting 1 s is final (30 s by default)
    ended = _job_doc(batch_suite, job["id"], lambda d: d["status"] not in ("validating", "in_progress"),
                     tenant="carol")  # fmt: skip
    assert ended["status"] == "failed", ended
    message = ended["errors"]["data"][0]["message"]
    assert "refused the job's credential" in message and "credential key" in message and foreign not in message
    errors = _content(batch_suite, "carol", ended["error_file_id"])
    assert sorted(e["line"] for e in errors) == list(range(1, 1001))  # every line, once, with its reason
    codes = [e["error"]["code"] for e in errors]
    assert set(codes) == {"401", "credential_refused"} and codes.count("credential_refused") >= 700, codes
    assert ended["request_counts"]["completed"] == 0


def _stored_credential(batch, job_id: str) -> str:
    client = redis.Redis.from_url(batch.redis_url, decode_responses=True)
    try:
        return client.get(f"aiworks:batch:secret:{job_id}")
    finally:
        client.close()


def test_work_in_flight_across_a_credential_key_rotation_finishes_and_a_retired_key_opens_nothing(
    batch_suite, runners, workers
):
    """The credential key file rotated at once (a new key seals and mints, the old one still opens and
    verifies), the gateway restarted on it: a job and a queued request sealed under the old key before the
    rotation, and a job sealed under the new one after it, all run with a runner and a worker started on the
    new file. Once the old key is retired and the gateway restarted again, the old key's work token is
    refused (401, naming why) and the new key's still verifies (refused only because its job has ended)."""
    from aiworks.security.keyring import rotate_file
    from aiworks.security.sealing import Sealer

    from .test_batch_jobs import _ready

    supervisor = batch_suite.suite.supervisor
    key_file = batch_suite.credential_key
    x = _digits(8)
    before = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    queued = _post(batch_suite, "alice", _body(x[0]))
    assert queued.status_code == 202, queued.text
    old_id = Sealer.from_file(key_file).key_id
    sealed_before = _stored_credential(batch_suite, before["id"])
    assert sealed_before.startswith(f"aiw1.{old_id}.")
    old_token = Sealer.from_file(key_file).open(sealed_before, f"batch job {before['id']}")

    rotate_file(key_file, "at-once")
    supervisor.restart("gateway")
    _ready(batch_suite)
    new_id = Sealer.from_file(key_file).key_id
    assert new_id != old_id
    after = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    sealed_after = _stored_credential(batch_suite, after["id"])
    assert sealed_after.startswith(f"aiw1.{new_id}."), "the new key seals after the rotation"
    new_token = Sealer.from_file(key_file).open(sealed_after, f"batch job {after['id']}")

    runners("rotated")
    workers("rotated")
    for job in (before, after):
        done = wait_batch(batch_suite, "alice", job["id"], lambda d: d["status"] in ("completed", "failed"))
        assert done["request_counts"] == {"total": 8, "completed": 8, "failed": 0}, done
    answer = _result(batch_suite, "alice", queued.json()["id"])
    assert answer.status_code == 200 and answer.headers["aiworks-request-status"] == "completed", answer.text

    rotate_file(key_file, "retire")
    supervisor.restart("gateway")
    _ready(batch_suite)
    infer = f"{batch_suite.base}/v2/models/digits/infer"
    refused = requests.post(infer, json=_body(x[0]), headers={"authorization": old_token}, timeout=10)
    assert refused.status_code == 401 and "does not hold" in refused.text, refused.text
    # The new key's token still verifies: what refuses it now is only that its job has ended.
    kept = requests.post(infer, json=_body(x[0]), headers={"authorization": new_token}, timeout=10)
    assert kept.status_code == 401 and f"batch job '{after['id']}' has ended" in kept.text, kept.text


def _held_keys(port: int) -> dict[str, list[str]] | str:
    """What a process's /metrics says it holds: ``{"current": [id], "previous": [ids]}``; "starting" while
    its port is not open yet (a runner or worker just started, on a loaded machine)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except requests.ConnectionError:
        return "starting"
    held: dict[str, list[str]] = {"current": [], "previous": []}
    for family in text_string_to_metric_families(text):
        if family.name == "aiworks_credential_key_info":
            for sample in family.samples:
                if sample.value == 1:
                    held[sample.labels["role"]].append(sample.labels["key_id"])
    return {role: sorted(ids) for role, ids in held.items()}


def _until_all_hold(ports: dict[str, int], current: str, previous: list[str], timeout_s: float = 20.0) -> None:
    """What an operator does between two rotation steps: wait until every process's gauge shows the step."""
    want = {"current": [current], "previous": sorted(previous)}
    deadline = time.monotonic() + timeout_s
    while (held := {name: _held_keys(port) for name, port in ports.items()}) != {n: want for n in ports}:
        assert time.monotonic() < deadline, f"want {want} everywhere, have {held}"
        time.sleep(0.1)


def test_the_three_rotation_steps_need_no_restart(batch_suite, runners, workers):
    """The Kubernetes rotation without a restart: each step is written to the key file, and the gateway, a
    runner and a worker that were started before it take it (their /metrics say which key ids they hold).
    After ``stage`` and ``promote`` the gateway seals a new job and request under the new key, and the runner
    and worker, started when only the old key existed, open and run them; after ``retire`` the old key's work
    token is refused (401, naming why) and the new key's still runs. A broken file changes nothing."""
    from aiworks.security.keyring import rotate_file
    from aiworks.security.sealing import Sealer
    from aiworks.supervisor.supervisor import free_port

    key_file = batch_suite.credential_key
    ports = {"gateway": batch_suite.suite.supervisor.child("gateway").metrics_port,
             "runner": free_port(), "worker": free_port()}  # fmt: skip
    runners("unrestarted", args=("--metrics-port", str(ports["runner"])))
    workers("unrestarted", "--metrics-port", str(ports["worker"]))
    old = Sealer.from_file(key_file)
    (old_id,) = old.key_ids  # the last rotation test retired all but one
    _until_all_hold(ports, old_id, [])  # once up, the runner and worker hold the old key alone
    x = _digits(8)
    before = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    old_token = old.open(_stored_credential(batch_suite, before["id"]), f"batch job {before['id']}")  # kept till done
    done = wait_batch(batch_suite, "alice", before["id"], lambda d: d["status"] in ("completed", "failed"))
    assert done["request_counts"]["completed"] == 8, done

    rotate_file(key_file, "stage")
    new_id = Sealer.from_file(key_file).key_ids[1]
    _until_all_hold(ports, old_id, [new_id])
    rotate_file(key_file, "promote")
    _until_all_hold(ports, new_id, [old_id])

    after = _submit(batch_suite, "alice", _jsonl([_line(i, row) for i, row in enumerate(x)]))
    sealed_after = _stored_credential(batch_suite, after["id"])
    assert sealed_after.startswith(f"aiw1.{new_id}."), "the new key seals"
    new_token = Sealer.from_file(key_file).open(sealed_after, f"batch job {after['id']}")
    queued = _post(batch_suite, "alice", _body(x[0]))
    assert queued.status_code == 202, queued.text
    done = wait_batch(batch_suite, "alice", after["id"], lambda d: d["status"] in ("completed", "failed"))
    assert done["request_counts"] == {"total": 8, "completed": 8, "failed": 0}, done
    answer = _result(batch_suite, "alice", queued.json()["id"])
    assert answer.status_code == 200 and answer.headers["aiworks-request-status"] == "completed", answer.text

    good = key_file.read_bytes()
    key_file.write_bytes(b"short\n")  # a broken edit: logged, and the ring in use stays
    time.sleep(1.0)
    _until_all_hold(ports, new_id, [old_id])
    key_file.write_bytes(good)

    rotate_file(key_file, "retire")
    _until_all_hold(ports, new_id, [])
    infer = f"{batch_suite.base}/v2/models/digits/infer"
    refused = requests.post(infer, json=_body(x[0]), headers={"authorization": old_token}, timeout=10)
    assert refused.status_code == 401 and "does not hold" in refused.text, refused.text
    # The new key's token still verifies: what refuses it now is only that its job has ended.
    kept = requests.post(infer, json=_body(x[0]), headers={"authorization": new_token}, timeout=10)
    assert kept.status_code == 401 and f"batch job '{after['id']}' has ended" in kept.text, kept.text
    logged = (batch_suite.suite.supervisor.child("gateway").log_path).read_text()
    assert f"now credential key ids {new_id} (seals)" in logged and "line 1 holds 5 bytes" in logged
