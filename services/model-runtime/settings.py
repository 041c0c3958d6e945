"""The model-runtime's settings (env prefix ``AIWORKS_RUNTIME_``)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from aiworks.core.settings import ServiceSettings


class RuntimeSettings(ServiceSettings):
    """Settings of one model-runtime replica."""

    model_config = SettingsConfigDict(env_prefix="AIWORKS_RUNTIME_")

    host: str = Field("127.0.0.1", description="Interface the gRPC server binds.")
    port: int = Field(8020, description="gRPC port of the RuntimeService.")
    metrics_port: int = Field(8021, description="Port of the Prometheus /metrics endpoint; 0 picks a free one.")
    advertise_address: str | None = Field(None, description="host:port the scheduler dials; default host:port.")
    replica_id: str | None = Field(None, description="Unique replica name; default <hostname>-<port>.")
    scheduler_address: str = Field(
        ...,
        description=(
            "host:port of the scheduler to register with (required); several, comma-separated: "
            "the replica registers with and heartbeats to every one (scheduler high availability)."
        ),
    )

    def scheduler_addresses(self) -> list[str]:
        """Every scheduler this replica registers with, in the order given."""
        return [a.strip() for a in self.scheduler_address.split(",") if a.strip()]
    model_repository: Path = Field(Path("model-repository"), description="Triton-layout model repository.")
    models: list[str] | None = Field(
        None, description="Models to load at start; default every model in the repository."
    )
    device: Literal["cpu", "gpu"] = Field("cpu", description="Device kind this replica advertises: cpu or gpu.")
    labels: dict[str, str] = Field(default_factory=dict, description="Pool labels advertised to the scheduler.")
    intra_op_threads: int = Field(1, description="ONNX Runtime intra-op threads unless a model config sets them.")
    inline_below_us: int = Field(
        100, description="Batches that compute faster than this run on the event loop instead of a worker thread."
    )
    heartbeat_interval_s: float = Field(1.0, description="Seconds between heartbeats to the scheduler.")
    drain_s: float = Field(
        20.0, ge=0, le=600,
        description="On SIGTERM, the longest wait for the requests and generations the replica holds to finish "
        "before its port closes. First it tells the schedulers it is stopping (they route nothing new to it) and "
        "reports not ready; requests sent before the gateways heard are served too. It ends as soon as nothing is "
        "in flight; a second signal ends it at once. After it, what still arrives gets UNAVAILABLE, which the "
        "gateway retries on another replica. The chart sets runtime.drainSeconds (30 s).",
    )  # fmt: skip
    max_load_file_bytes: int = Field(
        64 << 20,
        ge=0,
        description="Most bytes of model files one LoadModel call may write (the gateway caps a client's load first).",
    )
    memory_budget_bytes: int = Field(
        0, description="Bound on resident model versions (their size on disk); least recently used evicted. 0: none."
    )
    warmup: bool = Field(True, description="Run each version's warm-up batches before reporting it ready.")

    # ---- queues and dynamic batching (docs/scheduler.md); they run here, next to the model ----
    batching: bool = Field(True, description="Dynamic batching; false runs every request as its own batch.")
    priority_aging_ms: float = Field(
        100.0,
        description="Aging step between classes: a request competes as if one class higher after waiting this long.",
    )
    max_queue_requests: int = Field(
        2048, ge=1, description="Requests one model version may queue on this replica; more are refused (429)."
    )
    max_queue_bytes: int = Field(
        64 << 20, ge=1, description="Input bytes one model version may queue on this replica; more are refused (429)."
    )
    max_sequence_backlog: int = Field(
        64, ge=0, description="Sequences of a stateful model that may wait for a free slot on this replica; more "
        "live sequences are refused (429)."
    )
    drain_timeout_s: float = Field(
        30.0, gt=0, description="Longest an unloaded or retired version's queued and running requests may take."
    )
    batch_share_when_online: float = Field(
        0.25, gt=0, le=1,
        description="While online (realtime or standard) requests are queued or arrived within online_window_ms: "
        "the most of a batch's rows, and of a version's execution slots, batch-class work may take (at least one "
        "request and one slot); 1 turns the bound off. With no online traffic batch work uses everything.",
    )  # fmt: skip
    online_window_ms: float = Field(
        100.0, ge=0, description="How long after the last online request a version still holds batch work to its share."
    )
    batch_lane_nice: int = Field(
        19, ge=0, le=19, description="Niceness of the batch lane's threads: batches of batch-class requests run "
        "there, beside the instance slots, so an online request never waits for one and the job uses the CPU "
        "online work leaves (backends computing on this host's CPU). 0: no lane; batch work takes the slots.",
    )  # fmt: skip
    # For tests only: makes a replica slow on purpose (tests/qos). Leave at 0.
    debug_delay_ms: float = Field(
        0.0, description="TESTS ONLY: extra delay added to every batch, in milliseconds; counted as compute time."
    )

    # ---- models at rest (docs/security.md); keys come from files or variables, never from the repository ----
    model_key_files: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Data-key files (base64, `aiworks model keygen`) for encrypted models; comma-separated.",
    )
    model_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Data keys themselves (base64, comma-separated), e.g. a secret as a variable."
    )
    model_public_key_files: Annotated[list[Path], NoDecode] = Field(
        default_factory=list, description="Ed25519 public keys whose model signatures are trusted; comma-separated."
    )
    require_signed_models: bool = Field(False, description="Refuse every model without a valid trusted signature.")
    model_watermark_key_file: Path | None = Field(
        None, description="Owner key (base64) every model's watermark is checked with; set with model_watermark_owner."
    )
    model_watermark_owner: str | None = Field(None, description="Owner id every model's watermark must name.")
    audit_log: Path | None = Field(
        None, description="Hash-chained audit file of model loads and refusals; {replica_id} in it: one per replica."
    )
    audit_key_file: Path | None = Field(None, description="HMAC key file for the audit chain; unset: plain SHA-256.")

    @field_validator("model_key_files", "model_keys", "model_public_key_files", mode="before")
    @classmethod
    def _comma_list(cls, value):
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else [v.strip() for v in text.split(",") if v.strip()]
        return value

    @model_validator(mode="after")
    def _watermark_pair(self):
        if bool(self.model_watermark_key_file) != bool(self.model_watermark_owner):
            missing = "MODEL_WATERMARK_OWNER" if self.model_watermark_key_file else "MODEL_WATERMARK_KEY_FILE"
            raise ValueError(f"a watermark check needs both the owner key and the owner: set AIWORKS_RUNTIME_{missing}")
        return self

    def resolved_replica_id(self) -> str:
        return self.replica_id or f"{socket.gethostname()}-{self.port}"

    def resolved_advertise_address(self, bound_port: int) -> str:
        return self.advertise_address or f"{self.host}:{bound_port}"

    def resolved_audit_log(self, replica_id: str) -> Path | None:
        return Path(str(self.audit_log).replace("{replica_id}", replica_id)) if self.audit_log else None

    # ---- Triton backend (models whose config says backend: "triton"; see docs/triton.md) ----
    triton_url: str | None = Field(
        None, description="host:port of a running tritonserver's gRPC endpoint; unset: this replica starts its own."
    )
    triton_repository: Path | None = Field(
        None, description="Triton model repository this replica writes configs into; default a temporary folder."
    )
    triton_metrics_url: str | None = Field(
        None, description="Triton's Prometheus endpoint (http://host:8002/metrics); default the started server's."
    )
    triton_server_path: Path | None = Field(
        None, description="tritonserver binary to start; default the one bundled in nvidia-pytriton."
    )
    triton_grpc_port: int = Field(0, description="gRPC port of the tritonserver this replica starts; 0: any.")
    triton_metrics_port: int = Field(
        0, description="Metrics port of the tritonserver started here (0: any), or of the one at triton_url."
    )
    triton_instance_kind: Literal["KIND_CPU", "KIND_GPU"] | None = Field(
        None, description="Replace every instance group's kind (KIND_CPU runs GPU configs on a CPU-only Triton)."
    )
    triton_start_timeout_s: float = Field(60.0, description="Seconds to wait for a started tritonserver to be ready.")
    triton_request_timeout_s: float = Field(30.0, description="Timeout of one inference request to Triton, in seconds.")
    triton_restart_backoff_s: float = Field(
        0.5, description="Wait before restarting a tritonserver that died; doubles while it keeps dying."
    )
    triton_restart_backoff_max_s: float = Field(10.0, description="Longest wait between tritonserver restarts.")
    triton_recover_give_up_s: float = Field(
        60.0, description="Seconds Triton may be away before its models are reported unavailable, not recovering."
    )
    triton_health_interval_s: float = Field(
        1.0, description="Seconds between readiness checks of a Triton at triton_url."
    )

    # ---- GPU replicas (device gpu; docs/torch.md) ----
    gpu_memory_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="On a gpu replica with no memory_budget_bytes: the share of the GPU's memory resident models may use.",
    )
