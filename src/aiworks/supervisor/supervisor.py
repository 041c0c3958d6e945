"""``aiworks up``: start the suite as local processes, wait until it is ready, stop it cleanly.

Each service is its own OS process whose command line names it
(``python -m aiworks runtime --replica-id runtime-0 ...``), writing its log to
a file of its own. Children run in their own sessions, so a terminal's Ctrl-C
reaches only the supervisor, which then stops them in order (gateway first,
scheduler last). Children also get PR_SET_PDEATHSIG, so even a SIGKILLed
supervisor leaves no orphans.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from aiworks.core.lifecycle import die_with_parent
from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

_GRPC_HOLD: grpc.Channel | None = None


def _hold_grpc_initialized() -> None:
    """Keep one gRPC channel open for the rest of this process.

    Closing the last channel makes gRPC shut down on a thread of its own, and
    a fork during that shutdown (each child is forked) hangs forever in gRPC's
    pre-fork handler; it showed once the cache's readiness check was added
    right before the gateway's fork. With a channel always open, gRPC never
    shuts down. The channel is never used.
    """
    global _GRPC_HOLD
    if _GRPC_HOLD is None:
        _GRPC_HOLD = grpc.insecure_channel("127.0.0.1:9")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class SuiteConfig:
    """What ``aiworks up`` starts, and where."""

    model_repository: Path = Path("model-repository")
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    scheduler_port: int = 8010
    runtime_base_port: int = 8020
    replicas: int = 2
    batching: bool = True
    log_dir: Path = Path(".aiworks/logs")
    log_level: str = "INFO"
    ready_timeout_s: float = 120.0
    extra_env: dict[str, str] = field(default_factory=dict)
    # The result cache (docs/cache.md): started unless cache is False, with the
    # in-process store, or Redis when redis_url is given; cache_port 0 picks a free one.
    cache: bool = True
    redis_url: str | None = None
    cache_port: int = 0


    @classmethod
    def on_free_ports(cls, **fields) -> SuiteConfig:
        """A config whose every port is free on this machine (tests, benchmarks, side-by-side suites)."""
        return cls(http_port=free_port(), grpc_port=free_port(), scheduler_port=0, runtime_base_port=0, **fields)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen | None = None


class Supervisor:
    """Starts, watches and stops the suite's processes."""

    def __init__(self, config: SuiteConfig):
        _hold_grpc_initialized()
        self.config = config
        self.children: list[Child] = []
        if config.scheduler_port == 0:
            config.scheduler_port = free_port(config.host)
        self.scheduler_address = f"{config.host}:{config.scheduler_port}"
        self.cache_address: str | None = None
        if config.cache:
            if config.cache_port == 0:
                config.cache_port = free_port(config.host)
            self.cache_address = f"{config.host}:{config.cache_port}"

    # ---- start ---------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name, [sys.executable, "-m", "aiworks", *args], self.config.log_dir / f"{name}.log")
        env = {**os.environ, **self.config.extra_env, **(env or {}), "PYTHONUNBUFFERED": "1"}
        with open(child.log_path, "ab") as logfile:
            child.process = subprocess.Popen(
                child.argv,
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        log.info("started %s (pid %d), log %s", name, child.process.pid, child.log_path)
        self.children.append(child)
        return child

    def start(self) -> None:
        c = self.config
        level = ["--log-level", c.log_level]
        scheduler = ["scheduler", "--host", c.host, "--port", str(c.scheduler_port), *level]
        if not c.batching:
            scheduler.append("--no-batching")
        self._spawn("scheduler", scheduler)
        if self.cache_address:  # starts alongside the scheduler; the gateway needs it
            cache = ["cache", "--host", c.host, "--port", str(c.cache_port), "--metrics-port", "0", *level]
            if c.redis_url:
                cache += ["--redis-url", c.redis_url]
            self._spawn("cache", cache)
        self._wait(lambda: self._grpc_serving(self.scheduler_address), "scheduler")
        for i in range(c.replicas):
            port = c.runtime_base_port + i if c.runtime_base_port else 0
            self._spawn(
                f"runtime-{i}",
                [
                    "runtime",
                    "--replica-id", f"runtime-{i}",
                    "--host", c.host,
                    "--port", str(port),
                    "--scheduler-address", self.scheduler_address,
                    "--model-repository", str(c.model_repository),
                    *level,
                ],
            )  # fmt: skip
        self._wait(lambda: self._live_replicas() >= c.replicas, f"{c.replicas} runtime replica(s)")
        gateway_env = {}
        if self.cache_address:
            self._wait(lambda: self._grpc_serving(self.cache_address), "cache")
            gateway_env["AIWORKS_GATEWAY_CACHE_ADDRESS"] = self.cache_address
        self._spawn(
            "gateway",
            [
                "gateway",
                "--host", c.host,
                "--http-port", str(c.http_port),
                "--grpc-port", str(c.grpc_port),
                "--scheduler-address", self.scheduler_address,
                *level,
            ],
            env=gateway_env,
        )  # fmt: skip
        self._wait(lambda: self._http_ready(), "gateway")

    def _wait(self, check, what: str) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while time.monotonic() < deadline:
            for child in self.children:
                if child.process.poll() is not None:
                    tail = child.log_path.read_text(errors="replace").splitlines()[-15:]
                    raise RuntimeError(
                        f"{child.name} exited with code {child.process.returncode} while waiting for {what}; "
                        f"last lines of {child.log_path}:\n" + "\n".join(tail)
                    )
            try:
                if check():
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"timed out after {self.config.ready_timeout_s:.0f} s waiting for {what}")

    def _grpc_serving(self, address: str) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _live_replicas(self) -> int:
        with grpc.insecure_channel(self.scheduler_address) as ch:
            reply = scheduler_pb2_grpc.SchedulerServiceStub(ch).Status(scheduler_pb2.StatusRequest(), timeout=1)
            return sum(1 for r in reply.replicas if r.live and r.models)

    def _http_ready(self) -> bool:
        url = f"http://{self.config.host}:{self.config.http_port}/v2/health/ready"
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200

    # ---- run and stop --------------------------------------------------------------------

    def watch(self, stop_requested) -> None:
        """Block until ``stop_requested()``; report children that exit on their own."""
        reported = set()
        while not stop_requested():
            for child in self.children:
                code = child.process.poll()
                if code is not None and child.name not in reported:
                    reported.add(child.name)
                    log.error("%s exited with code %s; see %s", child.name, code, child.log_path)
            time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the children in reverse start order, then SIGKILL whatever is left."""
        for child in reversed(self.children):
            if child.process and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
                try:
                    child.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", child.name, timeout_s)
                    child.process.kill()
                    child.process.wait()
                log.info("stopped %s", child.name)
