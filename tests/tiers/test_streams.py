"""Result streams end to end: results published through tritonclient (HTTP and gRPC), read over SSE with httpx.

The suite's gateway runs with result streams on (tests/tiers/conftest.py), a send timeout of 1 s and
50 events per read. Each test uses its own stream names: the suite and its Redis are shared.
"""

from __future__ import annotations

import queue
import re
import socket
import threading
import time

import httpx
import numpy as np
import orjson
import pytest
import redis
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .test_batch_jobs import _digits

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class Subscriber:
    """One SSE subscription read in a thread: it ends after ``count`` events, or ``idle_s`` without one.

    ``stall_s``: the reader stops reading that long after its first event (a consumer that falls behind).
    """

    def __init__(self, url: str, headers: dict, count: int | None = None, idle_s: float = 3.0, stall_s: float = 0.0):
        self.events: queue.Queue[dict] = queue.Queue()
        self.status: int | None = None
        self.opened = threading.Event()
        self.stall_s = stall_s
        self._thread = threading.Thread(target=self._read, args=(url, headers, count, idle_s), daemon=True)
        self._thread.start()
        assert self.opened.wait(30), "the subscription never answered"

    def _read(self, url: str, headers: dict, count: int | None, idle_s: float) -> None:
        try:
            with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(10.0, read=idle_s)) as reply:
                self.status = reply.status_code
                self.opened.set()
                if reply.status_code != 200:
                    return
                event: dict = {}
                seen = 0
                for line in reply.iter_lines():
                    if line:
                        field, _, value = line.partition(": ")
                        event[field] = value
                        continue
                    if "data" in event:
                        self.events.put(event)
                        seen += 1
                        if seen == 1 and self.stall_s:
                            time.sleep(self.stall_s)
                    event = {}
                    if count is not None and seen >= count:
                        return
        except httpx.ReadTimeout:
            pass
        finally:
            self.opened.set()

    def wait(self, timeout_s: float = 60.0) -> list[dict]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the subscriber did not end"
        return list(self.events.queue)


def _publish(batch, tenant: str, row: np.ndarray, stream: str, transport: str = "http") -> int:
    """One inference of ``digits`` v1 published to ``stream``; the label it answered."""
    module, url = (httpclient, batch.suite.http_url) if transport == "http" else (grpcclient, batch.suite.grpc_url)
    client = module.InferenceServerClient(url)
    try:
        inputs = [module.InferInput("input", [1, 64], "FP32")]
        inputs[0].set_data_from_numpy(row.reshape(1, 64).astype(np.float32))
        result = client.infer("digits", inputs, model_version="1", parameters={"publish": stream},
                              headers=batch.headers(tenant))  # fmt: skip
        return int(result.as_numpy("label").reshape(-1)[0])
    finally:
        client.close()


def _wait_entries(batch, tenant: str, stream: str, at_least: int, timeout_s: float = 30.0) -> None:
    """Publication is asynchronous: wait until Redis holds the entries."""
    client = redis.Redis.from_url(batch.redis_url)
    deadline = time.monotonic() + timeout_s
    while client.xlen(f"aiworks:stream:{tenant}:{stream}") < at_least:
        assert time.monotonic() < deadline, f"stream {stream} never reached {at_least} entries"
        time.sleep(0.02)
    client.close()


def _labels(events: list[dict]) -> list[int]:
    return [orjson.loads(e["data"])["outputs"][0]["data"][0] for e in events]


def _gateway_metric(batch, name: str) -> float:
    port = batch.suite.supervisor.child("gateway").metrics_port
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0


def test_results_published_over_http_and_grpc_arrive_over_sse_and_resume_after_last_event_id(batch_suite):
    rows = _digits(7)
    labels = [_publish(batch_suite, "alice", rows[0], "line-1")]
    _wait_entries(batch_suite, "alice", "line-1", 1)
    url = f"{batch_suite.base}/v2/streams/line-1"
    live = Subscriber(url + "?from=0", batch_suite.headers("alice"), count=7)
    assert live.status == 200
    for i, row in enumerate(rows[1:]):
        labels.append(_publish(batch_suite, "alice", row, "line-1", "grpc" if i % 2 else "http"))
    events = live.wait()
    assert _labels(events) == labels
    ids = [e["id"] for e in events]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-")))) and len(set(ids)) == 7
    record = orjson.loads(events[0]["data"])
    assert record["model"] == "digits" and record["version"] == "1" and record["time"] > 0
    assert {o["name"] for o in record["outputs"]} == {"label", "probabilities"}
    # What EventSource sends when it reconnects: the stream continues after that event.
    resumed = Subscriber(url, {**batch_suite.headers("alice"), "last-event-id": ids[3]}, count=3).wait()
    assert [e["id"] for e in resumed] == ids[4:]
    assert [e["id"] for e in Subscriber(f"{url}?from={ids[5]}", batch_suite.headers("alice"), count=1).wait()] == [
        ids[6]
    ]


def test_only_the_owning_tenant_reads_its_stream_and_bad_names_are_refused_naming_them(batch_suite):
    _publish(batch_suite, "alice", _digits(1)[0], "private")
    _wait_entries(batch_suite, "alice", "private", 1)
    url = f"{batch_suite.base}/v2/streams/private"
    assert Subscriber(url, batch_suite.headers("bob")).status == 404
    assert requests.get(url, timeout=10).status_code == 401
    reply = requests.get(f"{batch_suite.base}/v2/streams/no%20good", headers=batch_suite.headers("alice"), timeout=10)
    assert reply.status_code == 400 and "'no good'" in reply.json()["error"]
    reply = requests.get(f"{url}?from=yesterday", headers=batch_suite.headers("alice"), timeout=10)
    assert reply.status_code == 400 and "'yesterday'" in reply.json()["error"]
    for transport in ("http", "grpc"):
        with pytest.raises(InferenceServerException, match="stream name 'no/good' is not valid"):
            _publish(batch_suite, "alice", _digits(1)[0], "no/good", transport)


