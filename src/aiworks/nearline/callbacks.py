"""Callback URLs of asynchronous requests: the tenant's allow-list, the signature, the delivery.

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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import yaml
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import ThreadedResolver
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from aiworks.core.errors import InvalidArgument

log = logging.getLogger(__name__)

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


def _private(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    return ip.is_loopback or ip.is_link_local or ip.is_unspecified


class GuardedResolver(AbstractResolver):
    """Resolves host names and refuses loopback and link-local answers, except for ``localhost`` itself.

    The connection goes to the address checked here, so a name cannot pass the
    check and then resolve elsewhere. IP literals are not resolved (aiohttp
    connects to them directly): they pass only when listed, which the allow-list
    already requires.
    """

    def __init__(self):
        self._inner = ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        answers = await self._inner.resolve(host, port, family)
        if host.lower() != "localhost":
            answers = [a for a in answers if not _private(a["host"])]
            if not answers:
                raise OSError(f"callback host {host!r} resolves to loopback or link-local addresses only")
        return answers

    async def close(self) -> None:
        await self._inner.close()


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


class CallbackSender:
    """POSTs results to callback URLs: signed, ``timeout_s`` per try, ``attempts`` tries with backoff, no redirects."""

    def __init__(self, callbacks: dict[str, tuple[CallbackConfig, bytes]], *, timeout_s: float = 5.0,
                 attempts: int = 3, backoff_s: float = 0.5):  # fmt: skip
        self.callbacks = callbacks
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(resolver=GuardedResolver(), limit=64),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        return self._session

    async def send(self, tenant: str, url: str, request_id: str, status: str, http_status: int, body: bytes,
                   content_type: str, header_length: str) -> str:  # fmt: skip
        """Deliver one result; ``"delivered"`` or ``"failed: <why>"`` (never raises)."""
        entry = self.callbacks.get(tenant)
        if entry is None:
            return "failed: no callbacks configured for the tenant on this worker"
        config, secret = entry
        try:
            check_callback_url(url, config)
        except InvalidArgument as exc:
            return f"failed: {exc.message}"
        why = ""
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            timestamp = str(int(time.time()))
            headers = {
                "content-type": content_type, "aiworks-request-id": request_id, "aiworks-request-status": status,
                "aiworks-result-status": str(http_status), "aiworks-timestamp": timestamp,
                "aiworks-signature": signature(secret, timestamp, body),
            }  # fmt: skip
            if header_length:
                headers["inference-header-content-length"] = header_length
            try:
                async with self._client().post(url, data=body, headers=headers, allow_redirects=False) as reply:
                    await reply.read()
                    if 200 <= reply.status < 300:
                        return "delivered"
                    why = f"HTTP {reply.status}"
                    if reply.status < 500 and reply.status != 429:
                        break  # a redirect or a refusal: trying again would get the same
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"  # one line: it becomes a header
        log.warning("nearline callback for %s to %s failed: %s", request_id, urlsplit(url).hostname, why)
        return f"failed: {why}"
