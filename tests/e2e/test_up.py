"""`aiworks up` as a user runs it: ready, usable from scripts, and clean on Ctrl-C or SIGTERM."""

from __future__ import annotations

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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_up_starts_serves_and_stops_without_orphans(model_repository, tmp_path, sig):
    http_port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "aiworks", "up",
            "--http-port", str(http_port), "--grpc-port", str(free_port()),
            "--scheduler-port", "0", "--runtime-base-port", "0", "--replicas", "1",
            "--monitor-port", "0", "--control-port", "0", "--metrics-base-port", "0",
            "--model-repository", str(model_repository), "--log-dir", str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        ready = False
        while time.monotonic() < deadline and not ready:
            try:
                ready = requests.get(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1).status_code == 200
            except requests.ConnectionError:
                time.sleep(0.2)
        assert ready, "the suite never became ready"
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
