"""A runtime's heartbeats leave every interval, counted from each one's sending (aiworks.runtime.registrar).

The scheduler removes a replica it has not heard from for ``heartbeat_timeout_s`` (3.5 s by default, the
interval 1 s). Counted from each answer instead, a scheduler slow to answer (a loaded machine) stretched
the gap between two heartbeats to the interval plus the answer's time, and at 2.5 s answers the
replica was removed while alive.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from aiworks.runtime.registrar import Registrar


class SlowScheduler:
    """Answers each heartbeat after ``delay_s``; records when each was sent."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.sent: list[float] = []

    async def register_replica(self, info, timeout_s: float):
        return SimpleNamespace(heartbeat_interval_s=0.0)

    async def heartbeat(self, request, timeout_s: float):
        self.sent.append(asyncio.get_running_loop().time())
        await asyncio.sleep(self.delay_s)
        return SimpleNamespace(known=True)


def idle_dataplane() -> SimpleNamespace:
    queues = SimpleNamespace(sweep=lambda: None, stats=lambda: [])
    return SimpleNamespace(inflight_batches=0, queues=queues, advertised_specs=lambda: [],
                           unhealthy_versions=lambda: [], kv_room=lambda: [])  # fmt: skip


async def gaps(delay_s: float, interval_s: float, beats: int) -> list[float]:
    scheduler = SlowScheduler(delay_s)
    registrar = Registrar(scheduler, idle_dataplane(), replica_id="r", address="127.0.0.1:1", device="cpu",
                          labels={}, interval_s=interval_s, watch_s=0.01)  # fmt: skip
    task = asyncio.create_task(registrar.run())
    try:
        while len(scheduler.sent) < beats:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    return [b - a for a, b in zip(scheduler.sent, scheduler.sent[1:])]


def test_a_slow_answer_does_not_stretch_the_gap_between_heartbeats() -> None:
    # Answers take 60 % of the interval: the heartbeats still leave one interval apart, not 1.6 intervals.
    measured = asyncio.run(gaps(delay_s=0.18, interval_s=0.3, beats=5))
    assert len(measured) == 4
    assert all(0.28 <= g < 0.42 for g in measured), measured  # counted from the answers: 0.48


def test_an_answer_slower_than_the_interval_is_followed_by_the_next_heartbeat_at_once() -> None:
    measured = asyncio.run(gaps(delay_s=0.45, interval_s=0.3, beats=4))
    assert all(0.43 <= g < 0.6 for g in measured), measured  # counted from the answers: 0.75


class LosingScheduler(SlowScheduler):
    """Answers at once, but the heartbeat numbered ``lose`` is never answered: it waits out the caller's deadline,
    as a call on a connection that died does, and fails with DEADLINE_EXCEEDED."""

    def __init__(self, lose: int):
        super().__init__(0.0)
        self.lose = lose
        self.registrations = 0

    async def register_replica(self, info, timeout_s: float):
        self.registrations += 1
        return await super().register_replica(info, timeout_s)

    async def heartbeat(self, request, timeout_s: float):
        self.sent.append(asyncio.get_running_loop().time())
        if len(self.sent) == self.lose:
            from aiworks.core.errors import DeadlineExceeded

            await asyncio.sleep(timeout_s)
            raise DeadlineExceeded("heartbeat: deadline exceeded")
        return SimpleNamespace(known=True)


def test_a_heartbeat_lost_on_a_dead_connection_is_not_fatal() -> None:
    """The scheduler removes a replica silent for 3.5 intervals. A beat that is never answered costs 1.5 intervals
    of waiting, so the next one arrives 2.5 intervals after the last one heard (at 3 intervals of waiting it
    came 4 intervals after: the replica was removed while alive), and it does not register again."""
    interval = 0.4
    scheduler = LosingScheduler(lose=2)

    async def run() -> None:
        registrar = Registrar(scheduler, idle_dataplane(), replica_id="r", address="127.0.0.1:1", device="cpu",
                              labels={}, interval_s=interval, watch_s=0.01)  # fmt: skip
        task = asyncio.create_task(registrar.run())
        try:
            while len(scheduler.sent) < 4:
                await asyncio.sleep(0.01)
        finally:
            task.cancel()

    asyncio.run(run())
    heard_gap = scheduler.sent[2] - scheduler.sent[0]  # the first beat heard, then the next one heard after the lost one
    assert heard_gap < 3.5 * interval, f"{heard_gap:.2f} s between heartbeats heard: the replica would be removed"
    assert heard_gap == pytest.approx(2.5 * interval, abs=0.15)
    assert scheduler.registrations == 1, "an unanswered heartbeat is not a forgotten replica"
