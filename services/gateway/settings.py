"""The gateway's settings (env prefix ``AIWORKS_GATEWAY_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from aiworks.core.settings import ServiceSettings
from aiworks.gateway.filters import (
    DEFAULT_MAX_LISTED_VALUES,
    DEFAULT_MAX_REQUEST_ELEMENTS,
    DEFAULT_MAX_REQUEST_TENSORS,
    DEFAULT_MAX_STRING_ELEMENTS,
    DEFAULT_MAX_TENSOR_ELEMENTS,
)
from aiworks.gateway.masking import DEFAULT_MAX_SCAN_BYTES


class GatewaySettings(ServiceSettings):
    """Settings of one gateway replica."""

    model_config = SettingsConfigDict(env_prefix="AIWORKS_GATEWAY_")

    host: str = Field("127.0.0.1", description="Interface both servers bind.")
    http_port: int = Field(8000, description="Port of the Open Inference Protocol over HTTP.")
    grpc_port: int = Field(8001, description="Port of the Open Inference Protocol over gRPC.")
    metrics_port: int = Field(8002, description="Port of the Prometheus /metrics endpoint; 0 picks a free one.")
    scheduler_address: str = Field(
        ..., description="host:port of the scheduler (required); several, comma-separated, fail over in order."
    )
    max_request_bytes: int = Field(
        32 * 1024 * 1024, description="Largest request body (HTTP) or message (gRPC) accepted, in bytes."
    )
    request_timeout_s: float = Field(
        60.0, description="Longest a request without a deadline of its own waits for its runtime replica."
    )
    server_name: str = Field("aiworks", description="Name reported by server metadata.")
    max_load_file_bytes: int = Field(
        32 << 20,
        ge=0,
        description="Most bytes of model files one load request may bring (Triton's file: load parameters).",
    )
    shared_memory_max_regions: int = Field(
        64, ge=0,
        description="Most system shared memory regions one tenant may register (docs/triton.md); 0: the "
        "extension is off.",
    )  # fmt: skip

    # ---- result cache (docs/cache.md) ----
    cache_address: str | None = Field(
        None, description="host:port of the cache service; unset: every request goes to the scheduler."
    )
    cache_lookup_timeout_s: float = Field(
        0.01, description="A cache lookup slower than this is a miss; the request goes on to the scheduler."
    )
    cache_retry_after_s: float = Field(
        1.0, description="After repeated cache failures, how long the cache is skipped before it is tried again."
    )

    # ---- tenancy (docs/tenancy.md); no tenants file: demo mode, nothing authenticated, no limits ----
    tenants_file: Path | None = Field(
        None, description="Tenants file (YAML or JSON): tenants, their models, limits, JWT settings and deny-list."
    )
    api_keys_file: Path | None = Field(
        None, description="API keys file: SHA-256 hashes of API keys and their tenants (`aiworks tenants add-key`)."
    )
    jwt_key_file: Path | None = Field(
        None, description="Key that verifies bearer JWTs: an HMAC secret or a PEM public key or certificate."
    )
    redis_url: str | None = Field(
        None, description="Redis shared by the gateway replicas for limits and usage; unset: this process's own."
    )
    limits_timeout_s: float = Field(
        0.005, gt=0, description="Bound of one limits call to Redis; slower: this replica enforces its share locally."
    )
    limits_expected_replicas: int = Field(
        1, ge=1, description="Gateway replicas sharing the limits; each enforces 1/N of a limit while Redis is away."
    )
    limits_lease_ttl_s: float = Field(
        30.0, gt=0, description="Life of a concurrency slot not renewed (a crashed replica's slots free themselves)."
    )
    limits_retry_after_s: float = Field(1.0, gt=0, description="How long Redis is left alone after a failed call.")
    usage_window_s: int = Field(3600, ge=1, description="Length of one usage window (the report's granularity).")
    usage_flush_interval_s: float = Field(1.0, gt=0, description="How often this replica adds its usage to Redis.")
    usage_timeout_s: float = Field(0.05, gt=0, description="Bound of one usage flush to Redis.")
    usage_retention_s: float = Field(35 * 86400.0, gt=0, description="How long usage windows are kept in Redis.")
    # ---- input bounds (docs/security.md, "Hostile input"), checked before any tensor data is decoded ----
    max_tensor_elements: int | None = Field(
        DEFAULT_MAX_TENSOR_ELEMENTS, ge=1,
        description="Most elements of one input tensor, zero dims counted as 1 (rule max_tensor_elements); null: none.",
    )  # fmt: skip
    max_request_elements: int | None = Field(
        DEFAULT_MAX_REQUEST_ELEMENTS, ge=1,
        description="Most elements of all the inputs of one request (rule max_request_elements); null: none.",
    )  # fmt: skip
    max_string_elements: int | None = Field(
        DEFAULT_MAX_STRING_ELEMENTS, ge=1,
        description="Most BYTES elements of one request, each a Python object (rule max_string_elements); null: none.",
    )  # fmt: skip
    max_listed_values: int | None = Field(
        DEFAULT_MAX_LISTED_VALUES, ge=1,
        description="Most values one request lists one by one: JSON values of an HTTP body (counted before it is "
        "parsed), elements of gRPC typed contents (rule max_listed_values); binary data is not counted; null: none.",
    )  # fmt: skip
    max_request_tensors: int | None = Field(
        DEFAULT_MAX_REQUEST_TENSORS, ge=1,
        description="Most inputs, and most requested outputs, of one request (rule max_request_tensors); null: none.",
    )  # fmt: skip
    mask_max_scan_bytes: int | None = Field(
        DEFAULT_MAX_SCAN_BYTES, ge=1,
        description="Most bytes of a response's text outputs that masking scans; a response with more is refused "
        "(413) rather than passed on partly unscanned; null: no cap.",
    )  # fmt: skip
    max_header_bytes: int = Field(
        64 * 1024, ge=1024,
        description="Largest HTTP request line and headers, and gRPC metadata, accepted before authentication (431).",
    )  # fmt: skip
    max_string_bytes: int | None = Field(
        None, ge=0, description="Longest BYTES element of an input, in bytes (rule max_string_bytes); unset: none."
    )
    drain_s: float = Field(
        0.0, ge=0, le=300,
        description="On SIGTERM, how long the gateway keeps serving with readiness reporting not ready (HTTP "
        "/v2/health/ready 503, gRPC health NOT_SERVING) before its ports close, so load balancers and "
        "Kubernetes endpoints stop sending it new requests first. A second signal ends the wait. "
        "The chart sets 5 s; 0: close at once (a laptop's Ctrl-C).",
    )  # fmt: skip
    shutdown_grace_s: float = Field(
        5.0, ge=0,
        description="On stop, how long HTTP requests still running (result-stream subscribers and generations "
        "over SSE among them) and gRPC calls get to finish before they are cut, so the gateway exits and "
        "flushes usage and audit lines well within the supervisor's 10 s and Kubernetes' 30 s.",
    )  # fmt: skip

    # ---- Batch API (docs/tiers.md); needs redis_url too ----
    batch_files_url: str | None = Field(
        None, description="Where Batch API uploads and results are written: a folder or s3://bucket/prefix; unset: off."
    )
    batch_chunk_size: int = Field(100, ge=1, le=10_000, description="Input lines per checkpointed chunk of a job.")
    batch_max_file_bytes: int = Field(512 * 1024 * 1024, ge=1, description="Largest file uploaded to /v1/files.")
    batch_max_active_jobs: int = Field(
        10, ge=1, description="Most batch jobs of one tenant not yet ended; a submission over it gets 429."
    )

    credential_key_file: Path | None = Field(
        None, description="The installation's credential key file (a secret of 16+ bytes, shared with the batch "
        "runners and nearline workers): the callers' credentials that wait in Redis with their batch jobs and "
        "asynchronous requests are sealed under it (aiworks.security.sealing). Required with tenants and either "
        "tier on; `aiworks up` and the chart's install hook make one.",
    )  # fmt: skip
    credential_key_reload_s: float = Field(
        10.0, ge=0, description="How often the credential key file is read again: a changed ring (a rotation step) "
        "is taken without a restart, and logged. 0: no periodic re-read (only when a value names a key not held).",
    )  # fmt: skip

    # ---- nearline: asynchronous requests (docs/tiers.md); needs redis_url too ----
    async_requests: bool = Field(
        False, description="Queue `POST …/infer` with `Prefer: respond-async` (202, GET /v2/requests/{id}); off: sync."
    )
    async_result_ttl_s: float = Field(3600.0, gt=0, description="How long an asynchronous request's result is kept.")
    async_deadline_s: float = Field(
        0.5, gt=0, description="The nearline class's deadline: a queued request not taken within it (or within its "
        "own shorter parameters.timeout) is answered 504 without running; the time left travels as its timeout.",
    )  # fmt: skip
    async_max_backlog: int = Field(100_000, ge=1, description="Most queued asynchronous requests; more get 429.")
    async_max_backlog_per_tenant: int = Field(
        25_000, ge=1, description="Most queued asynchronous requests of one tenant, so that one tenant's burst "
        "cannot fill the queue for the others; more get 429. A tenant's max_async_backlog overrides it.",
    )  # fmt: skip

    # ---- result streams for digital twins (docs/tiers.md); needs redis_url too ----
    result_streams: bool = Field(
        False, description="Honour the `publish` request parameter and serve GET /v2/streams/{name} (SSE); off: 400."
    )
    stream_max_len: int = Field(
        10_000, ge=1, description="Entries a result stream keeps, trimmed approximately (MAXLEN ~) at each append."
    )
    stream_max_record_bytes: int = Field(
        64 * 1024, ge=1, description="Largest outputs (raw bytes) a request may publish; more: 413 naming the stream."
    )
    stream_publish_queue: int = Field(
        10_000, ge=1, description="Records waiting to be appended; more are dropped (aiworks_stream_publish_dropped)."
    )
    stream_buffer_events: int = Field(
        100, ge=1, le=10_000, description="Most entries the gateway holds for one subscriber at once (one read)."
    )
    stream_send_timeout_s: float = Field(
        5.0, gt=0, description="Longest one write to a subscriber may wait (its socket backed up) before it is dropped."
    )
    stream_max_subscribers: int = Field(1000, ge=1, description="Most subscribers this replica serves; more get 429.")
    stream_max_subscribers_per_tenant: int = Field(
        250, ge=1, description="Most subscribers of one tenant this replica serves, so that one tenant cannot take "
        "every slot; more get 429. A tenant's max_stream_subscribers overrides it. Not applied in demo mode.",
    )  # fmt: skip
    stream_claim_idle_s: float = Field(
        30.0, gt=0, description="Age of a group's unacknowledged entry before another subscriber of the group takes it."
    )

    # ---- audit log (docs/security.md) ----
    audit_log: Path | None = Field(
        None, description="Hash-chained JSON-lines audit log of inferences and admin actions; unset: no audit log."
    )
    audit_key_file: Path | None = Field(
        None, description="HMAC key of the audit chain (`aiworks audit verify --key-file`); unset: plain SHA-256."
    )
    audit_flush_interval_s: float = Field(
        0.05, gt=0, description="How often audit lines are written and fsynced; a crash loses at most this much."
    )
    audit_sink: Literal["file", "redis"] = Field(
        "file",
        description="Where the audit chain goes: `file` (audit_log, one per replica) or `redis` (one Redis Stream "
        "in redis_url that every replica appends to, a chain per replica; `aiworks audit verify --redis-url`).",
    )
    audit_stream: str = Field("aiworks:audit", min_length=1, description="The Redis Stream's key (audit_sink redis).")
    audit_writer: str | None = Field(
        None, description="This replica's chain name in the stream (audit_sink redis); unset: the hostname (pod name)."
    )
