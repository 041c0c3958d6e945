"""TritonServer, the runtime's supervisor of a local tritonserver: start, notice death, stop, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from aiworks.runtime.triton_backend import TritonConnection
from aiworks.runtime.tritonserver import TritonServer

from aiworks.core.errors import Unavailable


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_death_is_noticed_and_answered_with_unavailable(triton_distribution, tmp_path):
    server = TritonServer(triton_distribution, tmp_path / "models", tmp_path)
    server.start(timeout_s=60)
    conn = TritonConnection(server.grpc_url, server.model_repository, metrics_url=server.metrics_url, server=server)
    try:
        assert server.running and conn.healthy()
        conn.check()
        os.kill(server.pid, signal.SIGKILL)
        assert wait_until(lambda: server.exit_code is not None), "the supervisor did not notice the death"
        assert not server.running and not conn.healthy()
        with pytest.raises(Unavailable, match=r"tritonserver exited with code -9"):
            conn.check()
        with pytest.raises(Unavailable):
            conn.gpu_metrics()
    finally:
        conn.close()
    assert (tmp_path / "tritonserver.log").is_file()


def test_stop_ends_the_server_and_a_dead_parent_leaves_no_orphan(triton_distribution, tmp_path):
    # A process that starts a tritonserver, prints its pid, and is then SIGKILLed.
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from aiworks.runtime.tritonserver import TritonDistribution, TritonServer
        work = Path({str(tmp_path)!r})
        server = TritonServer(TritonDistribution.find(), work / "models", work)
        server.start(timeout_s=60)
        print(server.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        triton_pid = int(parent.stdout.readline())
        assert not gone(triton_pid)
        parent.kill()
        parent.wait()
        assert wait_until(lambda: gone(triton_pid)), "tritonserver outlived the process that started it"
    finally:
        parent.kill()
        parent.stdout.close()


def test_stop_is_clean_and_idempotent(triton_distribution, tmp_path):
    server = TritonServer(triton_distribution, tmp_path / "models", tmp_path)
    server.start(timeout_s=60)
    pid = server.pid
    server.stop()
    assert server.exit_code == 0 and gone(pid)
    server.stop()
