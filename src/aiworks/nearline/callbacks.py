"""Callback URLs of asynchronous requests: the tenant's allow-list and the signature.

A tenant lists the hosts its callbacks may go to in the tenants file::

    callbacks:
      hosts: [hooks.example.com, 10.0.0.7]
      secret_file: /run/secrets/alice-callbacks   # or secret_env: ALICE_CALLBACK_SECRET

A request names its callback in the ``AIWorks-Callback`` header. The gateway
refuses (400) a URL whose host is not listed; the worker checks again, then
POSTs the result there. Signature (docs/tiers.md): ``AIWorks-Signature:
sha256=<hex HMAC-SHA256(secret, timestamp + "." + body)>`` with the Unix
timestamp in ``AIWorks-Timestamp``. Redirects are never followed; a host name
that resolves to a loopback or link-local address is refused unless that host
is ``localhost`` or the address itself, listed.

The delivery itself (an HTTP client) is the worker's, in
:mod:`aiworks.nearline.delivery`; this module imports no HTTP client, so the
gateway's image, which checks the URLs, needs none.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from aiworks.core.errors import InvalidArgument

HEADER = "aiworks-callback"
MAX_URL_CHARS = 2048


class CallbackConfig(BaseModel):
    """A tenant's ``callbacks`` section: the hosts its callback URLs may name and where the signing secret is."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, validate_by_name=True, validate_by_alias=True
    )

    hosts: tuple[str, ...] = Field(description="Host names or IP addresses callback URLs may name (any port).")
    secret_env: str | None = Field(None, description="Environment variable holding the HMAC secret.")
    secret_file: str | None = Field(None, description="File holding the HMAC secret (trailing whitespace dropped).")

    @model_validator(mode="after")
    def _one_secret(self) -> CallbackConfig:
        if (self.secret_env is None) == (self.secret_file is None):
            raise ValueError("callbacks need exactly one of 'secret_env' or 'secret_file'")
        return self

    def listed(self, host: str) -> bool:
        return host.lower() in {h.lower().strip("[]") for h in self.hosts}

    def secret(self) -> bytes:
        if self.secret_env is not None:
            value = os.environ.get(self.secret_env, "")
        else:
            value = Path(self.secret_file).read_text().rstrip()
        if not value:
            raise ValueError(f"the callback secret ({self.secret_env or self.secret_file}) is empty or unset")
        return value.encode()


def check_callback_url(url: str, config: CallbackConfig | None) -> str:
    """The callback URL if its host is allow-listed for the tenant; else InvalidArgument naming the host."""
    if len(url) > MAX_URL_CHARS:
        raise InvalidArgument(f"callback URL is {len(url)} characters; at most {MAX_URL_CHARS}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"callback URL {url[:100]!r} must be http:// or https:// with a host")
    if parts.username or parts.password:
        raise InvalidArgument("callback URL must not carry credentials")
    host = parts.hostname
    if config is None or not config.listed(host):
        raise InvalidArgument(f"callback host '{host[:100]}' is not in this tenant's callbacks.hosts")
    return url


def signature(secret: bytes, timestamp: str, body: bytes) -> str:
    """``sha256=<hex>`` of HMAC-SHA256 over ``timestamp + "." + body``."""
    return "sha256=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def load_callbacks(tenants_file: str | None) -> dict[str, tuple[CallbackConfig, bytes]]:
    """Tenant id -> (its callbacks section, its secret), read from the gateway's tenants file."""
    if not tenants_file:
        return {}
    doc = yaml.safe_load(Path(tenants_file).read_text()) or {}
    found = {}
    for tenant in doc.get("tenants") or []:
        section = tenant.get("callbacks")
        if section:
            config = CallbackConfig.model_validate(section)
            found[str(tenant.get("id", tenant.get("name", "")))] = (config, config.secret())
    return found
