"""Every dashboard query and every rule works against a real Prometheus scraping a real suite under load.

The suite runs as ``aiworks up`` runs it (scheduler, cache, gateway, monitor,
one runtime), plus a second runtime whose batches hang longer than the
scheduler's per-try timeout, and a Prometheus started by
:class:`aiworks.supervisor.prometheus.PrometheusProcess` on the targets of
``Supervisor.metrics_targets()``. The load makes every path a panel shows
happen for real: hits and misses of the result cache, two model versions,
three priorities, malformed requests and unknown models, requests whose
deadline passes, bursts that overflow a short queue, retries and ejections
of the hanging replica, a replica killed and restarted by the monitor, and
generations of a tiny random-weight ``codegen`` (the Generation dashboard),
and the tiers (the Tiers dashboard): a private redis-server, a real
``aiworks batch runner`` working through one small batch job after another,
a real ``aiworks nearline worker`` answering asynchronous requests, and
results published to a stream that an SSE subscriber reads.

Then each panel query of each committed dashboard, with its template
variables set to real values read from Prometheus as Grafana would, must
return a number, and each recording rule must have series.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import requests
from cache.support import RedisServer
from onnx import TensorProto, helper

from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from aiworks.supervisor.prometheus import PrometheusProcess
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

from .support import PrometheusAPI, has_data, load_dashboards, panel_queries, rules, variables

MODEL = "scale"
LLM = "codegen"
SLOW_REPLICA = "runtime-slow"

# Settings that make the rare events of the failure panels happen within seconds.
SUITE_ENV = {
    # A burst of concurrent requests overflows a queue this short: rejections, 429s.
    "AIWORKS_RUNTIME_MAX_QUEUE_REQUESTS": "4",  # per replica: the queues are in the runtimes
    # The slow replica's batches outlast the per-try timeout: retries, then outlier ejections.
    "AIWORKS_SCHEDULER_RUNTIME_TIMEOUT_S": "0.5",
    "AIWORKS_SCHEDULER_OUTLIER_CONSECUTIVE_ERRORS": "2",
    "AIWORKS_SCHEDULER_OUTLIER_BASE_EJECTION_S": "2",
    # The monitor restarts what dies but does not rescale two CPUs' worth of suite under the test.
    "AIWORKS_MONITOR_AUTOSCALE": "false",
    # A loaded 2-core machine can miss the 10 ms production lookup budget; hits must still be hits.
    "AIWORKS_GATEWAY_CACHE_LOOKUP_TIMEOUT_S": "0.5",
}
SLOW_REPLICA_ENV = {"AIWORKS_RUNTIME_DEBUG_DELAY_MS": "1500"}

# The tiers (docs/tiers.md), on a private Redis given at start: the Batch API's files, asynchronous
# requests (a deadline long enough for a loaded machine) and result streams.
TIERS_ENV = {
    "AIWORKS_GATEWAY_ASYNC_REQUESTS": "true",
    "AIWORKS_GATEWAY_ASYNC_DEADLINE_S": "30",
    "AIWORKS_GATEWAY_RESULT_STREAMS": "true",
}
STREAM = "twin"

# What Grafana puts for $__rate_interval with a 1 s scrape interval is 4 s; a little more keeps
# quantiles of bursty histograms defined between two polls.
RATE_INTERVAL = "10s"
DEADLINE_S = 60.0

# Panels allowed to stay empty, and why. Only metrics a CPU-only machine cannot produce belong here:
# the GPU figures come from Triton's nv_gpu_* metrics of a runtime driving a GPU. They are checked
# like every other panel wherever any GPU series exists.
NEEDS_A_GPU = {
    ("aiworks-overview", "GPU utilisation"),
    ("aiworks-overview", "GPU memory"),
}
GPU_SERIES = "aiworks_runtime_gpu_memory_total_bytes"


# ---- the model repository ----------------------------------------------------------------------


def write_repository(root: Path) -> Path:
    """``scale`` (y = x * k, x: float[N, 4]) in versions 1 and 2, batched, with the result cache on."""
    for version, factor in ((1, 2.0), (2, 3.0)):
        graph = helper.make_graph(
            [helper.make_node("Mul", ["x", "k"], ["y"])],
            MODEL,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
            initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [factor])],
        )
        (root / MODEL / str(version)).mkdir(parents=True)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.save(model, root / MODEL / str(version) / "model.onnx")
    (root / MODEL / "config.pbtxt").write_text(
        "max_batch_size: 8\n"
        "version_policy: { all { } }\n"
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        "dynamic_batching { }\n"
        "response_cache { enable: true }\n"
    )
    from aiworks.lifecycle.llm import LlmSpec, build

    tiny = LlmSpec(layers=2, heads=2, dim=64, context=256, vocab=1024, corpus_mb=0.5, random=True)
    build(root, tiny, cache_dir=None, progress=False, kv_budget_tokens=2048, max_sequences=16)  # codegen: seconds
    from aiworks.demo.qa_streaming import build_qa_streaming_models

    build_qa_streaming_models(root, ["accumulator"])  # a stateful model: the twins' sequences
    return root


# ---- load --------------------------------------------------------------------------------------


@dataclass
class Load:
    """Mixed traffic on the suite from a thread of its own until stopped; counts outcomes by status."""

    grpc_url: str
    http_url: str
    kill_slow_replica: Callable[[], None]
    outcomes: Counter = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=asyncio.run, args=(self._drive(),), name="load", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30)

    async def _drive(self) -> None:
        import tritonclient.grpc.aio as grpcclient

        client = grpcclient.InferenceServerClient(self.grpc_url)
        rng = np.random.default_rng(7)
        repeated = [rng.random((1, 4), dtype=np.float32) for _ in range(3)]

        async def infer(x: np.ndarray, model: str = MODEL, **kwargs) -> None:
            request = grpcclient.InferInput("x", list(x.shape), "FP32")
            request.set_data_from_numpy(x)
            try:
                await client.infer(model, [request], client_timeout=30, **kwargs)
                self.outcomes["ok"] += 1
            except grpcclient.InferenceServerException as exc:
                self.outcomes[exc.status() or "error"] += 1

        async def steady(worker: int) -> None:
            """New inputs (cache misses) on both versions and all three priorities."""
            i = 0
            while not self.stop.is_set():
                i += 1
                x = rng.random((1 + i % 3, 4), dtype=np.float32)
                await infer(x, model_version=("", "1")[i % 2], priority=1 + (i + worker) % 3)
                await asyncio.sleep(0.01)

        async def repeats() -> None:
            """The same few inputs again and again: result-cache hits."""
            i = 0
            while not self.stop.is_set():
                i += 1
                await infer(repeated[i % len(repeated)])
                await asyncio.sleep(0.02)

        async def faults() -> None:
            """A malformed request, an unknown model and one whose deadline (1 us) passes at once."""
            while not self.stop.is_set():
                await infer(rng.random((1, 5), dtype=np.float32))
                await infer(rng.random((1, 4), dtype=np.float32), model="no-such-model")
                await infer(rng.random((1, 4), dtype=np.float32), timeout=1)
                await asyncio.sleep(0.2)

        async def bursts() -> None:
            """Many requests at once: more than the queue holds."""
            while not self.stop.is_set():
                await asyncio.gather(*(infer(rng.random((2, 4), dtype=np.float32)) for _ in range(24)))
                await asyncio.sleep(1.0)

        async def generations() -> None:
            """Generations one after another through Triton's generate extension: the Generation dashboard."""
            import httpx

            async with httpx.AsyncClient(base_url=f"http://{self.http_url}", timeout=30) as http:
                i = 0
                while not self.stop.is_set():
                    i += 1
                    body = {"text_input": "def f" * (1 + i % 4), "max_tokens": 8 + i % 16, "ignore_eos": True}
                    try:
                        r = await http.post(f"/v2/models/{LLM}/generate", json=body)
                        self.outcomes["generate ok" if r.status_code == 200 else f"generate {r.status_code}"] += 1
                    except httpx.HTTPError as exc:
                        self.outcomes[f"generate {type(exc).__name__}"] += 1
                    await asyncio.sleep(0.05)

        async def kill_once() -> None:
            """SIGKILL the slow replica after a few seconds: the monitor restarts it (its action panel)."""
            await asyncio.sleep(4.0)
            self.kill_slow_replica()

        try:
            await asyncio.gather(
                steady(0), steady(1), steady(2), repeats(), faults(), bursts(), generations(), kill_once()
            )
        finally:
            await client.close()


