"""Base class for each service's one Settings object (pydantic-settings).

Each service subclasses :class:`ServiceSettings` with its own env prefix
(``AIWORKS_GATEWAY_``, ``AIWORKS_SCHEDULER_`` ...), builds it once in its
``main`` and passes it down. CLI flags become constructor keyword arguments,
which take precedence over the environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ServiceSettings(BaseSettings):
    """Settings every service has."""

    log_level: str = Field("INFO", description="Python log level: DEBUG, INFO, WARNING or ERROR.")
    max_message_bytes: int = Field(
        DEFAULT_MAX_MESSAGE_BYTES, description="Largest gRPC message sent or received, in bytes."
    )

    # ---- tracing (docs/observability.md); neither set: no spans, incoming trace context still passed on ----
    otlp_endpoint: str | None = Field(
        None, description="OTLP/gRPC collector to export spans to (http://host:4317; https:// for TLS)."
    )
    trace_file: Path | None = Field(
        None, description="File to append finished spans to, one JSON object per line (tests, local debugging)."
    )
    trace_sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="Share of new traces recorded; a caller's sampling decision is kept."
    )
