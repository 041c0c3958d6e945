"""`aiworks up` as a user runs it: ready, usable from scripts, and clean on Ctrl-C or SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from aiworks.supervisor.supervisor import free_port


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_up(model_repository, tmp_path, *extra: str) -> tuple[subprocess.Popen, str]:
    """``aiworks up`` on free ports with one replica, as a user starts it, once its gateway answers ready."""
    http_port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "aiworks", "up", *extra,
            "--http-port", str(http_port), "--grpc-port", str(free_port()),
            "--scheduler-port", "0", "--runtime-base-port", "0", "--replicas", "1",
            "--control-port", "0", "--metrics-base-port", "0",
            "--model-repository", str(model_repository), "--log-dir", str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 90
    ready = False
    while time.monotonic() < deadline and not ready and proc.poll() is None:
        try:
            ready = requests.get(f"{url}/v2/health/ready", timeout=1).status_code == 200
        except requests.ConnectionError:
            time.sleep(0.2)
    if not ready:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"the suite never became ready:\n{out[-3000:]}")
    return proc, url


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_up_starts_serves_and_stops_without_orphans(model_repository, tmp_path, sig):
    proc, _ = start_up(model_repository, tmp_path, "--monitor-port", "0")
    try:
        kids = children_of(proc.pid)
        cmdlines = [Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ").decode() for k in kids]
        assert sorted(c.split()[3] for c in cmdlines) == ["cache", "gateway", "monitor", "runtime", "scheduler"]
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "AIWorks is ready" in out and "stopped." in out
    assert "monitor:" in out and "control API:" in out
    assert (tmp_path / "logs" / "gateway.log").read_text()
    assert not [k for k in kids if alive(k)], "orphan processes left behind"


def test_up_with_the_tiers_runs_a_batch_job_and_an_async_request(model_repository, tmp_path, redis_url):
    """`aiworks up --tiers`: the Batch API, asynchronous requests, a runner and a worker, used from the CLI
    and curl-like HTTP as a user would; without --redis-url it refuses to start and says why."""
    refused = subprocess.run(
        [sys.executable, "-m", "aiworks", "up", "--tiers", "--model-repository", str(model_repository),
         "--log-dir", str(tmp_path / "nologs")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 1 and "--redis-url" in refused.stderr
    proc, url = start_up(model_repository, tmp_path, "--tiers", "--redis-url", redis_url, "--no-monitor")
    try:

        def tiers() -> list[str]:  # started once the gateway is ready, so a moment after it answers
            found = []
            for k in children_of(proc.pid):
                try:
                    c = Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ").decode().split()
                except OSError:
                    continue
                if c[3] in ("batch", "nearline"):
                    found.append(" ".join(c[3:5]))
            return sorted(found)

        deadline = time.monotonic() + 30
        while tiers() != ["batch runner", "nearline worker"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tiers() == ["batch runner", "nearline worker"]
        kids = children_of(proc.pid)
        rows = tmp_path / "in.jsonl"
        rows.write_text("".join(
            json.dumps({"custom_id": f"r{i}", "inputs": [
                {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [float(i % 16)] * 64}]}) + "\n"
            for i in range(30)
        ) + "not json\n")  # fmt: skip
        submit = subprocess.run(
            [sys.executable, "-m", "aiworks", "batch", "submit", str(rows), "-m", "digits", "-u", url,
             "--chunk-size", "10", "--wait", "-o", "json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert submit.returncode == 0, submit.stderr
        job = json.loads(submit.stdout)
        assert job["status"] == "completed", job
        assert job["request_counts"] == {"total": 31, "completed": 30, "failed": 1}, job
        # Where `aiworks status` run from the suite's folder finds the jobs' Redis (tests/unit/test_cli.py reads it).
        noted = tmp_path / "tiers-redis-url"
        assert noted.read_text().strip() == redis_url and noted.stat().st_mode & 0o777 == 0o600
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [3.0] * 64}]}
        queued = requests.post(f"{url}/v2/models/digits/infer", json=body, headers={"Prefer": "respond-async"})
        assert queued.status_code == 202, queued.text
        deadline, answer = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            answer = requests.get(f"{url}{queued.headers['location']}", timeout=5)
            if answer.status_code == 200 and answer.json().get("outputs"):
                break
            time.sleep(0.2)
        assert answer is not None and answer.json()["outputs"][0]["name"] == "label", answer.text
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "tiers:" in out and "batch-runner.log" in out
    assert not [k for k in kids if alive(k)], "orphan processes left behind"
