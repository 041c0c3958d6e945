"""Delivery of asynchronous requests' results to their callback URLs (the nearline worker's side).

Signed with :func:`aiworks.nearline.callbacks.signature`; the URL checked again
against the tenant's allow-list; redirects never followed; host names that
resolve to loopback or link-local addresses refused unless ``localhost`` or the
address itself is listed (:class:`GuardedResolver`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import ThreadedResolver

from aiworks.core.errors import InvalidArgument
from aiworks.nearline.callbacks import CallbackConfig, check_callback_url, signature

log = logging.getLogger(__name__)


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
