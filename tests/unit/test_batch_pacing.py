"""The batch runner's AIMD pacing: the limit of requests in flight, and the gate that holds to it (issue #19)."""

import asyncio

import pytest

from aiworks.batch.pacing import PacedGate, Pacer


def calm(pacer: Pacer, answers: int, latency_s: float = 0.010) -> None:
    for _ in range(answers):
        pacer.answered(latency_s)


def test_it_grows_by_about_one_request_per_round_while_calm_up_to_the_ceiling():
    pacer = Pacer(16, initial=2)
    calm(pacer, 5)  # the average's warm-up: no baseline yet, no change
    assert pacer.allowed == 2 and pacer.min_latency_s == pytest.approx(0.010)
    calm(pacer, 3)
    assert pacer.allowed == 3  # 2 + 1/2 + 1/2.5 + 1/2.9: about one per round of answers
    calm(pacer, 4)
    assert pacer.allowed == 4
    calm(pacer, 500)
    assert pacer.allowed == 16 and pacer.cuts == 0


def test_rising_latency_cuts_the_limit_multiplicatively_once_per_round():
    pacer = Pacer(16, initial=16, tolerance=2.0, decrease=0.5, smoothing=1.0)
    calm(pacer, 16, 0.010)  # the minimum: 10 ms
    assert pacer.allowed == 16
    pacer.answered(0.050)  # 5x the minimum: busy
    assert pacer.allowed == 8 and pacer.cuts == 1
    for _ in range(7):  # answers of requests sent before the cut do not cut again
        pacer.answered(0.050)
    assert pacer.allowed == 8 and pacer.cuts == 1
    pacer.answered(0.050)  # a full round later, still busy
    assert pacer.allowed == 4 and pacer.cuts == 2


def test_it_never_goes_under_one_request_in_flight():
    pacer = Pacer(8, initial=8, smoothing=1.0)
    pacer.answered(0.001)
    for _ in range(100):
        pacer.answered(1.0)
        pacer.refused()
    assert pacer.allowed == 1 and pacer.limit == 1.0


def test_refusals_for_load_cut_the_limit():
    pacer = Pacer(16, initial=16)
    for _ in range(16):
        pacer.refused()
    assert pacer.allowed == 8


def test_a_single_slow_answer_is_smoothed_away():
    pacer = Pacer(16, initial=16, tolerance=2.0, smoothing=0.2)
    calm(pacer, 16, 0.010)
    pacer.answered(0.030)  # smoothed: 10 + 0.2 * 20 = 14 ms, under 2x
    assert pacer.cuts == 0


def test_one_lucky_answer_does_not_become_the_baseline():
    pacer = Pacer(16, initial=8, tolerance=2.0, smoothing=0.2)
    pacer.answered(0.001)  # far below what the suite does: a raw minimum would make every later answer "busy"
    calm(pacer, 40, 0.010)
    assert pacer.cuts == 0 and pacer.allowed > 8
    assert pacer.min_latency_s > 0.005


def test_a_fixed_pacer_keeps_the_ceiling():
    pacer = Pacer(16, adaptive=False)
    assert pacer.allowed == 16
    calm(pacer, 10, 0.001)
    for _ in range(50):
        pacer.answered(5.0)
        pacer.refused()
    assert pacer.allowed == 16 and pacer.cuts == 0


def test_bad_parameters_are_refused():
    for kwargs in ({"tolerance": 1.0}, {"decrease": 1.0}, {"decrease": 0.0}, {"smoothing": 0.0}):
        with pytest.raises(ValueError):
            Pacer(4, **kwargs)
    with pytest.raises(ValueError):
        Pacer(0)


async def test_the_gate_holds_requests_to_the_limit_and_follows_its_changes():
    pacer = Pacer(8, initial=2, smoothing=1.0)
    gate = PacedGate(pacer)
    peak = 0
    started = asyncio.Event()
    release = asyncio.Event()

    async def request(latency_s: float) -> None:
        nonlocal peak
        await gate.acquire()
        try:
            peak = max(peak, gate.in_flight)
            started.set()
            await release.wait()
            pacer.answered(latency_s)
        finally:
            gate.release()

    tasks = [asyncio.ensure_future(request(0.01)) for _ in range(12)]
    await started.wait()
    for _ in range(10):
        await asyncio.sleep(0)
    assert gate.in_flight == 2 and peak == 2
    release.set()
    await asyncio.gather(*tasks)
    assert gate.in_flight == 0 and peak <= pacer.ceiling
    assert pacer.allowed > 2  # calm answers raised it


async def test_a_cancelled_waiter_leaves_no_hole():
    gate = PacedGate(Pacer(4, initial=1))
    await gate.acquire()
    waiting = [asyncio.ensure_future(gate.acquire()) for _ in range(2)]
    await asyncio.sleep(0)
    waiting[0].cancel()
    gate.release()
    await asyncio.sleep(0)
    await asyncio.wait_for(waiting[1], 1.0)  # the one behind the cancelled waiter got the place
    assert gate.in_flight == 1
    gate.release()
    assert gate.in_flight == 0


def test_after_a_cut_the_average_starts_afresh_so_one_burst_cuts_once():
    pacer = Pacer(16, initial=16, tolerance=2.0, smoothing=0.2)
    calm(pacer, 16, 0.010)
    while pacer.cuts == 0:  # a burst: the average climbs past 20 ms
        pacer.answered(0.100)
    assert pacer.allowed == 8
    calm(pacer, 16, 0.011)  # the load is gone: a stale average (still near 20 ms) would cut again
    assert pacer.cuts == 1 and pacer.allowed > 8