def test_one_tenant_holds_at_most_its_share_of_the_subscriber_slots(batch_suite):
    """carol's tenants entry allows her two subscribers on a gateway: a third is 429 naming the bound (so she
    cannot take every slot from the others), alice still subscribes, and a slot carol gives back is hers again."""
    from contextlib import ExitStack

    for tenant in ("carol", "alice"):
        _publish(batch_suite, tenant, _digits(1)[0], "share")
        _wait_entries(batch_suite, tenant, "share", 1)
    url = f"{batch_suite.base}/v2/streams/share"
    carol, alice = batch_suite.headers("carol"), batch_suite.headers("alice")
    with httpx.Client(timeout=10) as client:
        with ExitStack() as held:
            for _ in range(2):
                assert held.enter_context(client.stream("GET", url, headers=carol)).status_code == 200
            refused = client.get(url, headers=carol)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
            assert "tenant 'carol' already holds 2 subscriptions" in refused.json()["error"]
            with client.stream("GET", url, headers=alice) as other:
                assert other.status_code == 200, "another tenant is not refused"
        deadline = time.monotonic() + 15
        while True:  # the gateway frees a slot once it sees the connection gone (its next read or heartbeat)
            with client.stream("GET", url, headers=carol) as again:
                if again.status_code == 200:
                    break
                assert again.status_code == 429 and time.monotonic() < deadline
            time.sleep(0.2)


def test_subscribers_of_one_group_share_the_stream_and_acknowledge_it(batch_suite):
    _publish(batch_suite, "alice", _digits(1)[0], "shared")
    _wait_entries(batch_suite, "alice", "shared", 1)
    url = f"{batch_suite.base}/v2/streams/shared?group=twins"
    members = [Subscriber(url, batch_suite.headers("alice"), idle_s=4.0) for _ in range(2)]
    assert [m.status for m in members] == [200, 200]
    for row in _digits(20):
        _publish(batch_suite, "alice", row, "shared")
    got = [m.wait() for m in members]
    ids = [e["id"] for events in got for e in events]
    assert len(ids) == 20 and len(set(ids)) == 20  # every new entry once, none twice
    assert all(got), "both members of the group were served"
    pending = redis.Redis.from_url(batch_suite.redis_url).xpending("aiworks:stream:alice:shared", "twins")
    assert pending["pending"] == 0


def test_a_rule_on_the_stream_appends_an_event_for_each_matching_result(batch_suite):
    rows = _digits(40)
    labels = [_publish(batch_suite, "carol", row, "twin") for row in rows]
    assert 3 in labels
    _wait_entries(batch_suite, "carol", "twin", 40)
    expected = labels.count(3)
    alerts = Subscriber(f"{batch_suite.base}/v2/streams/alerts?from=0", batch_suite.headers("carol"),
                        count=expected, idle_s=5.0).wait()  # fmt: skip
    events = [orjson.loads(e["data"]) for e in alerts]
    assert len(events) == expected and all(e["value"] == 3 and e["output"] == "label" for e in events)
    assert all(e["stream"] == "twin" and e["model"] == "digits" for e in events)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) * 1024


def test_a_subscriber_that_does_not_read_is_dropped_without_memory_growth(batch_suite):
    store = redis.Redis.from_url(batch_suite.redis_url)
    key = "aiworks:stream:alice:firehose"
    store.xadd(key, {"r": b"{}"})
    pid = batch_suite.suite.supervisor.child("gateway").process.pid
    rss_before = _rss_bytes(pid)
    dropped_before = _gateway_metric(batch_suite, 'aiworks_stream_subscribers_dropped_total{reason="slow"}')
    host, port = batch_suite.suite.http_url.split(":")
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that never reads
    client.connect((host, int(port)))
    auth = batch_suite.headers("alice")["authorization"]
    client.sendall(f"GET /v2/streams/firehose HTTP/1.1\r\nhost: x\r\nauthorization: {auth}\r\n\r\n".encode())
    time.sleep(0.5)
    record = orjson.dumps({"pad": "x" * 32_000})
    for _ in range(20):  # 1,000 entries of 32 kB: 32 MB, far more than the socket holds
        pipe = store.pipeline()
        for _ in range(50):
            pipe.xadd(key, {"r": record})
        pipe.execute()
    deadline = time.monotonic() + 30
    metric = 'aiworks_stream_subscribers_dropped_total{reason="slow"}'
    while _gateway_metric(batch_suite, metric) <= dropped_before or _gateway_metric(
        batch_suite, "aiworks_stream_subscribers"
    ):
        assert time.monotonic() < deadline, "the slow subscriber was never dropped"
        time.sleep(0.2)
    # The gateway aborted the connection: reading now reaches its end (or a reset) soon.
    client.settimeout(10)
    with pytest.raises(ConnectionResetError):
        while client.recv(1 << 16):
            pass
        raise ConnectionResetError  # an orderly end is fine too
    client.close()
    grown = _rss_bytes(pid) - rss_before
    assert grown < 64 << 20, f"the gateway grew {grown} bytes serving one slow subscriber"
    store.delete(key)
    store.close()
