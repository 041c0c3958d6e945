"""Base class for each service's one Settings object (pydantic-settings).

Each service subclasses :class:`ServiceSettings` with its own env prefix
(``AIWORKS_GATEWAY_``, ``AIWORKS_SCHEDULER_`` ...), builds it once in its
``main`` and passes it down. CLI flags become constructor keyword arguments,
which take precedence over the environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from aiworks.core.errors import InvalidArgument
from aiworks.security.callers import ClientCaller
from aiworks.security.tls import TLSFiles, tls_files

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

    # ---- TLS (docs/security.md); none set: plaintext, the embedded default ----
    tls_cert: Path | None = Field(None, description="PEM certificate this service serves and calls its peers with.")
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert.")
    tls_ca: Path | None = Field(
        None, description="PEM CA that signs every peer's certificate; set: mutual TLS between the services."
    )
    tls_reload_s: float = Field(
        10.0, ge=0,
        description="How often the TLS files are checked for a renewal (cert-manager's, or `aiworks certs` run "
        "again): a changed set is taken by new connections without a restart. 0: read once, at start-up.",
    )

    # ---- who may call (docs/security.md); internal services refuse to start with none of these ----
    internal_token_file: Path | None = Field(
        None,
        description=(
            "0600 file holding the installation's secret: callers prove their name with an HMAC of it, "
            "over plaintext on loopback (`aiworks up` makes it and passes its path)."
        ),
    )
    internal_token_reload_s: float = Field(
        10.0, ge=0,
        description="How often internal_token_file is read again: a rotation step (aiworks certs "
        "--rotate-internal-token) is taken without a restart. 0: no periodic re-read (only when a caller presents "
        "a token of a secret not held).",
    )
    mesh_mtls: bool = Field(
        False,
        description=(
            "A service mesh does the mutual TLS (Istio STRICT): take the caller from the sidecar's "
            "x-forwarded-client-cert (service account <release>-<caller>)."
        ),
    )
    insecure: bool = Field(
        False, description="Accept every caller unchecked, on any address; logged as a warning (isolated tests only)."
    )

    @model_validator(mode="after")
    def _tls_pair(self):
        if bool(self.tls_cert) != bool(self.tls_key) or (self.tls_ca and not self.tls_cert):
            prefix = self.model_config.get("env_prefix", "")
            missing = [f"{prefix}TLS_{n}" for n, v in (("CERT", self.tls_cert), ("KEY", self.tls_key)) if not v]
            raise ValueError(f"TLS needs both a certificate and a key; set {' and '.join(missing)}")
        return self

    def client_caller(self, name: str) -> ClientCaller | None:
        """Who this service is on plaintext channels: ``name`` and its token from ``internal_token_file``."""
        if not self.internal_token_file:
            return None
        try:
            return ClientCaller.from_file(name, self.internal_token_file)
        except InvalidArgument as exc:
            prefix = self.model_config.get("env_prefix", "")
            raise InvalidArgument(f"{prefix}INTERNAL_TOKEN_FILE: {exc}") from None

    def tls_files(self, *, mutual: bool = True) -> TLSFiles | None:
        """This service's certificate, key and CA; ``None`` when TLS is off.

        ``mutual`` (every internal service): the CA is required, since servers
        check their clients' certificates against it and clients check servers'.
        """
        prefix = self.model_config.get("env_prefix", "")
        files = tls_files(self.tls_cert, self.tls_key, self.tls_ca, env_prefix=prefix, reload_s=self.tls_reload_s)
        if files is not None and mutual and files.ca is None:
            raise InvalidArgument(
                f"mutual TLS between the services needs the CA that signs them: set {prefix}TLS_CA "
                "(`aiworks certs` writes it as ca.crt)"
            )
        return files
