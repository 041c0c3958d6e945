"""The model-runtime's settings (env prefix ``AIWORKS_RUNTIME_``)."""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from aiworks.core.settings import ServiceSettings


class RuntimeSettings(ServiceSettings):
    """Settings of one model-runtime replica."""

    model_config = SettingsConfigDict(env_prefix="AIWORKS_RUNTIME_")

    host: str = Field("127.0.0.1", description="Interface the gRPC server binds.")
    port: int = Field(8020, description="gRPC port of the RuntimeService.")
    advertise_address: str | None = Field(None, description="host:port the scheduler dials; default host:port.")
    replica_id: str | None = Field(None, description="Unique replica name; default <hostname>-<port>.")
    scheduler_address: str = Field(..., description="host:port of the scheduler to register with (required).")
    model_repository: Path = Field(Path("model-repository"), description="Triton-layout model repository.")
    models: list[str] | None = Field(None, description="Models to load at start; default every model in the repository.")
    device: str = Field("cpu", description="Device kind this replica advertises: cpu or gpu.")
    labels: dict[str, str] = Field(default_factory=dict, description="Pool labels advertised to the scheduler.")
    intra_op_threads: int = Field(1, description="ONNX Runtime intra-op threads unless a model config sets them.")
    heartbeat_interval_s: float = Field(1.0, description="Seconds between heartbeats to the scheduler.")

    def resolved_replica_id(self) -> str:
        return self.replica_id or f"{socket.gethostname()}-{self.port}"

    def resolved_advertise_address(self, bound_port: int) -> str:
        return self.advertise_address or f"{self.host}:{bound_port}"
