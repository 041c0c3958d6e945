"""The suite's Prometheus metrics: one catalogue, one exposition helper.

Every metric any service exports is declared here, so the dashboards
(``deploy/grafana``), the recording and alert rules (``deploy/prometheus``)
and the monitor read one list of names. Naming follows Prometheus'
conventions: one ``aiworks_`` prefix, then the service, base units in the
name (``_seconds``, ``_bytes``, ``_ratio``), ``_total`` on counters.

Metrics live in prometheus-client's default registry. Declaring a labelled
metric exports nothing until a label set is used, so a process only shows
the series of the service it runs. Gauges that describe a service's state
(queue depth, replica health) are not updated on the request path: a
collector registered at start reads them when Prometheus scrapes.

Labels:
- ``model``, ``version``: the model version that served (resolved, never empty
  once known; ``""`` when the request failed before resolution).
- ``tenant``: the authenticated tenant, ``""`` when tenancy is off.
- ``protocol``: ``http`` or ``grpc`` (gateway).
- ``status``: ``ok`` or the lower-case name of the error's status in
  :mod:`aiworks.core.errors` (``invalid_argument``, ``unavailable``, ...).
- ``priority``: ``realtime``, ``standard`` or ``batch``.
- ``replica``: a runtime replica's id.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import (
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    gc_collector,
    platform_collector,
    process_collector,
    start_http_server,
)

log = logging.getLogger(__name__)

# Sub-millisecond to multi-second: 50 us ... 30 s, roughly 1-2.5-5 per decade.
LATENCY_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# ---- every service: event-loop responsiveness (aiworks.core.looplag) ------------------------

LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
EVENT_LOOP_LAG = Histogram(
    "aiworks_event_loop_lag_seconds",
    "How late the service's event loop ran a timer that was due: the time anything else waited for it.",
    ["service"],
    buckets=LOOP_LAG_BUCKETS_S,
)
EVENT_LOOP_LAG_MAX = Gauge(
    "aiworks_event_loop_lag_max_seconds",
    "The longest event-loop lag seen since the service started.",
    ["service"],
)
EVENT_LOOP_STALL_MAX = Gauge(
    "aiworks_event_loop_stall_max_seconds",
    "The longest event-loop lag since start less the time the loop's thread waited for a CPU (Linux): "
    "the stall the service's own work caused.",
    ["service"],
)

# ---- gateway -------------------------------------------------------------------------------

GATEWAY_REQUESTS = Counter(
    "aiworks_gateway_requests",
    "Inference requests answered by the gateway, by outcome.",
    ["model", "version", "tenant", "protocol", "status"],
)
GATEWAY_REQUEST_DURATION = Histogram(
    "aiworks_gateway_request_duration_seconds",
    "End-to-end latency of an inference request at the gateway (received to answered).",
    ["model", "version", "tenant", "protocol"],
    buckets=LATENCY_BUCKETS_S,
)
GATEWAY_INFLIGHT = Gauge(
    "aiworks_gateway_inflight_requests", "Inference requests the gateway is handling now.", ["protocol"]
)
GATEWAY_STREAM_RESPONSES = Counter(
    "aiworks_gateway_stream_responses",
    "Responses sent on gRPC ModelStreamInfer streams (a decoupled model's several per request, empty finals too).",
    ["model", "version", "tenant"],
)
GATEWAY_FIRST_RESPONSE_DURATION = Histogram(
    "aiworks_gateway_stream_first_response_seconds",
    "Time from receiving a streamed request to sending its first response (a decoupled model's first answer).",
    ["model", "version", "tenant"],
    buckets=LATENCY_BUCKETS_S,
)
GATEWAY_REFUSED = Counter(
    "aiworks_gateway_refused_requests",
    "Requests refused before they reached a handler's work, by reason: unauthenticated (no or bad credentials: "
    "no audit line, no log line each) or header_too_large.",
    ["reason"],
)
GATEWAY_CACHE_LOOKUPS = Counter(
    "aiworks_gateway_cache_lookups",
    "Result-cache lookups of cached models at the gateway, by result: hit, miss, bypass (not asked) or error.",
    ["model", "result"],
)

# ---- tenants (metered usage at the gateway, docs/tenancy.md; tenant "" in demo mode) ---------

TENANT_REQUESTS = Counter(
    "aiworks_tenant_requests", "Inference requests answered, by tenant and model (metered usage).", ["tenant", "model"]
)
TENANT_ROWS = Counter(
    "aiworks_tenant_rows", "Batch rows of answered requests, by tenant and model.", ["tenant", "model"]
)
TENANT_COMPUTE_SECONDS = Counter(
    "aiworks_tenant_compute_seconds",
    "Compute seconds charged to tenants' quotas (scheduler time of answered requests), by tenant and model.",
    ["tenant", "model"],
)
TENANT_CACHE_HITS = Counter(
    "aiworks_tenant_cache_hits", "Requests answered from the result cache, by tenant and model.", ["tenant", "model"]
)
TENANT_TOKENS = Counter(
    "aiworks_tenant_tokens",
    "Tokens metered to tenants, by tenant, model and kind (prompt: a generation's prompt or an embedding's input; "
    "completion: generated tokens).",
    ["tenant", "model", "kind"],
)

# ---- the scheduling stage ----------------------------------------------------------------------
# The names keep the "scheduler" prefix so dashboards and alerts keep working, but queues and batching
# run in the runtime replicas and routing (retries, ejection) in the gateways: each series comes from
# the process that does the work. The scheduler itself exports the replica gauges (its global view).

SCHEDULER_REQUESTS = Counter(
    "aiworks_scheduler_requests",
    "Requests a runtime replica's queue finished, by outcome (exported by the runtimes).",
    ["model", "version", "priority", "status"],
)
SCHEDULER_QUEUE_DURATION = Histogram(
    "aiworks_scheduler_queue_duration_seconds",
    "Time a request waited in its model's queue on a replica before its batch ran (exported by the runtimes).",
    ["model", "version", "priority"],
    buckets=LATENCY_BUCKETS_S,
)
SCHEDULER_BATCH_DURATION = Histogram(
    "aiworks_scheduler_batch_duration_seconds",
    "Time a batch took to run on a replica, from its start to its outputs (exported by the runtimes).",
    ["model", "version"],
    buckets=LATENCY_BUCKETS_S,
)
SCHEDULER_BATCH_SIZE = Histogram(
    "aiworks_scheduler_batch_size_rows",
    "Rows in each batch a replica ran (exported by the runtimes).",
    ["model", "version"],
    buckets=BATCH_SIZE_BUCKETS,
)
SCHEDULER_RETRIES = Counter(
    "aiworks_scheduler_retries",
    "Requests a gateway sent again to another replica after a failure (exported by the gateways).",
    ["model", "version"],
)
SCHEDULER_TIMEOUTS = Counter(
    "aiworks_scheduler_timeouts",
    "Requests answered DEADLINE_EXCEEDED, wherever the deadline passed (exported by the gateways).",
    ["model", "version"],
)
SCHEDULER_REJECTIONS = Counter(
    "aiworks_scheduler_rejections",
    "Requests a replica's queue refused at admission, by reason: queue_full (requests), queue_bytes.",
    ["model", "version", "reason"],
)
SCHEDULER_EJECTIONS = Counter(
    "aiworks_scheduler_ejections",
    "Replica ejections by a gateway's router, by reason: outlier (consecutive errors) or monitor (asked for).",
    ["replica", "reason"],
)
# Read at scrape time by collectors (names only): queue depth and bytes by the runtimes' (where the
# queues are), the replica gauges by the scheduler's (its global view).
SCHEDULER_QUEUE_DEPTH = "aiworks_scheduler_queue_depth_requests"  # {model, version, priority}
SCHEDULER_QUEUE_BYTES = "aiworks_scheduler_queue_bytes"  # {model, version}
SCHEDULER_REPLICA_UP = "aiworks_scheduler_replica_up"  # {replica, device}: 1 live, 0 not
SCHEDULER_REPLICA_EJECTED = "aiworks_scheduler_replica_ejected"  # {replica}: 1 ejected now
SCHEDULER_REPLICA_STOPPING = "aiworks_scheduler_replica_stopping"  # {replica}: 1 draining after its stop signal
SCHEDULER_REPLICA_INFLIGHT = "aiworks_scheduler_replica_inflight_batches"  # {replica}: batches running there
SCHEDULER_REPLICA_LATENCY = "aiworks_scheduler_replica_latency_seconds"  # {replica}: gateways' request average
RUNTIME_INFLIGHT_REQUESTS = "aiworks_runtime_inflight_requests"  # {replica}: requests being served there now
RUNTIME_SEQUENCES = "aiworks_runtime_sequences"  # {replica, model, version, state}: stateful sequences held
# {replica, model, version, outcome}: stateful sequences started, ended, idled, refused (a counter)
RUNTIME_SEQUENCE_OUTCOMES = "aiworks_runtime_sequence_outcomes_total"

# ---- runtime -------------------------------------------------------------------------------

RUNTIME_EXECUTIONS = Counter(
    "aiworks_runtime_executions",
    "Batches a runtime replica executed, by outcome.",
    ["model", "version", "status"],
)
RUNTIME_INFERENCES = Counter(
    "aiworks_runtime_inference_rows", "Rows (inferences) a runtime replica computed.", ["model", "version"]
)
RUNTIME_COMPUTE_DURATION = Histogram(
    "aiworks_runtime_compute_duration_seconds",
    "Compute time of one batch in the backend (inputs ready to outputs ready).",
    ["model", "version"],
    buckets=LATENCY_BUCKETS_S,
)
RUNTIME_INFLIGHT = Gauge(
    "aiworks_runtime_inflight_batches", "Batches this runtime replica is executing now.", ["replica"]
)
# Generation on the llm backend (services/model-runtime/llm_engine.py; docs/generation.md).
RUNTIME_LLM_KV_TOKENS = Gauge(
    "aiworks_runtime_llm_kv_tokens", "KV-cache tokens reserved by running generations, and the budget.",
    ["model", "version", "kind"],  # kind: used, budget
)
RUNTIME_LLM_SEQUENCES = Gauge(
    "aiworks_runtime_llm_sequences", "Generations in the running batch and waiting for KV room.",
    ["model", "version", "state"],  # state: running, waiting
)
RUNTIME_LLM_TOKENS = Counter(
    "aiworks_runtime_llm_tokens", "Tokens processed, by kind (prompt, completion).", ["model", "version", "kind"]
)
RUNTIME_LLM_PROMPT_REUSED = Counter(
    "aiworks_runtime_llm_prompt_tokens_reused",
    "Prompt tokens whose keys and values were copied from another sequence's cache row in the same engine, not read.",
    ["model", "version"],
)
RUNTIME_LLM_TTFT = Histogram(
    "aiworks_runtime_llm_time_to_first_token_seconds", "From a generation's arrival to its first token.",
    ["model", "version"], buckets=LATENCY_BUCKETS_S,
)
RUNTIME_LLM_INTER_TOKEN = Histogram(
    "aiworks_runtime_llm_inter_token_seconds", "Between a generation's consecutive tokens.",
    ["model", "version"], buckets=LATENCY_BUCKETS_S,
)
# Read at scrape time from the backend (Triton's nv_gpu_* metrics), where it reports them.
RUNTIME_GPU_UTILIZATION = "aiworks_runtime_gpu_utilization_ratio"  # {replica, gpu}: 0..1
RUNTIME_GPU_MEMORY_USED = "aiworks_runtime_gpu_memory_used_bytes"  # {replica, gpu}
RUNTIME_GPU_MEMORY_TOTAL = "aiworks_runtime_gpu_memory_total_bytes"  # {replica, gpu}
RUNTIME_MODELS_LOADED = "aiworks_runtime_models_loaded"  # {replica}: ready model versions

# ---- cache ---------------------------------------------------------------------------------
# The cache service's counters are aiworks_cache_<counter>_total (hits, misses, ...), plus:
CACHE_BACKEND_UP = "aiworks_cache_backend_up"  # {store}: 1 when the store answers, 0 while its breaker is open

# ---- batch runner (offline tier, docs/tiers.md) ----------------------------------------------

BATCH_ROWS = Counter(
    "aiworks_batch_rows_total", "Input lines of batch jobs answered by this runner, by outcome.", ["status"]
)  # status: ok (in the output file) or failed (in the error file); rate() is rows/s
BATCH_CHUNKS = Counter("aiworks_batch_chunks_total", "Chunks of batch jobs recorded by this runner.")
BATCH_JOBS_FINISHED = Counter(
    "aiworks_batch_jobs_finished_total", "Batch jobs this runner ended, by final status.", ["status"]
)
BATCH_JOB_PAUSES = Counter(
    "aiworks_batch_job_pauses_total", "Times this runner paused a batch job because its store could not be reached."
)  # each pause is logged with the store's error; the job resumes on a later poll
BATCH_JOB_PROGRESS = "aiworks_batch_job_progress_ratio"  # {job, tenant}: lines done / lines, jobs not yet ended
BATCH_JOBS_ACTIVE = "aiworks_batch_jobs_active"  # {status}: jobs not yet ended, read from Redis at scrape
BATCH_IN_FLIGHT_LIMIT = "aiworks_batch_in_flight_limit"  # requests a runner may have in flight now (its AIMD limit)

# ---- nearline worker (asynchronous requests, docs/tiers.md) ---------------------------------

NEARLINE_REQUESTS = Counter(
    "aiworks_nearline_requests_total", "Asynchronous requests answered by this worker, by outcome.", ["status"]
)  # status: completed (200), failed (any other answer stored as the result), expired (taken after its deadline)
NEARLINE_CALLBACKS = Counter(
    "aiworks_nearline_callbacks_total", "Results posted to callback URLs, by outcome.", ["status"]
)  # status: delivered (2xx) or failed (after the retries)
NEARLINE_WAIT = Histogram(
    "aiworks_nearline_queue_wait_seconds", "Time an asynchronous request waited in the queue.",
    buckets=LATENCY_BUCKETS_S,
)
NEARLINE_BACKLOG = Gauge(
    "aiworks_nearline_backlog", "Asynchronous requests queued and not yet answered, every tenant's."
)
NEARLINE_OLDEST_AGE = Gauge(
    "aiworks_nearline_oldest_age_seconds", "Age of the oldest request this worker took, at its last take."
)

# ---- result streams (gateway, docs/tiers.md) -------------------------------------------------

STREAM_PUBLISHED = Counter("aiworks_stream_published_total", "Result records appended to result streams.")
STREAM_PUBLISH_DROPPED = Counter(
    "aiworks_stream_publish_dropped_total", "Result records not published, by reason.", ["reason"]
)  # reason: queue_full (the publisher's queue), redis_error, error
STREAM_RULE_EVENTS = Counter("aiworks_stream_rule_events_total", "Events appended by stream rules that matched.")
STREAM_SUBSCRIBERS = Gauge("aiworks_stream_subscribers", "Subscribers connected to result streams (SSE and gRPC).")
STREAM_EVENTS_SENT = Counter("aiworks_stream_events_sent_total", "Stream entries written to subscribers.")
STREAM_SUBSCRIBERS_DROPPED = Counter(
    "aiworks_stream_subscribers_dropped_total", "Subscribers disconnected by the gateway, by reason.", ["reason"]
)  # reason: slow (the socket backed up), error
STREAM_SUBSCRIBER_PAUSES = Counter(
    "aiworks_stream_subscriber_pauses_total",
    "Sends to a subscriber of a 'pause' stream that waited stream_send_timeout_s or more (reading stopped meanwhile).",
)
STREAM_GAPS = Counter("aiworks_stream_gaps_total", "Gap events: entries trimmed before a subscriber read them.")

# ---- the credential key ring (gateway, batch runner, nearline worker; docs/tiers.md) --------

CREDENTIAL_KEYS = Gauge(
    "aiworks_credential_key_info",
    "The credential key ids this process holds (1 each): role current seals and mints, previous only opens.",
    ["key_id", "role"],
)  # set at start-up and on every change of the key file (aiworks.security.keyring.KeyFileWatch)
INTERNAL_TOKEN_KEYS = Gauge(
    "aiworks_internal_token_info",
    "The internal token secrets this process holds (1 each, by id): role current is presented, previous only "
    "accepted.",
    ["key_id", "role"],
)  # set at start-up and on every change of the internal token file (aiworks.security.keyring.KeyFileWatch)

TLS_CERT_EXPIRY = Gauge(
    "aiworks_tls_certificate_expiry_timestamp_seconds",
    "When the TLS certificate this process presents expires (POSIX seconds), by its common name; follows a renewed "
    "certificate once the process has taken it.",
    ["common_name"],
)  # set at start-up and on every change of the files (aiworks.security.cert_watch)

# ---- monitor -------------------------------------------------------------------------------

MONITOR_HEALTH_SCORE = "aiworks_monitor_replica_health_score"  # {replica}: 0..100
MONITOR_ACTIONS = "aiworks_monitor_actions_total"  # {action, reason}
MONITOR_ANOMALIES = "aiworks_monitor_anomalies_total"  # {kind, replica}
MONITOR_REPLICAS = "aiworks_monitor_runtime_replicas"  # desired and running runtime replicas {state}


def status_label(error: BaseException | None) -> str:
    """``ok``, or the lower-case status name of an AIWorks error (``internal`` for anything else).

    A cancelled call (the caller went away) is ``unavailable``, as the error
    table maps gRPC's CANCELLED.
    """
    if error is None:
        return "ok"
    status = getattr(error, "status", None)
    if status is not None:
        return status.name.lower()
    return "unavailable" if isinstance(error, asyncio.CancelledError) else "internal"


class Children:
    """The label children of one metric, cached by label values.

    ``metric.labels(...)`` takes a lock and validates its arguments on every
    call; on the request path a dict lookup does. ``max_size`` bounds the
    cache (not the metric's series: callers keep label values bounded).
    """

    __slots__ = ("_metric", "_cache", "_max_size")

    def __init__(self, metric, max_size: int = 4096):
        self._metric = metric
        self._cache: dict[tuple, object] = {}
        self._max_size = max_size

    def __call__(self, *values: str):
        child = self._cache.get(values)
        if child is None:
            if len(self._cache) >= self._max_size:
                self._cache.clear()
            child = self._cache[values] = self._metric.labels(*values)
        return child


T = TypeVar("T")


def on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], T], timeout_s: float = 2.0) -> Callable[[], T]:
    """``read`` made callable from the metrics server's thread: it runs on ``loop``'s thread.

    A service's state belongs to its event loop; iterating its dicts from the
    scrape thread could meet them mid-change. Called on the loop's own thread
    (tests), ``read`` runs directly. Raises TimeoutError if the loop does not
    get to it within ``timeout_s``.
    """

    def call() -> T:
        try:
            if asyncio.get_running_loop() is loop:
                return read()
        except RuntimeError:  # no loop in this thread: the scrape thread
            pass
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(read())
            except BaseException as exc:  # handed to the scrape thread
                done.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return done.result(timeout_s)

    return call


class ScrapeCollector:
    """Base of the collectors that read a service's state when Prometheus scrapes.

    ``describe`` returns nothing, so the default registry does not claim the
    names: two servers of a kind in one process (tests) can both register.
    """

    def describe(self):
        return []

    def register(self) -> ScrapeCollector:
        REGISTRY.register(self)
        return self

    def unregister(self) -> None:
        try:
            REGISTRY.unregister(self)
        except KeyError:
            pass


def standard_process_metrics() -> None:
    """Keep prometheus-client's standard process_*, python_gc_* and python_info collectors registered.

    Their names are the conventions generic dashboards and alerts look for (node
    and process dashboards, `process_resident_memory_bytes`), so they are never
    renamed; the ``job`` and ``instance`` labels tell services apart.
    """
    for collector in (process_collector.PROCESS_COLLECTOR, platform_collector.PLATFORM_COLLECTOR, gc_collector.GC_COLLECTOR):
        try:
            REGISTRY.register(collector)
        except ValueError:  # already registered: the usual case
            pass


def serve_metrics(port: int, host: str = "127.0.0.1"):
    """Serve ``/metrics`` from the default registry on ``host:port`` (0: a free port) in a thread.

    Returns ``(server, port)``; call ``server.shutdown()`` to stop.
    """
    standard_process_metrics()
    server, thread = start_http_server(port, host, registry=REGISTRY)
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return server, bound


def serve_metrics_or_warn(port: int, host: str = "127.0.0.1"):
    """:func:`serve_metrics`, but a port that cannot be bound is a warning, not a failed start.

    Metrics are not on the request path: a taken metrics port (two replicas
    given the same default on one machine) must not stop a service from
    serving inference. Returns ``(server, port)`` or ``(None, None)``.
    """
    try:
        return serve_metrics(port, host)
    except OSError as exc:
        log.warning("no /metrics: cannot listen on %s:%d (%s); set the service's metrics_port", host, port, exc)
        return None, None


async def stop_metrics(server) -> None:
    """Stop a server from :func:`serve_metrics` without blocking the event loop (``None``: nothing to stop)."""
    if server is not None:
        await asyncio.to_thread(server.shutdown)
        server.server_close()
