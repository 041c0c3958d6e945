"""Fixtures of the tier tests: a private redis-server, and the suite with tenants, the Batch API and async requests.

The redis-server is our own, on a free port, without persistence (as in
tests/cache). The suite is the one the e2e tests start (scheduler, runtimes,
gateway), with a tenants file (and a stream rule per tenant), API keys, Redis,
a batch file store, asynchronous requests and result streams. Batch
runners are real processes (``aiworks batch runner``), started per test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml
from cache.support import RedisServer
from e2e.e2e_support import Suite, start_suite

from aiworks.gateway.auth import generate_api_key
from aiworks.security.callers import ensure_secret_file

TENANTS = ("alice", "bob", "carol")
CALLBACK_SECRET = "test-callback-secret-not-a-real-one"


@dataclass
class BatchSuite:
    suite: Suite
    redis_url: str
    keys: dict[str, str]
    work: Path

    @property
    def base(self) -> str:
        return self.suite.base

    @property
    def credential_key(self) -> Path:
        """The credential key file the gateway seals callers' credentials under (runners and workers get it)."""
        return self.work / "credential-key"

    def headers(self, tenant: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[tenant]}"}


class Runner:
    """One ``aiworks batch runner`` process."""

    def __init__(self, batch: BatchSuite, name: str, env: dict[str, str] | None = None, lease_ttl_s: float = 2.0,
                 args: tuple[str, ...] = ()):  # fmt: skip
        self.log = batch.work / f"{name}.log"
        command = [
            sys.executable, "-m", "aiworks", "batch", "runner", "--redis-url", batch.redis_url,
            "--gateway-url", batch.base, "--lease-ttl-s", str(lease_ttl_s), *args,
        ]  # fmt: skip
        full_env = {**os.environ, "AIWORKS_BATCH_POLL_INTERVAL_S": "0.1",
                    "AIWORKS_BATCH_CREDENTIAL_KEY_FILE": str(batch.credential_key),
                    "AIWORKS_BATCH_CREDENTIAL_KEY_RELOAD_S": "0.2", **(env or {})}  # fmt: skip
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, env=full_env, stdout=out, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="package")
def batch_suite(model_repository, tmp_path_factory):
    work = tmp_path_factory.mktemp("batch")
    redis = RedisServer(work / "redis")  # its URL is known now; it starts below, where it is always stopped
    keys, tenants = {}, []
    (work / "callback-secret").write_text(CALLBACK_SECRET + "\n")
    ensure_secret_file(work / "credential-key")
    for tenant in TENANTS:
        keys[tenant], digest = generate_api_key()
        tenants.append({"id": tenant, "models": ["digits", "iris"], "api_keys": [digest], "stream_rules": [
            # Result streams (test_streams.py): a digit read as 3 on stream "twin" raises an event on "alerts";
            # stream "patient" pauses a slow subscriber instead of dropping it (test_streams_grpc.py).
            {"stream": "twin", "output": "label", "index": 0, "op": "==", "value": 3, "event_stream": "alerts"},
        ], "stream_policies": {"patient": "pause"}})  # fmt: skip
    # Asynchronous requests' callbacks (test_nearline_more.py): alice may name this machine, bob no host at all.
    tenants[0]["callbacks"] = {"hosts": ["127.0.0.1"], "secret_file": str(work / "callback-secret")}
    # carol may hold two result-stream subscribers per gateway (test_streams.py) and have three asynchronous
    # requests queued (test_nearline.py), whatever the others do.
    tenants[2]["max_stream_subscribers"] = 2
    tenants[2]["max_async_backlog"] = 3
    # JWTs too (HS256, the key in work/jwt-key): a job submitted with a short-lived one outlives it
    # (test_sealed_credentials.py).
    (work / "jwt-key").write_text("jwt-hs256-secret-of-the-tier-tests-0123456789\n")
    jwt_settings = {"algorithms": ["HS256"], "issuer": "tier-tests", "audience": "aiworks", "leeway_s": 0}
    tenants_file = work / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump({"tenants": tenants, "jwt": jwt_settings}, sort_keys=False))
    env = {
        "AIWORKS_GATEWAY_TENANTS_FILE": str(tenants_file),
        "AIWORKS_GATEWAY_REDIS_URL": redis.url,
        "AIWORKS_GATEWAY_BATCH_FILES_URL": str(work / "files"),
        "AIWORKS_GATEWAY_ASYNC_REQUESTS": "true",
        "AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE": str(work / "credential-key"),
        "AIWORKS_GATEWAY_CREDENTIAL_KEY_RELOAD_S": "0.2",  # a rotation step taken without a restart, soon
        "AIWORKS_GATEWAY_JWT_KEY_FILE": str(work / "jwt-key"),
        # Long, for the burst tests; test_nearline_more.py shortens it per request with parameters.timeout.
        "AIWORKS_GATEWAY_ASYNC_DEADLINE_S": "120",
        "AIWORKS_GATEWAY_RESULT_STREAMS": "true",
        "AIWORKS_GATEWAY_STREAM_SEND_TIMEOUT_S": "1.0",
        "AIWORKS_GATEWAY_STREAM_BUFFER_EVENTS": "50",
        "AIWORKS_GATEWAY_LIMITS_TIMEOUT_S": "0.5",
        "AIWORKS_GATEWAY_USAGE_TIMEOUT_S": "1.0",
        "AIWORKS_GATEWAY_USAGE_FLUSH_INTERVAL_S": "0.1",
    }
    redis.start()
    try:  # a suite that fails to start must not leave its redis-server behind
        suite = start_suite(model_repository, work / "logs", replicas=1, cache=False, extra_env=env)
        try:
            yield BatchSuite(suite, redis.url, keys, work)
        finally:
            suite.supervisor.stop()
    finally:
        redis.stop()