@dataclass
class TierLoad:
    """The tiers at work from threads of their own until stopped: batch jobs one after another (a runner
    answers them), asynchronous requests (a nearline worker answers them), results published to a
    stream while an SSE subscriber reads it, and twins' sequences of a stateful model."""

    base: str  # the gateway's http://host:port
    outcomes: Counter = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for work in (self._jobs, self._requests, self._subscribe, self._sequences):
            thread = threading.Thread(target=self._guarded, args=(work,), name=work.__name__, daemon=True)
            thread.start()
            self.threads.append(thread)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)

    def _guarded(self, work: Callable[[], None]) -> None:
        while not self.stop.is_set():
            try:
                work()
            except (requests.RequestException, httpx.HTTPError) as exc:  # counted; the panels show what is missing
                self.outcomes[f"{work.__name__} {type(exc).__name__}"] += 1
                self.stop.wait(0.5)

    @staticmethod
    def _body(rng: np.random.Generator) -> dict:
        return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": rng.random(4).tolist()}]}

    def _jobs(self) -> None:
        """A 400-line job on ``scale``, then wait for its end: progress, rows/s, chunks and jobs ended."""
        rng = np.random.default_rng(11)
        lines = b"".join(json.dumps({"custom_id": f"row-{i}", **self._body(rng)}).encode() + b"\n" for i in range(400))
        uploaded = requests.post(f"{self.base}/v1/files", data={"purpose": "batch"},
                                 files={"file": ("input.jsonl", lines, "application/jsonl")}, timeout=30)  # fmt: skip
        uploaded.raise_for_status()
        body = {"input_file_id": uploaded.json()["id"], "endpoint": f"/v2/models/{MODEL}/infer",
                "completion_window": "24h"}  # fmt: skip
        job = requests.post(f"{self.base}/v1/batches", json=body, timeout=30)
        job.raise_for_status()
        while not self.stop.wait(0.5):
            status = requests.get(f"{self.base}/v1/batches/{job.json()['id']}", timeout=10).json()["status"]
            if status in ("completed", "failed", "expired", "cancelled"):
                self.outcomes[f"job {status}"] += 1
                return

    def _requests(self) -> None:
        """Asynchronous requests (202, answered by the worker) and synchronous ones published to the stream."""
        rng = np.random.default_rng(13)
        with requests.Session() as http:
            while not self.stop.wait(0.2):
                queued = http.post(f"{self.base}/v2/models/{MODEL}/infer", json=self._body(rng),
                                   headers={"prefer": "respond-async"}, timeout=10)  # fmt: skip
                self.outcomes[f"async {queued.status_code}"] += 1
                published = http.post(f"{self.base}/v2/models/{MODEL}/infer",
                                      json={**self._body(rng), "parameters": {"publish": STREAM}}, timeout=10)  # fmt: skip
                self.outcomes[f"publish {published.status_code}"] += 1

    def _sequences(self) -> None:
        """A twin's sequence on the ``accumulator``: a start, two more readings, an end."""
        self.outcomes["sequence"] += 1
        sequence = self.outcomes["sequence"]
        with requests.Session() as http:
            for flags in ({"sequence_start": True}, {}, {}, {"sequence_end": True}):
                body = {"inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}],
                        "parameters": {"sequence_id": sequence, **flags}}  # fmt: skip
                reply = http.post(f"{self.base}/v2/models/accumulator/infer", json=body, timeout=10)
                self.outcomes[f"sequence {reply.status_code}"] += 1
                if self.stop.wait(0.2):
                    return

    def _subscribe(self) -> None:
        """An SSE subscriber of the stream, reconnecting every few seconds: subscribers and events sent."""
        url = f"{self.base}/v2/streams/{STREAM}"
        with httpx.stream("GET", url, timeout=httpx.Timeout(10.0, read=5.0)) as reply:
            self.outcomes[f"subscribe {reply.status_code}"] += 1
            if reply.status_code != 200:
                self.stop.wait(1.0)
                return
            for line in reply.iter_lines():
                if line.startswith("data"):
                    self.outcomes["event"] += 1
                if self.stop.is_set():
                    return


