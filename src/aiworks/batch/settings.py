"""Settings of the batch job runner (env prefix ``AIWORKS_BATCH_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class BatchSettings(BaseSettings):
    """One batch runner: where the jobs are (Redis), where it sends them (the gateway), and how hard."""

    model_config = SettingsConfigDict(env_prefix="AIWORKS_BATCH_")

    redis_url: str = Field(..., description="Redis holding the jobs, their chunks and checkpoints (required).")
    gateway_url: str = Field(..., description="Base URL of the gateway's HTTP API (http://host:port), required.")
    concurrency: int = Field(
        16, ge=1, description="Most requests in flight at once (the adaptive limit's ceiling when adaptive is on)."
    )
    pack_rows: int = Field(
        32, ge=1,
        description="Most rows per request: neighbouring lines that differ only in their rows travel as one request "
        "along the batch dimension, for a model whose max_batch_size allows it (aiworks.batch.packing); 1: one line "
        "per request.",
    )  # fmt: skip
    pack_rows_online: int = Field(
        32, ge=1,
        description="Most rows per request while online traffic is about (the pacer has cut its limit under half "
        "its ceiling); at most pack_rows. The pause under min_in_flight is what keeps these few requests light.",
    )  # fmt: skip
    min_in_flight: float = Field(
        0.25, gt=0,
        description="The least the adaptive limit goes down to while online traffic is about. Under 1: one request "
        "at a time, then a pause of (1/limit - 1) x its latency (0.25: the job holds the suite a quarter of the "
        "time); 1: one request always in flight, as before.",
    )  # fmt: skip
    nice: int = Field(
        19, ge=0, le=19,
        description="The runner's CPU niceness (Linux nice, 0-19; 19: the least CPU weight). A job fills idle "
        "capacity: where the runner shares cores with the gateway, runtime or load it serves (one machine, "
        "`aiworks up`), the kernel gives them the CPU first while the runner reads chunks and writes results. "
        "0: as started. Across containers the pod's CPU request and limit decide instead.",
    )  # fmt: skip
    adaptive: bool = Field(
        True,
        description="Pace requests in flight by AIMD on the latency and 429/503 answers seen (aiworks.batch.pacing); "
        "false keeps concurrency in flight always.",
    )
    latency_tolerance: float = Field(
        2.0, gt=1, description="Back off when the smoothed request latency exceeds this many times the lowest seen."
    )
    backoff_factor: float = Field(
        0.5, gt=0, lt=1, description="What a back-off multiplies the limit of requests in flight by (never under min_in_flight)."
    )
    turn_s: float = Field(
        60.0, ge=0,
        description="The longest a runner keeps one job while another job waits for a runner: then it records the "
        "chunks in flight, lets the job go (its finished chunks kept) and takes the waiting job whose tenant had a "
        "turn least recently, so one tenant's long job cannot hold every runner for hours. 0: a runner keeps a job "
        "to its end.",
    )  # fmt: skip
    lease_ttl_s: float = Field(
        15.0, gt=0, description="Life of a runner's claim on a job not renewed; then another runner takes it over."
    )
    poll_interval_s: float = Field(1.0, gt=0, description="How often an idle runner looks for jobs.")
    request_timeout_s: float = Field(60.0, gt=0, description="Longest one inference request may take.")
    retry_for_s: float = Field(
        600.0, ge=0,
        description="How long one line is retried while the gateway refuses for load (429/503) or is unreachable.",
    )  # fmt: skip
    auth_retry_s: float = Field(
        30.0, ge=0,
        description="How long one line is retried on a 401, each try on a new connection (while a gateway rollout "
                    "leaves replicas that do not know work tokens); a 401 that lasts stops the job.",
    )  # fmt: skip
    ca_file: str | None = Field(None, description="CA that signs the gateway's certificate (https://).")
    credential_key_file: str | None = Field(
        None,
        description="The installation's credential key file, the gateway's own (AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE): "
        "opens the submitters' credentials, which the gateway seals in Redis (aiworks.security.sealing). Unset: a "
        "job whose credential is sealed fails, saying so.",
    )  # fmt: skip
    credential_key_reload_s: float = Field(
        10.0, ge=0, description="How often the credential key file is read again: a rotation step is taken without "
        "a restart. 0: no periodic re-read (only when a sealed value names a key not held).",
    )  # fmt: skip
    metrics_port: int = Field(0, ge=0, le=65535, description="Serve Prometheus /metrics on this port (0: none).")
    metrics_host: str = Field(
        "127.0.0.1", description="Address /metrics listens on (0.0.0.0 in a container, for Prometheus to reach it)."
    )
