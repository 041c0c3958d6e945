"""The scheduler's settings (env prefix ``AIWORKS_SCHEDULER_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from aiworks.core.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    """Settings of the scheduler."""

    model_config = SettingsConfigDict(env_prefix="AIWORKS_SCHEDULER_")

    host: str = Field("127.0.0.1", description="Interface the gRPC server binds.")
    port: int = Field(8010, description="gRPC port of the SchedulerService.")
    batching: bool = Field(True, description="Dynamic batching; false sends every request as its own batch.")
    max_inflight_batches: int = Field(
        0, description="Batches in flight per replica and model version; 0 means the model's instance count."
    )
    heartbeat_interval_s: float = Field(1.0, description="Interval replicas are told to heartbeat at.")
    heartbeat_timeout_s: float = Field(3.5, description="A replica silent this long is removed.")
    max_retries: int = Field(2, description="Times a batch is re-sent to another replica after a transport failure.")
    runtime_timeout_s: float = Field(30.0, description="Deadline of one batch on a runtime.")
