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
    metrics_port: int = Field(8002, description="Port of the Prometheus /metrics endpoint; 0 picks a free one.")
    scheduler_address: str = Field(..., description="host:port of the scheduler (required).")
    max_request_bytes: int = Field(
        32 * 1024 * 1024, description="Largest request body (HTTP) or message (gRPC) accepted, in bytes."
    )
    request_timeout_s: float = Field(60.0, description="Deadline of one inference through the scheduler.")
    server_name: str = Field("aiworks", description="Name reported by server metadata.")

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
    cache_metadata_ttl_s: float = Field(
        1.0, description="How long a model's resolved version and cache policy are reused before asking again."
    )
