"""The nearline worker as the chart and the compose file run it: configured by its environment, calling an
HTTPS gateway whose certificate a private CA signs (AIWORKS_NEARLINE_CA_FILE), serving /metrics where
`aiworks probe nearline-worker` finds it. The gateway is a recording HTTPS server here (the compose test in
tests/deploy/test_images.py runs the real one); the queue is a private redis-server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from aiworks.nearline.queue import AsyncQueue
from aiworks.security.certs import CertificateAuthority, write_leaf


class _Gateway(BaseHTTPRequestHandler):
    """Answers every inference 200 and records what arrived."""

    seen: list[tuple[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - the handler's protocol
        body = self.rfile.read(int(self.headers["content-length"]))
        _Gateway.seen.append((self.path, self.headers.get("authorization", "")))
        answer = json.dumps({"model_name": "iris", "outputs": [], "echo": json.loads(body)}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def https_gateway(tmp_path: Path):
    """An HTTPS server with a certificate for `localhost` from a CA of the test's own; yields (url, ca.crt)."""
    folder = write_leaf(CertificateAuthority.create("test CA"), tmp_path / "gateway", "gateway", ["localhost"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "tls.crt", folder / "tls.key")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    _Gateway.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://localhost:{server.server_address[1]}", folder / "ca.crt"
    server.shutdown()
    server.server_close()


def run(coro):
    return asyncio.run(coro)


async def _enqueue(redis_url: str, credential: str) -> str:
    queue = AsyncQueue.from_url(redis_url)
    try:
        request_id, _ = await queue.enqueue("alice", "/v2/models/iris/infer", b'{"inputs": []}', credential,
                                            deadline_s=60)  # fmt: skip
        return request_id
    finally:
        await queue.close()


async def _record(redis_url: str, request_id: str) -> dict | None:
    queue = AsyncQueue.from_url(redis_url)
    try:
        return await queue.get(request_id)
    finally:
        await queue.close()


def worker(redis_url: str, gateway_url: str, log: Path, **env: str) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AIWORKS_NEARLINE_")}
    environment.update(AIWORKS_NEARLINE_REDIS_URL=redis_url, AIWORKS_NEARLINE_GATEWAY_URL=gateway_url, **env)
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "aiworks", "nearline", "worker"], env=environment,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def wait_answered(redis_url: str, request_id: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = run(_record(redis_url, request_id))
        if record and record.get("status") not in (None, b"queued"):
            return record
        time.sleep(0.2)
    raise AssertionError(f"{request_id} was not answered in {timeout_s} s")


def probe(port: int | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "AIWORKS_NEARLINE_METRICS_PORT"}
    if port is not None:
        env["AIWORKS_NEARLINE_METRICS_PORT"] = str(port)
    return subprocess.run([sys.executable, "-m", "aiworks", "probe", "nearline-worker"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_worker_checks_the_gateway_against_its_ca_and_serves_metrics_for_the_probe(
    redis_url: str, https_gateway: tuple[str, Path], tmp_path: Path
) -> None:
    url, ca = https_gateway
    port = free_port()
    assert probe(port).returncode == 1, "nothing serves there yet"
    process = worker(redis_url, url, tmp_path / "worker.log", AIWORKS_NEARLINE_CA_FILE=str(ca),
                     AIWORKS_NEARLINE_METRICS_PORT=str(port), AIWORKS_NEARLINE_METRICS_HOST="127.0.0.1")  # fmt: skip
    try:
        request_id = run(_enqueue(redis_url, "Bearer alice-key"))
        record = wait_answered(redis_url, request_id)
        assert record["status"] == b"completed", record
        assert _Gateway.seen == [("/v2/models/iris/infer", "Bearer alice-key")], "the caller's own credential"
        deadline = time.monotonic() + 20
        while (done := probe(port)).returncode and time.monotonic() < deadline:
            time.sleep(0.5)
        assert done.returncode == 0, done.stderr
    finally:
        process.terminate()
        process.wait(timeout=30)
    missing = probe(None)
    assert missing.returncode == 1 and "AIWORKS_NEARLINE_METRICS_PORT" in missing.stderr


def test_without_the_ca_the_gateway_is_not_trusted(redis_url: str, https_gateway: tuple[str, Path],
                                                   tmp_path: Path) -> None:  # fmt: skip
    url, _ = https_gateway
    process = worker(redis_url, url, tmp_path / "worker.log")
    try:
        request_id = run(_enqueue(redis_url, "Bearer alice-key"))
        record = wait_answered(redis_url, request_id, timeout_s=90)
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert record["status"] == b"failed", record
    assert _Gateway.seen == [], "no request reached a server the worker could not verify"
