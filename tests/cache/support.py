"""Helpers of the cache tests: a private redis-server, tiny models, and the suite with its cache."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from aiworks.pb.cache.v1 import cache_pb2, cache_pb2_grpc
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

# ---- a private redis-server ------------------------------------------------------------------


class RedisServer:
    """One redis-server process on a port of its own: start, stop, kill, start again."""

    def __init__(self, workdir: Path, port: int | None = None):
        self.workdir = workdir
        self.port = port or free_port()
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
                [
                    binary,
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", str(self.workdir),
                    "--maxmemory", "64mb",
                    "--maxmemory-policy", "volatile-lru",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
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

    def _end(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """Die at once, as a crashed Redis does."""
        self._end(signal.SIGKILL)

    def pause(self) -> None:
        """Stop answering without closing connections, as a hung Redis does."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)


# ---- tiny models -----------------------------------------------------------------------------

# These tests watch the cache through the response's cache_hit, which clients see only when the model opts in.
CACHED = 'response_cache { enable: true }\nparameters { key: "report_cache_hit" value: { string_value: "true" } }\n'


def write_scale(folder: Path, factor: float) -> None:
    """y = x * factor, x: float[N, 4]."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [factor])],
    )
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "model.onnx")


def write_echo(folder: Path) -> None:
    """echo = text, text: string[N, 1]."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["echo"])],
        "echo",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["N", 1])],
        [helper.make_tensor_value_info("echo", TensorProto.STRING, ["N", 1])],
    )
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "model.onnx")


def params(**values) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in values.items())


SCALE_IO = (
    'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
)


def write_config(folder: Path, text: str) -> None:
    (folder / "config.pbtxt").write_text(f"max_batch_size: 8\ndynamic_batching {{ }}\n{text}")


def build_repository(root: Path) -> Path:
    """Models for every cache behaviour; all preloaded but ``lazy``."""
    models = {
        "scale": (2.0, CACHED + params(preload="true")),
        "scale_similar": (2.0, CACHED + params(preload="true", cache_mode="similar", cache_round_decimals="2")),
        "scale_ttl": (2.0, CACHED + params(preload="true", cache_ttl_s="1")),
        "versioned": (2.0, CACHED + params(preload="true")),
        "plain": (2.0, params(preload="true")),
        "lazy": (2.0, CACHED),
    }
    for name, (factor, extra) in models.items():
        write_scale(root / name / "1", factor)
        write_config(root / name, SCALE_IO + extra)
    write_echo(root / "echo" / "1")
    write_config(
        root / "echo",
        'input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'output [ { name: "echo" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        + CACHED
        + params(preload="true", cache_mode="similar"),
    )
    return root


# ---- the suite with its cache ----------------------------------------------------------------

# Generous timeouts: on a shared 2-core machine a lookup can take more than the
# production 10 ms, and these tests are about behaviour, not that budget.
TEST_ENV = {
    "AIWORKS_GATEWAY_CACHE_LOOKUP_TIMEOUT_S": "0.5",
    "AIWORKS_CACHE_STORE_TIMEOUT_S": "0.25",
    "AIWORKS_CACHE_RETRY_AFTER_S": "0.2",
}


@dataclass
class CachedSuite:
    supervisor: Supervisor
    http_url: str
    grpc_url: str
    repository: Path
    first_request_s: float  # client-side latency of the suite's very first request (to "scale")

    def cache_stats(self) -> cache_pb2.StatsResponse:
        with self.supervisor.caller_channel(self.supervisor.cache_address, "cache") as ch:
            return cache_pb2_grpc.CacheServiceStub(ch).Stats(cache_pb2.StatsRequest(), timeout=5)


def start_cached_suite(repository: Path, log_dir: Path, **overrides) -> CachedSuite:
    import numpy as np
    import tritonclient.http as httpclient

    config = SuiteConfig.on_free_ports(
        model_repository=repository,
        replicas=1,
        log_dir=log_dir,
        extra_env=dict(TEST_ENV),
        **overrides,
    )
    supervisor = Supervisor(config)
    try:
        supervisor.start()
    except Exception:
        supervisor.stop()
        raise
    http_url = f"127.0.0.1:{config.http_port}"
    client = httpclient.InferenceServerClient(http_url)
    x = httpclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    started = time.perf_counter()
    client.infer("scale", [x])
    first = time.perf_counter() - started
    client.close()
    return CachedSuite(supervisor, http_url, f"127.0.0.1:{config.grpc_port}", repository, first)
