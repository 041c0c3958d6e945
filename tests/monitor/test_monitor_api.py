"""Events (ring, file), the monitor's HTTP API and `aiworks events`, served on 127.0.0.1 in the test."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from monitor_support import FakeClock, FakeCollector, FakePlatform, make_settings

from aiworks.cli import build_parser
from aiworks.monitor import cli as monitor_cli
from aiworks.monitor.controller import Controller
from aiworks.monitor.events import Event, EventLog
from aiworks.monitor.metrics import MonitorMetrics
from aiworks.monitor.server import create_app


def test_event_log_is_a_bounded_ring_paged_by_id(tmp_path):
    clock = FakeClock(1_700_000_000.0)
    log = EventLog(max_events=3, path=tmp_path / "events" / "monitor.jsonl", wall_clock=clock)
    for i in range(5):
        log.record("restart" if i % 2 == 0 else "anomaly", f"runtime-{i}", "dead", f"event {i}", n=i)
        clock.advance(1.5)
    assert [e.id for e in log.since(0)] == [3, 4, 5]  # the oldest two fell out of the ring
    assert [e.id for e in log.since(3)] == [4, 5]
    assert [e.id for e in log.since(0, limit=2)] == [4, 5]  # from the start: the newest
    assert [e.id for e in log.since(2, limit=2)] == [3, 4]  # after an id: the next ones
    assert [e.id for e in log.since(0, kind="anomaly")] == [4]
    assert log.last_id == 5
    lines = (tmp_path / "events" / "monitor.jsonl").read_text().splitlines()
    assert len(lines) == 5  # the file keeps everything
    first = json.loads(lines[0])
    assert first["time"] == "2023-11-14T22:13:20.000Z" and first["details"] == {"n": 0}
    assert Event.from_json(first) == Event(1, 1_700_000_000.0, "restart", "runtime-0", "dead", "event 0", {"n": 0})


@pytest.fixture
async def api():
    clock = FakeClock(1_700_000_000.0)
    platform, collector = FakePlatform(2), FakeCollector()
    events = EventLog(100, wall_clock=clock)
    metrics = MonitorMetrics()
    controller = Controller(make_settings(), platform, collector, events, clock=clock, metrics=metrics)
    client = TestClient(TestServer(create_app(controller, events, metrics), host="127.0.0.1"))
    await client.start_server()
    client.controller, client.events, client.platform = controller, events, platform
    yield client
    await client.close()


@pytest.mark.loopback
async def test_http_api(api):
    api.platform.kill("runtime-1")
    await api.controller.tick()  # restarts runtime-1: one event
    api.events.record("anomaly", "runtime-0", "latency_spike", "batch latency 90 ms is 4.5x its baseline")

    doc = await (await api.get("/v1/events")).json()
    assert [e["kind"] for e in doc["events"]] == ["restart", "anomaly"] and doc["last_id"] == 2
    restart = doc["events"][0]
    assert restart["target"] == "runtime-1" and restart["reason"] == "dead" and restart["time"].endswith("Z")
    assert set(restart) == {"id", "time", "ts", "kind", "target", "reason", "message", "details"}
    doc = await (await api.get("/v1/events", params={"since": 1})).json()
    assert [e["id"] for e in doc["events"]] == [2] and doc["next"] == 2
    doc = await (await api.get("/v1/events", params={"kind": "restart"})).json()
    assert [e["kind"] for e in doc["events"]] == ["restart"]
    bad = await api.get("/v1/events", params={"since": "yesterday"})
    assert bad.status == 400 and "since" in (await bad.json())["error"]

    replicas = await (await api.get("/v1/replicas")).json()
    assert [r["replica"] for r in replicas["replicas"]] == ["runtime-0", "runtime-1"]
    assert replicas["pools"][0]["pool"] == "runtime" and replicas["platform"] == "fake"

    metrics = await api.get("/metrics")
    text = await metrics.text()
    assert metrics.status == 200 and metrics.content_type == "text/plain"
    assert 'aiworks_monitor_actions_total{action="restart",reason="dead"} 1.0' in text
    assert 'aiworks_monitor_runtime_replicas{state="desired"} 2.0' in text
    assert (await (await api.get("/healthz")).json())["status"] == "ok"


def events_command(url: str, *argv: str, flag: str = "--monitor-address") -> None:
    args = build_parser().parse_args(["events", flag, url, *argv])
    args.func(args)


@pytest.mark.loopback
async def test_aiworks_events_lists_and_follows(api, capsys, monkeypatch):
    url = str(api.make_url("")).rstrip("/")
    api.events.record("restart", "runtime-1", "dead", "runtime-1 exited with code -9; restarted runtime-1 as pid 7")
    await asyncio.to_thread(events_command, url)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "restart" in out[0] and "runtime-1" in out[0] and "exited with code -9" in out[0]

    await asyncio.to_thread(events_command, url, "--json", flag="--monitor")  # the spellings before -o, kept
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line)["message"].startswith("runtime-1 exited")
    await asyncio.to_thread(events_command, url, "-o", "json")
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == [json.loads(line)]
    await asyncio.to_thread(events_command, url, "-o", "yaml")
    assert list(yaml.safe_load_all(capsys.readouterr().out)) == [json.loads(line)]

    # --follow prints what arrives later; the third poll ends it as Ctrl-C would.
    polls = []
    loop = asyncio.get_running_loop()

    def fake_sleep(seconds):
        polls.append(seconds)
        if len(polls) == 1:
            loop.call_soon_threadsafe(
                api.events.record, "scale_out", "runtime", "queue_depth", "runtime: 2 -> 3 replicas"
            )
        if len(polls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(monitor_cli, "_pause", fake_sleep)  # not time.sleep: other threads call that
    await asyncio.to_thread(events_command, url, "--follow", "--kind", "scale_out")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "scale_out" in out[0] and "2 -> 3 replicas" in out[0]


def test_aiworks_events_says_when_the_monitor_is_unreachable(monkeypatch):
    monkeypatch.setattr(monitor_cli, "fetch_events", lambda *a, **k: (_ for _ in ()).throw(OSError("refused")))
    with pytest.raises(SystemExit, match="cannot reach the monitor at http://127.0.0.1:1"):
        events_command("http://127.0.0.1:1")
