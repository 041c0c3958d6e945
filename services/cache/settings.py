"""The cache service's settings (env prefix ``AIWORKS_CACHE_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from aiworks.core.settings import ServiceSettings


class CacheSettings(ServiceSettings):
    """Settings of one cache replica."""

    model_config = SettingsConfigDict(env_prefix="AIWORKS_CACHE_")

    host: str = Field("127.0.0.1", description="Interface the gRPC server binds.")
    port: int = Field(8030, description="gRPC port of the CacheService; 0 picks a free one.")
    metrics_port: int = Field(8031, description="Port of the Prometheus /metrics endpoint; 0 turns it off.")
    redis_url: str | None = Field(
        None, description="redis://host:port/db of a Redis server to store entries in; unset: an in-process LRU."
    )
    max_bytes: int = Field(
        256 * 1024 * 1024, description="Bound on the in-process store: entry bytes plus a per-entry overhead."
    )
    max_entry_bytes: int = Field(4 * 1024 * 1024, description="Largest value stored; bigger puts are refused.")
    default_ttl_s: float = Field(3600.0, description="Time to live of an entry whose put names none.")
    store_timeout_s: float = Field(
        0.005, description="A Redis call slower than this counts as a failure and the request bypasses the store."
    )
    failure_threshold: int = Field(
        10, description="Store failures in a row after which lookups bypass the store for retry_after_s."
    )
    retry_after_s: float = Field(
        0.5, description="How long lookups bypass a failing store before one tries it again."
    )
    key_prefix: str = Field("aiworks:cache:v1:", description="Prefix of every Redis key this cache writes.")
