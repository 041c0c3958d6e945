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
from triton_support import IRIS_ROWS

from aiworks.core.errors import Unavailable
from aiworks.core.model_config import read_config
from aiworks.runtime.triton_backend import TritonConnection
from aiworks.runtime.tritonserver import TritonServer


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


def test_a_death_is_noticed_at_once_then_the_server_is_restarted_with_its_models(
    triton_distribution, suite_repository, tmp_path
):
    server = TritonServer(triton_distribution, tmp_path / "models", tmp_path)
    server.start(timeout_s=60)
    conn = TritonConnection(server.grpc_url, server.model_repository, metrics_url=server.metrics_url, server=server,
                            instance_kind="KIND_CPU", restart_backoff_s=0.3)  # fmt: skip
    config = read_config(suite_repository / "iris_triton")
    try:
        conn.acquire(config, 2, suite_repository / "iris_triton" / "2")
        assert conn.healthy() and conn.infer("iris_triton", 2, {"input": IRIS_ROWS}, ["label"])["label"].shape == (3, 1)
        first_pid = server.pid
        os.kill(first_pid, signal.SIGKILL)
        assert wait_until(lambda: not conn.healthy(), 5), "the connection did not notice the death"
        assert conn.recovering()
        with pytest.raises(Unavailable, match=r"tritonserver exited with code -9; restarting") as refused:
            conn.check()
        assert str(first_pid) not in str(refused.value) and str(tmp_path) not in str(refused.value)
        with pytest.raises(Unavailable):
            conn.gpu_metrics()
        assert wait_until(conn.healthy, 30), "tritonserver did not come back"
        assert server.pid != first_pid and server.running and conn.restarts == 1
        assert conn.infer("iris_triton", 2, {"input": IRIS_ROWS}, ["label"])["label"].shape == (3, 1)  # loaded again
    finally:
        conn.close()
    assert (tmp_path / "tritonserver.log").is_file()


def test_a_triton_at_a_url_that_restarts_gets_its_models_back(triton_distribution, suite_repository, tmp_path):
    """The triton_url mode (a Triton container beside the runtime): polled, and models loaded again."""
    first = TritonServer(triton_distribution, tmp_path / "models", tmp_path / "a")
    first.start(timeout_s=60)
    conn = TritonConnection(first.grpc_url, first.model_repository, instance_kind="KIND_CPU", health_interval_s=0.2,
                            recover_give_up_s=30)  # fmt: skip
    second = None
    try:
        conn.acquire(read_config(suite_repository / "iris_triton"), 1, suite_repository / "iris_triton" / "1")
        first.stop()  # as a container restarting would
        assert wait_until(lambda: conn.recovering(), 5)
        second = TritonServer(triton_distribution, tmp_path / "models", tmp_path / "b", grpc_port=first.grpc_port)
        second.start(timeout_s=60)
        assert wait_until(conn.healthy, 30), "the connection did not see Triton come back"
        assert conn.infer("iris_triton", 1, {"input": IRIS_ROWS}, ["label"])["label"].shape == (3, 1)
    finally:
        conn.close()
        if second is not None:
            second.stop()


def test_a_triton_that_stays_away_is_given_up(triton_distribution, tmp_path):
    from aiworks.supervisor.supervisor import free_port

    conn = TritonConnection(f"127.0.0.1:{free_port()}", tmp_path, health_interval_s=0.1, recover_give_up_s=0.5)
    try:
        assert wait_until(lambda: conn.state == "down", 5)
        assert not conn.healthy() and not conn.recovering()
        with pytest.raises(Unavailable, match="not back after"):
            conn.check()
    finally:
        conn.close()


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