class TierProcess:
    """One ``aiworks batch runner`` or ``aiworks nearline worker`` process serving /metrics on ``metrics_port``."""

    def __init__(self, argv: list[str], log_path: Path):
        self.metrics_port = free_port()
        command = [sys.executable, "-m", "aiworks", *argv, "--metrics-port", str(self.metrics_port)]
        env = {**os.environ, "AIWORKS_BATCH_POLL_INTERVAL_S": "0.2"}
        with log_path.open("ab") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# ---- the suite, Prometheus and the load ---------------------------------------------------------


@dataclass
class Observed:
    supervisor: Supervisor
    prometheus: PrometheusProcess
    api: PrometheusAPI
    load: Load
    tiers: TierLoad
    started_s: float  # wall-clock time the load began


def _wait_registered(supervisor: Supervisor, replica_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    with supervisor.caller_channel(supervisor.scheduler_address, "scheduler") as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        while time.monotonic() < deadline:
            replicas = stub.Status(scheduler_pb2.StatusRequest(), timeout=5).replicas
            if any(r.replica_id == replica_id and r.live and r.models for r in replicas):
                return
            time.sleep(0.2)
    raise RuntimeError(f"{replica_id} did not register within {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def observed(prometheus_binaries, tmp_path_factory) -> Iterator[Observed]:
    work = tmp_path_factory.mktemp("observed")
    redis = RedisServer(work / "redis")
    redis.start()
    tiers_env = {
        **TIERS_ENV,
        "AIWORKS_GATEWAY_REDIS_URL": redis.url,
        "AIWORKS_GATEWAY_BATCH_FILES_URL": str(work / "files"),
    }
    config = SuiteConfig.on_free_ports(
        model_repository=write_repository(work / "models"),
        replicas=1,
        log_dir=work / "logs",
        log_level="WARNING",
        monitor=True,
        extra_env={**SUITE_ENV, **tiers_env},
    )
    supervisor = Supervisor(config)
    prometheus = None
    load = None
    tiers = TierLoad(f"http://127.0.0.1:{config.http_port}")
    processes: list[TierProcess] = []
    try:
        supervisor.start()
        supervisor.start_runtime(SLOW_REPLICA, models=[MODEL], env=SLOW_REPLICA_ENV)
        _wait_registered(supervisor, SLOW_REPLICA)
        common = ["--redis-url", redis.url, "--gateway-url", tiers.base]
        runner = TierProcess(["batch", "runner", *common], work / "logs" / "batch-runner.log")
        processes.append(runner)
        worker = TierProcess(["nearline", "worker", *common], work / "logs" / "nearline-worker.log")
        processes.append(worker)
        targets = {**supervisor.metrics_targets(), "batch": [runner.target], "nearline": [worker.target]}
        prometheus = PrometheusProcess(targets, free_port(), work / "prometheus", work / "logs" / "prometheus.log")
        prometheus.start()

        def kill_slow_replica() -> None:
            os.kill(supervisor.child(SLOW_REPLICA).process.pid, signal.SIGKILL)

        load = Load(f"127.0.0.1:{config.grpc_port}", f"127.0.0.1:{config.http_port}", kill_slow_replica)
        started_s = time.time()
        load.start()
        tiers.start()
        yield Observed(supervisor, prometheus, PrometheusAPI(prometheus.url), load, tiers, started_s)
    finally:
        tiers.close()
        if load is not None:
            load.close()
        for process in processes:
            process.stop()
        if prometheus is not None:
            prometheus.stop()
        supervisor.stop()
        redis.stop()


# ---- template variables, as Grafana resolves them -----------------------------------------------

_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")
_VARIABLE = re.compile(r"\$(\w+)")
_REGEX_SPECIAL = re.compile(r"([.+*?()\[\]{}|^$\\])")


def substitute(expr: str, values: dict[str, str]) -> str:
    return _VARIABLE.sub(lambda m: values.get(m.group(1), m.group(0)), expr)


def resolve_variables(api: PrometheusAPI, board: dict, start_s: float, end_s: float) -> dict[str, str]:
    """A real value for each variable: the one with the most series (the busiest model, version...).

    Variables are resolved in order, each query seeing the values before it,
    as Grafana chains them. A variable with no value at all (no tenant while
    tenancy is off) takes its "All" value.
    """
    values = {"__rate_interval": RATE_INTERVAL}
    for variable in variables(board):
        if variable["type"] == "datasource":
            continue  # the Prometheus this test queries
        match = _LABEL_VALUES.match(variable["query"])
        assert match, f"{board['uid']}: unsupported variable query {variable['query']}"
        selector, label = substitute(match["selector"], values), match["label"]
        counts = Counter(s[label] for s in api.series(selector, start_s, end_s) if s.get(label))
        if counts:
            busiest = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
            values[variable["name"]] = _REGEX_SPECIAL.sub(r"\\\1", busiest)
        else:
            values[variable["name"]] = variable["allValue"]
    return values


def wait_for_data(
    observed: Observed, make_queries: Callable[[], dict[str, str]], may_be_empty: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Poll named queries until each returns a number or the deadline passes; returns those still empty.

    ``make_queries`` runs every round, so template variables are resolved
    again as more series appear. Queries in ``may_be_empty`` are polled but
    neither waited for nor returned.
    """
    done: set[str] = set()
    deadline = time.monotonic() + DEADLINE_S
    while True:
        time.sleep(1.0)
        queries = make_queries()
        now = time.time()
        for name, expr in queries.items():
            if name not in done and has_data(observed.api.query_range(expr, observed.started_s, now)):
                done.add(name)
        waiting = set(queries) - done - may_be_empty
        if not waiting or time.monotonic() > deadline:
            return {name: queries[name] for name in sorted(waiting)}


# ---- the tests ---------------------------------------------------------------------------------


def test_every_panel_query_of_every_dashboard_returns_data(observed):
    boards = load_dashboards()
    has_gpu = bool(observed.api.query(GPU_SERIES))
    may_be_empty = frozenset(
        str(query)
        for board in boards.values()
        for query in panel_queries(board)
        if (query.dashboard, query.panel) in NEEDS_A_GPU and not has_gpu
    )

    def queries() -> dict[str, str]:
        resolved = {}
        for board in boards.values():
            values = resolve_variables(observed.api, board, observed.started_s, time.time())
            resolved |= {str(query): substitute(query.expr, values) for query in panel_queries(board)}
        return resolved

    empty = wait_for_data(observed, queries, may_be_empty)
    assert not empty, (
        f"{len(empty)} panel queries returned no data (load outcomes {dict(observed.load.outcomes)}, "
        f"tiers {dict(observed.tiers.outcomes)}):\n"
        + "\n".join(f"- {name}\n    ran as: {expr}" for name, expr in empty.items())
    )


def test_the_tiers_did_real_work(observed):
    """The Tiers panels had data because each tier worked: a job ended, requests were queued and published,
    and the subscriber read events (the counts also show in the panel test's failure message)."""
    deadline = time.monotonic() + DEADLINE_S
    wanted = ("job completed", "async 202", "publish 200", "subscribe 200", "event")
    while not all(observed.tiers.outcomes[name] for name in wanted) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(observed.tiers.outcomes[name] for name in wanted), dict(observed.tiers.outcomes)
    answered = observed.api.query('sum(aiworks_nearline_requests_total{status="completed"})')
    assert answered and float(answered[0]["value"][1]) > 0, "the nearline worker answered nothing"


def test_every_recording_rule_has_series_and_every_rule_evaluates(observed):
    recorded = {rule["record"]: rule["record"] for rule in rules("record")}
    empty = wait_for_data(observed, lambda: recorded)
    assert not empty, f"recording rules without series: {sorted(empty)}"
    broken = [
        f"{rule['name']}: {rule.get('lastError')}"
        for group in observed.api.rule_groups()
        for rule in group["rules"]
        if rule["health"] != "ok"
    ]
    assert not broken, broken
    assert {rule["name"] for group in observed.api.rule_groups() for rule in group["rules"]} == {
        rule.get("record") or rule.get("alert") for rule in rules("record") + rules("alert")
    }


def test_prometheus_scrapes_every_kind_of_service(observed):
    kinds = {"gateway", "scheduler", "runtime", "cache", "monitor", "batch", "nearline"}
    deadline = time.monotonic() + 30
    while True:  # Prometheus applies new scrape targets every 5 s
        targets = observed.api.targets()
        jobs = {target["labels"]["job"] for target in targets}
        if jobs >= {f"aiworks-{kind}" for kind in kinds} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert jobs == {f"aiworks-{kind}" for kind in kinds}
    assert all(t["labels"]["service"] == t["labels"]["job"].removeprefix("aiworks-") for t in targets)
    runtimes = [t for t in targets if t["labels"]["service"] == "runtime"]
    assert len(runtimes) == 2, runtimes  # runtime-0 and the slow replica
