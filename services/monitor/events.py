"""Structured events: every action and anomaly of the monitor, kept and shown.

An operator asks "what did the monitor do, and why?" long after the fact, so
each event carries its time, what kind it is, whom it concerns, a short
machine-readable reason (the same word the metrics use as a label), a
sentence for people, and the numbers behind the decision. Events live in a
bounded ring (the events API pages through it by id) and, when configured, are
appended to a JSON-lines file that outlives the process.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Kinds of events (the ``kind`` field).
RESTART = "restart"
RESTART_GAVE_UP = "restart_gave_up"
SCALE_OUT = "scale_out"
SCALE_IN = "scale_in"
EJECT = "eject"
EJECT_REFUSED = "eject_refused"
ANOMALY = "anomaly"
ACTION_FAILED = "action_failed"
STARTED = "started"


@dataclass(frozen=True)
class Event:
    """One thing the monitor saw or did."""

    id: int
    ts: float  # seconds since the epoch
    kind: str
    target: str  # a service, replica or pool name
    reason: str  # short and stable: dead, queue_depth, p99_latency, quiet, errors, latency_spike, ...
    message: str  # for people
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def time(self) -> str:
        return datetime.fromtimestamp(self.ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, **asdict(self)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Event:
        return cls(**{k: doc[k] for k in ("id", "ts", "kind", "target", "reason", "message")}, details=doc["details"])


class EventLog:
    """A bounded, thread-safe ring of events with an optional JSON-lines copy on disk."""

    def __init__(self, max_events: int = 1000, path: Path | None = None, wall_clock: Callable[[], float] = time.time):
        self._events: deque[Event] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._next_id = 1
        self._wall = wall_clock
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, kind: str, target: str, reason: str, message: str, **details: Any) -> Event:
        with self._lock:
            event = Event(self._next_id, self._wall(), kind, target, reason, message, details)
            self._next_id += 1
            self._events.append(event)
        log.info("event %s %s (%s): %s", kind, target, reason, message)
        if self.path is not None:
            try:
                with self.path.open("a") as f:
                    f.write(json.dumps(event.to_json(), default=str) + "\n")
            except OSError as exc:  # the in-memory ring still has it
                log.warning("could not append to %s: %s", self.path, exc)
        return event

    def since(self, after_id: int = 0, *, kind: str | None = None, limit: int | None = None) -> list[Event]:
        """Events with an id above ``after_id``, oldest first, at most ``limit`` of them.

        From the start (``after_id`` 0) the newest ``limit`` are returned (a
        tail); after an id, the oldest ``limit`` (paging forward, so a
        follower misses nothing).
        """
        with self._lock:
            events = [e for e in self._events if e.id > after_id and (kind is None or e.kind == kind)]
        if not limit or len(events) <= limit:
            return events
        return events[:limit] if after_id else events[-limit:]

    @property
    def last_id(self) -> int:
        with self._lock:
            return self._next_id - 1
