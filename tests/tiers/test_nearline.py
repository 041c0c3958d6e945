"""Nearline asynchronous requests end to end: 202 at once, the result later from GET /v2/requests/{id}.

The gateway queues ``Prefer: respond-async`` requests on a Redis Stream;
real ``aiworks nearline worker`` processes answer them through the gateway.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis
import requests

from .test_batch_jobs import _digits

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ASYNC = {"prefer": "respond-async"}


def _body(row: np.ndarray) -> dict:
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row.tolist()}]}


def _post(batch, tenant: str, body: dict, prefer: bool = True, model: str = "digits/versions/1"):
    headers = {**batch.headers(tenant), **(ASYNC if prefer else {})}
    return requests.post(f"{batch.base}/v2/models/{model}/infer", json=body, headers=headers, timeout=30)


def _result(batch, tenant: str, request_id: str, timeout_s: float = 60.0) -> requests.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        reply = requests.get(f"{batch.base}/v2/requests/{request_id}", headers=batch.headers(tenant), timeout=10)
        if reply.status_code != 202:
            return reply
        assert reply.json() == {"id": request_id, "status": "queued"}
        assert time.monotonic() < deadline, f"request {request_id} never answered"
        time.sleep(0.02)


def test_an_async_request_is_accepted_at_once_and_answered_later(batch_suite, workers):
    row = _digits(1)[0]
    queued = _post(batch_suite, "alice", _body(row))
    assert queued.status_code == 202, queued.text
    request_id = queued.json()["id"]
    assert queued.json()["status"] == "queued"
    assert queued.headers["location"] == f"/v2/requests/{request_id}"
    assert queued.headers["preference-applied"] == "respond-async"
    still = requests.get(f"{batch_suite.base}/v2/requests/{request_id}", headers=batch_suite.headers("alice"))
    assert still.status_code == 202  # no worker yet: it waits in the queue
    workers("worker")
    answer = _result(batch_suite, "alice", request_id)
    assert answer.status_code == 200 and answer.headers["aiworks-request-status"] == "completed"
    sync = _post(batch_suite, "alice", _body(row), prefer=False)
    assert sync.status_code == 200
    assert answer.json()["outputs"] == sync.json()["outputs"]


def test_bad_async_requests_are_refused_before_they_are_queued(batch_suite):
    bad = _post(batch_suite, "alice", {"inputs": "nope"})
    assert bad.status_code == 400, bad.text
    assert _post(batch_suite, "alice", _body(_digits(1)[0]), model="secret").status_code == 403
    anonymous = requests.post(f"{batch_suite.base}/v2/models/digits/infer", json=_body(_digits(1)[0]), headers=ASYNC)
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"].startswith("Bearer")


def test_a_tenant_reads_only_its_own_results(batch_suite, workers):
    queued = _post(batch_suite, "alice", _body(_digits(1)[0]))
    request_id = queued.json()["id"]
    for headers in (batch_suite.headers("bob"), {}):
        reply = requests.get(f"{batch_suite.base}/v2/requests/{request_id}", headers=headers, timeout=10)
        assert reply.status_code == (404 if headers else 401), reply.text
    assert requests.get(f"{batch_suite.base}/v2/requests/req_unknown", headers=batch_suite.headers("alice"),
                        timeout=10).status_code == 404  # fmt: skip
    for odd in ("..%2f..%2fetc", "a" * 65):  # no id it hands out: a 404 that says what an id looks like
        reply = requests.get(f"{batch_suite.base}/v2/requests/{odd}", headers=batch_suite.headers("alice"), timeout=10)
        assert reply.status_code == 404 and "a request id is up to 64 letters" in reply.text, reply.text
    workers("worker")
    assert _result(batch_suite, "alice", request_id).status_code == 200
    assert requests.get(f"{batch_suite.base}/v2/requests/{request_id}", headers=batch_suite.headers("bob"),
                        timeout=10).status_code == 404  # fmt: skip


def test_one_tenant_cannot_fill_the_queue_for_the_others(batch_suite, workers):
    """carol may have three requests queued (max_async_backlog in the tenants file): a fourth is 429 naming the
    bound while alice still queues, and once a worker has answered hers carol queues again."""
    row = _digits(1)[0]
    held = [_post(batch_suite, "carol", _body(row)) for _ in range(3)]
    assert [r.status_code for r in held] == [202] * 3, [r.text for r in held]
    refused = _post(batch_suite, "carol", _body(row))
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
    assert "tenant 'carol' already has 3 asynchronous requests queued" in refused.json()["error"]
    other = _post(batch_suite, "alice", _body(row))
    assert other.status_code == 202, other.text
    workers("worker")
    assert all(_result(batch_suite, "carol", r.json()["id"]).status_code == 200 for r in held)
    assert _result(batch_suite, "alice", other.json()["id"]).status_code == 200
    again = _post(batch_suite, "carol", _body(row))
    assert again.status_code == 202 and _result(batch_suite, "carol", again.json()["id"]).status_code == 200


def test_one_tenants_backlog_does_not_hold_up_another_tenants_request(batch_suite, workers):
    """alice queues 300 requests, then bob one; a worker started after them answers bob's among alice's first
    few (each tenant has its own stream, read in turns), not after her 300 as one queue in arrival order would."""
    rows = _digits(300)
    with ThreadPoolExecutor(8) as pool:
        alice = list(pool.map(lambda r: _post(batch_suite, "alice", _body(r)).json()["id"], rows))
    bob = _post(batch_suite, "bob", _body(rows[0]))
    assert bob.status_code == 202, bob.text
    workers("fair", "--concurrency", "4")
    assert _result(batch_suite, "bob", bob.json()["id"]).status_code == 200
    store = redis.Redis.from_url(batch_suite.redis_url)
    done_at = lambda request_id: float(store.hget(f"aiworks:async:req:{request_id}", "completed_at") or "inf")  # noqa: E731
    bob_at = done_at(bob.json()["id"])
    before_bob = sum(done_at(i) < bob_at for i in alice)
    assert before_bob <= 16, f"{before_bob} of alice's 300 requests were answered before bob's one"
    assert all(_result(batch_suite, "alice", i).status_code == 200 for i in alice)


def test_a_burst_is_absorbed_and_survives_a_killed_worker(batch_suite, workers):
    """400 requests queued with no worker; one worker killed mid-way; a second takes over what it left."""
    rows = _digits(400)
    with ThreadPoolExecutor(8) as pool:
        submitted = list(pool.map(lambda r: (time.monotonic(), _post(batch_suite, "bob", _body(r))), rows))
    assert all(reply.status_code == 202 for _, reply in submitted)
    first = workers("first", "--concurrency", "8")
    time.sleep(1.0)
    first.kill()
    workers("second", "--claim-idle-s", "1")
    latencies, statuses = [], []
    for (sent_at, reply), _row in zip(submitted, rows):
        answer = _result(batch_suite, "bob", reply.json()["id"])
        latencies.append(time.monotonic() - sent_at)
        statuses.append(answer.status_code)
    assert statuses == [200] * len(rows)
    print(f"\n400 async requests (burst, one worker killed): p99 submit-to-result {np.percentile(latencies, 99):.2f} s "
          "(read in submission order, so an upper bound)")


def test_results_expire_after_their_ttl(batch_suite, workers):
    workers("short-ttl", "--result-ttl-s", "1")
    request_id = _post(batch_suite, "alice", _body(_digits(1)[0])).json()["id"]
    assert _result(batch_suite, "alice", request_id).status_code == 200
    time.sleep(1.5)
    gone = requests.get(f"{batch_suite.base}/v2/requests/{request_id}", headers=batch_suite.headers("alice"))
    assert gone.status_code == 404 and "limited time" in gone.json()["error"]
