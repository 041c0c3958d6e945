"""Fixtures of the tenancy tests: a private redis-server, tenants files, JWT keys, and tiny model specs.

The redis-server is our own, on a free port, without persistence (as in
``tests/cache``); the system's Redis is never touched. It can be killed and
started again on the same port, as a crashed and restarted Redis would be.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from aiworks.core.model_config import ModelSpec, TensorSpec
from aiworks.supervisor.supervisor import free_port


class RedisServer:
    """One redis-server process on a port of its own: start, kill, start again on the same port."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed; run scripts/ensure-debian-packages.sh")
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "redis.log", "ab") as log:
            self.process = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.workdir)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.workdir / 'redis.log'}")
            if self.ping():
                return
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """Die at once, as a crashed Redis does."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


@pytest.fixture
def redis_server(tmp_path):
    """A fresh private redis-server for one test (limits tests kill and restart it)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


# ---- configs -----------------------------------------------------------------------------------------


@pytest.fixture
def write_yaml(tmp_path):
    def write(name: str, document) -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    return write


# ---- model specs -------------------------------------------------------------------------------------


@pytest.fixture
def scale_spec() -> ModelSpec:
    """x: FP32[-1, 4] -> y: FP32[-1, 4]; rejects NaN/Inf."""
    return ModelSpec(
        name="scale",
        version="1",
        max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (4,)),),
        outputs=(TensorSpec("y", "FP32", (4,)),),
        parameters={"reject_nonfinite": "true"},
    )


@pytest.fixture
def echo_spec() -> ModelSpec:
    """text: BYTES[-1, 1] -> echo: BYTES[-1, 1]; masks e-mail addresses and phone numbers."""
    return ModelSpec(
        name="echo",
        version="1",
        max_batch_size=8,
        inputs=(TensorSpec("text", "BYTES", (1,)),),
        outputs=(TensorSpec("echo", "BYTES", (1,)),),
        parameters={"mask_patterns": "email,phone,id_card"},
    )