class Worker:
    """One ``aiworks nearline worker`` process."""

    def __init__(self, batch: BatchSuite, name: str, *args: str):
        self.log = batch.work / f"{name}.log"
        command = [sys.executable, "-m", "aiworks", "nearline", "worker", "--redis-url", batch.redis_url,
                   "--gateway-url", batch.base, "--tenants-file", str(batch.work / "tenants.yaml"),
                   "--credential-key-file", str(batch.credential_key), "--credential-key-reload-s", "0.2",
                   *args]  # fmt: skip
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    kill = Runner.kill
    stop = Runner.stop


@pytest.fixture
def workers(batch_suite):
    """Start nearline workers with ``workers(name, *args)``; all stopped after the test."""
    started: list[Worker] = []

    def start(name: str = "worker", *args: str) -> Worker:
        worker = Worker(batch_suite, f"{name}-{len(started)}", *args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def runners(batch_suite):
    """Start runners with ``runners(name)``; all stopped after the test."""
    started: list[Runner] = []

    def start(name: str = "runner", **kwargs) -> Runner:
        runner = Runner(batch_suite, f"{name}-{len(started)}", **kwargs)
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.stop()


def wait_batch(batch: BatchSuite, tenant: str, batch_id: str, until, timeout_s: float = 120.0) -> dict:
    """Poll ``GET /v1/batches/{id}`` until ``until(doc)``."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = requests.get(f"{batch.base}/v1/batches/{batch_id}", headers=batch.headers(tenant), timeout=10)
        assert reply.status_code == 200, reply.text
        doc = reply.json()
        if until(doc):
            return doc
        assert doc["status"] not in ("failed", "expired"), doc
        assert time.monotonic() < deadline, f"batch {batch_id} stuck: {doc}"
        time.sleep(0.05)


async def serve_infer(handler) -> tuple[object, str]:
    """An aiohttp server standing in for the gateway: ``handler`` answers ``POST /v2/models/digits/infer``.
    Returns the app runner (``await runner.cleanup()`` stops it) and the server's base URL."""
    from aiohttp import web

    from aiworks.supervisor.supervisor import free_port

    app = web.Application()
    app.router.add_post("/v2/models/digits/infer", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"
