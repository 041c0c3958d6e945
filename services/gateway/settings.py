"""The gateway's settings (env prefix ``AIWORKS_GATEWAY_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from aiworks.core.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    """Settings of one gateway replica."""

    model_config = SettingsConfigDict(env_prefix="AIWORKS_GATEWAY_")

    host: str = Field("127.0.0.1", description="Interface both servers bind.")
    http_port: int = Field(8000, description="Port of the Open Inference Protocol over HTTP.")
    grpc_port: int = Field(8001, description="Port of the Open Inference Protocol over gRPC.")
    scheduler_address: str = Field(..., description="host:port of the scheduler (required).")
    max_request_bytes: int = Field(
        32 * 1024 * 1024, description="Largest request body (HTTP) or message (gRPC) accepted, in bytes."
    )
    request_timeout_s: float = Field(60.0, description="Deadline of one inference through the scheduler.")
    server_name: str = Field("aiworks", description="Name reported by server metadata.")
