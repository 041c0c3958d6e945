"""One subscriber's reading of a result stream, whatever carries it (docs/tiers.md, "Result streams").

The gateway's two front ends for subscribers, server-sent events (``GET /v2/streams/{name}``,
services/gateway/stream_routes.py) and gRPC server streaming (``aiworks.streams.v1.ResultStreams``,
services/gateway/stream_grpc.py), only translate: the request into :meth:`Subscriptions.open`, and
each :class:`Event` into their wire format through a ``send`` coroutine. Everything else is here:
the checks before a subscription starts, the bound on subscribers, the position (resume, groups,
acknowledgement after the send), the bounded buffer, the slow-consumer policy and gap events.

- The buffer: at most ``buffer_events`` entries are read from Redis at once, and all are sent
  before the next read. A ``send`` returns once the transport took the event, and waits while the
  subscriber's connection is backed up: while it waits, nothing more is read for that subscriber.
- The policy, per stream (the tenant's ``stream_policies``): ``drop`` ends a subscriber whose send
  waited ``send_timeout_s`` (a ``dropped`` event is offered first); ``pause`` lets the send wait as
  long as the connection lives, and reading resumes where it stopped once the subscriber reads
  again. Memory per subscriber is one read either way.
- Gaps: a stream keeps about ``stream_max_len`` entries. When entries after the subscriber's
  position were trimmed before it read them (it resumed from an old id, or fell that far behind,
  or its group did), a ``gap`` event naming the first entry still kept comes before the records.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson

from aiworks.core import metrics
from aiworks.core.errors import NotFound, ResourceExhausted
from aiworks.streams.store import Reader, check_entry_id, check_name, stream_key

RECORD, GAP, HEARTBEAT, DROPPED = "record", "gap", "heartbeat", "dropped"
POLICIES = ("drop", "pause")
DROPPED_ENDING = "dropped"
_OLDEST = ("0", "0-0")


@dataclass(frozen=True, slots=True)
class Event:
    """What a subscriber is sent: a record (``id`` its entry id), a gap, a heartbeat or a drop notice."""

    kind: str
    id: str = ""
    data: bytes = b""


Send = Callable[[Event], Awaitable[None]]


class Subscriptions:
    """The subscribers of one gateway replica, over every transport: their bounds and how one starts."""

    def __init__(self, reader: Reader, *, buffer_events: int = 100, send_timeout_s: float = 5.0,
                 max_subscribers: int = 1000, max_per_tenant: int | None = None, heartbeat_s: float = 15.0,
                 block_ms: int = 1000):  # fmt: skip
        self.reader = reader
        self.buffer_events = buffer_events
        self.send_timeout_s = send_timeout_s
        self.max_subscribers = max_subscribers
        self.max_per_tenant = max_per_tenant  # None: the replica's bound alone
        self.by_tenant: dict[str, int] = {}
        self.heartbeat_s = heartbeat_s
        self.block_ms = block_ms
        self.active = 0

    async def open(self, tenant: str, name: str, *, group: str | None = None, consumer: str | None = None,
                   start: str | None = None, policy: str = "drop", tenant_limit: int | None = None
                   ) -> Subscription:  # fmt: skip
        """A started subscription to ``tenant``'s stream ``name``: 400, 404 or 429 (AIWorksError) before.

        ``start``: the id to continue after (``0``: the oldest kept); None: new entries only, or,
        with ``group``, the position of the group (a new group starts at ``start``, else at the end).
        The subscription holds one of the replica's ``max_subscribers`` slots, and one of its tenant's
        (``tenant_limit``, else ``max_per_tenant``; none for the demo mode's anonymous tenant, ``""``), until
        it is closed: one tenant cannot take every slot from the others.
        """
        check_name(name)
        if group is not None:
            check_name(group, "group name")
        consumer = check_name(consumer or "c-" + secrets.token_hex(6), "consumer name")
        if start is not None:
            check_entry_id(start)
        if policy not in POLICIES:
            raise ValueError(f"slow-consumer policy '{policy}' is not one of {', '.join(POLICIES)}")
        key = stream_key(tenant, name)
        if not await self.reader.exists(key):
            raise NotFound(f"no stream '{name}' (a stream exists once a result has been published to it)")
        if self.active >= self.max_subscribers:
            raise ResourceExhausted(f"this gateway already serves {self.max_subscribers} subscribers", retry_after_s=1)
        cap = tenant_limit or self.max_per_tenant
        if tenant and cap is not None and self.by_tenant.get(tenant, 0) >= cap:
            raise ResourceExhausted(
                f"tenant '{tenant}' already holds {cap} subscriptions on this gateway (max_stream_subscribers in "
                "the tenants file, else the setting stream_max_subscribers_per_tenant); close one first",
                retry_after_s=1,
            )
        self.active += 1
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        metrics.STREAM_SUBSCRIBERS.inc()
        subscription = Subscription(self, key, group, consumer, policy, tenant)
        try:
            if group is not None:
                await self.reader.join(key, group, start or "$")
                subscription.gap = await self.reader.group_gap(key, group)
            elif start is None:
                subscription.last = await self.reader.last_id(key)  # "$" once: no entry slips between two reads
            else:
                subscription.last = start
                subscription.behind = True
                subscription.announce = start not in _OLDEST  # "0" asks for what is kept, gap or not
        except BaseException:
            subscription.close()
            raise
        return subscription


class Subscription:
    """One subscriber: :meth:`run` sends it events until it goes (the caller cancels) or is dropped."""

    def __init__(self, hub: Subscriptions, key: str, group: str | None, consumer: str, policy: str,
                 tenant: str = ""):  # fmt: skip
        self.hub = hub
        self.tenant = tenant
        self.key = key
        self.group = group
        self.consumer = consumer
        self.policy = policy
        self.last = "0-0"
        self.behind = False  # entries may be waiting: read at once, and check for a trim
        self.announce = True
        self.gap: dict | None = None
        self._open = True

    def close(self) -> None:
        """Free the subscriber's slot (once)."""
        if self._open:
            self._open = False
            self.hub.active -= 1
            held = self.hub.by_tenant.pop(self.tenant, 1) - 1
            if held:
                self.hub.by_tenant[self.tenant] = held
            metrics.STREAM_SUBSCRIBERS.dec()

    async def run(self, send: Send) -> str:
        """Events to ``send`` until cancelled; :data:`DROPPED_ENDING` when the subscriber was dropped.

        Entries read through a group are acknowledged once sent; those read but not sent stay
        pending for another member of the group.
        """
        hub, reader, key, group = self.hub, self.hub.reader, self.key, self.group
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        quiet_since = loop.time()
        if self.gap is not None:
            metrics.STREAM_GAPS.inc()
            if not await self._send(send, Event(GAP, data=orjson.dumps(self.gap))):
                return await self._drop(send)
        while True:
            if group is not None:
                entries = await reader.take(key, group, self.consumer, hub.buffer_events, hub.block_ms)
            elif self.behind:
                first, entries = await reader.after_checked(key, self.last, hub.buffer_events)
                if first is not None and self.announce:
                    metrics.STREAM_GAPS.inc()
                    gap = orjson.dumps({"after": self.last, "first": first})
                    if not await self._send(send, Event(GAP, data=gap)):
                        return await self._drop(send)
                self.announce = True
            else:
                entries = await reader.after(key, self.last, hub.buffer_events, hub.block_ms)
            if me.cancelling():  # redis-py (8.1) can swallow a cancellation that arrives as a reply does
                raise asyncio.CancelledError
            if not entries:
                self.behind = False
                if loop.time() - quiet_since >= hub.heartbeat_s:
                    if not await self._send(send, Event(HEARTBEAT)):
                        return await self._drop(send)
                    quiet_since = loop.time()
                continue
            started = loop.time()
            sent: list[str] = []
            try:
                for entry_id, record in entries:
                    if not await self._send(send, Event(RECORD, entry_id, record)):
                        return await self._drop(send)
                    sent.append(entry_id)
                    self.last = entry_id
            finally:
                metrics.STREAM_EVENTS_SENT.inc(len(sent))
                if group is not None and sent:
                    await asyncio.shield(reader.ack(key, group, sent))
            quiet_since = loop.time()
            # A full read, or one that took long to send, may have left entries behind that a trim can reach.
            self.behind = len(entries) >= hub.buffer_events or quiet_since - started > hub.block_ms / 1000

    async def _send(self, send: Send, event: Event) -> bool:
        """False when the policy is ``drop`` and the send waited ``send_timeout_s``."""
        if self.policy == "pause":
            began = asyncio.get_running_loop().time()
            await send(event)  # as long as the connection lives: nothing is read for it meanwhile
            if asyncio.get_running_loop().time() - began >= self.hub.send_timeout_s:
                metrics.STREAM_SUBSCRIBER_PAUSES.inc()
            return True
        try:
            async with asyncio.timeout(self.hub.send_timeout_s):
                await send(event)
        except TimeoutError:
            return False
        return True

    async def _drop(self, send: Send) -> str:
        metrics.STREAM_SUBSCRIBERS_DROPPED.labels("slow").inc()
        note = orjson.dumps({"reason": f"the subscriber did not read for {self.hub.send_timeout_s:g} s"})
        # Offered only: the transport may refuse it outright (gRPC: the timed-out write is still pending).
        with contextlib.suppress(Exception):
            async with asyncio.timeout(0.2):
                await send(Event(DROPPED, data=note))
        return DROPPED_ENDING
