"""Base class for each service's one Settings object (pydantic-settings).

Each service subclasses :class:`ServiceSettings` with its own env prefix
(``AIWORKS_GATEWAY_``, ``AIWORKS_SCHEDULER_`` ...), builds it once in its
``main`` and passes it down. CLI flags become constructor keyword arguments,
which take precedence over the environment.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ServiceSettings(BaseSettings):
    """Settings every service has."""

    log_level: str = Field("INFO", description="Python log level: DEBUG, INFO, WARNING or ERROR.")
    max_message_bytes: int = Field(
        DEFAULT_MAX_MESSAGE_BYTES, description="Largest gRPC message sent or received, in bytes."
    )
