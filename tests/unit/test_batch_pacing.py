"""The batch runner's AIMD pacing: the limit of requests in flight, and the gate that holds to it (issue #19)."""

import asyncio

import pytest

from aiworks.batch.pacing import PacedGate, Pacer


def calm(pacer: Pacer, answers: int, latency_s: float = 0.010) -> None:
    for _ in range(answers):
        pacer.answered(latency_s)


def test_slow_start_doubles_the_limit_each_round_until_the_ceiling():
    pacer = Pacer(64, initial=4)
    assert pacer.slow_start
    rounds = []
    while pacer.allowed < 64:
        for _ in range(pacer.allowed):  # one round: as many answers as requests in flight
            pacer.answered(0.010, online=False)
        rounds.append(pacer.allowed)
    assert rounds == [8, 16, 32, 64] and pacer.cuts == 0 and pacer.slow_start
    pacer.answered(0.010, online=False)
    assert pacer.allowed == 64  # never past the ceiling


def test_the_default_start_reaches_the_ceiling_in_two_rounds():
    pacer = Pacer(64)
    assert pacer.allowed == 16
    for _ in range(16 + 32):  # a round at 16, then a round at 32
        pacer.answered(0.010, online=False)
    assert pacer.allowed == 64


def test_after_the_first_cut_it_grows_by_about_one_request_per_round():
    pacer = Pacer(64, initial=8)
    for _ in range(8):
        pacer.answered(0.010, online=False)
    assert pacer.allowed == 16 and pacer.slow_start
    pacer.refused()  # the first cut (a 429): 16 -> 8, and slow start is over for good
    assert pacer.allowed == 8 and not pacer.slow_start
    for _ in range(8):  # one round at 8: 8 + 1/8 + 1/8.125 + ... ends just under 9
        pacer.answered(0.010, online=False)
    assert pacer.limit == pytest.approx(8.95, abs=0.01) and pacer.allowed == 8
    pacer.answered(0.010, online=False)
    assert pacer.allowed == 9
    for _ in range(9):
        pacer.answered(0.010, online=False)
    assert pacer.allowed == 10  # one more per round, not twice as many
    for _ in range(2000):
        pacer.answered(0.010, online=False)
    assert pacer.allowed == 64 and pacer.cuts == 1


def test_with_latency_alone_it_keeps_the_warm_up_then_slow_starts():
    pacer = Pacer(16, initial=2)
    calm(pacer, 4)  # the average's warm-up: no baseline yet, no change
    assert pacer.allowed == 2
    calm(pacer, 3)  # from the fifth answer on, each adds one
    assert pacer.allowed == 5 and pacer.min_latency_s == pytest.approx(0.010)
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


async def test_the_gate_hands_freed_places_to_waiters_in_arrival_order():
    pacer = Pacer(8, initial=2)
    gate = PacedGate(pacer)
    await gate.acquire()
    await gate.acquire()
    entered = []

    async def waiter(i: int) -> None:
        await gate.acquire()
        entered.append(i)

    tasks = [asyncio.ensure_future(waiter(i)) for i in range(6)]
    await asyncio.sleep(0)
    assert entered == [] and gate.in_flight == 2
    gate.release()
    gate.release()  # two places freed before either waiter ran: each goes to one waiter, counted at once
    assert gate.in_flight == 2
    await asyncio.sleep(0)
    assert entered == [0, 1]
    pacer.limit = 5.0  # the limit grew: the next release (2 -> 1 in flight) lets four through, in order
    gate.release()
    assert gate.in_flight == 5
    await asyncio.gather(*tasks)
    assert entered == list(range(6))


def test_after_a_cut_the_average_starts_afresh_so_one_burst_cuts_once():
    pacer = Pacer(16, initial=16, tolerance=2.0, smoothing=0.2)
    calm(pacer, 16, 0.010)
    while pacer.cuts == 0:  # a burst: the average climbs past 20 ms
        pacer.answered(0.100)
    assert pacer.allowed == 8
    calm(pacer, 16, 0.011)  # the load is gone: a stale average (still near 20 ms) would cut again
    assert pacer.cuts == 1 and pacer.allowed > 8


# ---- the runtime's online_load signal ------------------------------------------------------------


def test_with_the_signal_its_own_latency_never_cuts_the_limit():
    pacer = Pacer(16, initial=4, tolerance=2.0, smoothing=1.0)
    latency = 0.002
    for _ in range(400):  # the job alone: each answer slower than the last (its own load), no online traffic
        pacer.answered(latency, online=False)
        latency *= 1.01
    assert pacer.allowed == 16 and pacer.cuts == 0 and pacer.signalled == 400


def test_the_signal_yields_to_the_floor_at_once_and_its_absence_grows_again():
    pacer = Pacer(16, initial=16, floor=0.25)
    for _ in range(16):  # a round with nothing online
        pacer.answered(0.01, online=False)
    assert pacer.allowed == 16
    pacer.answered(0.01, online=True)  # the first answer that says so: out of the way at once, not by halves
    assert pacer.limit == 0.25 and pacer.cuts == 1 and not pacer.slow_start
    for _ in range(40):  # the rest of the requests sent before, and more: already at the floor
        pacer.answered(0.01, online=True)
    assert pacer.limit == 0.25 and pacer.cuts == 1  # the job goes on, a quarter of the time
    pacer.answered(0.5, online=False)  # slow, but nothing online: grows, over one at once
    assert pacer.limit == 1.25
    for _ in range(8):
        pacer.answered(0.5, online=False)
    assert pacer.allowed >= 3
    halving = Pacer(16, initial=16, floor=0.25)
    for _ in range(16):
        halving.refused()  # a 429 or 503 still halves, once per round
    assert halving.allowed == 8 and halving.cuts == 1


def test_answers_without_the_signal_fall_back_to_latency():
    pacer = Pacer(16, initial=16, tolerance=2.0, smoothing=1.0)
    calm(pacer, 16, 0.010)
    pacer.answered(0.050)  # no signal (an older runtime, a cache hit): the latency rule applies
    assert pacer.allowed == 8 and pacer.cuts == 1 and pacer.signalled == 0


class FakeSuite:
    """A suite on a fake clock: answers take ``latency_s`` × (1 + requests in flight / 4); online traffic comes and goes."""

    def __init__(self, online_between: tuple[float, float]):
        self.now = 0.0
        self.online_between = online_between

    def online(self) -> bool:
        start, end = self.online_between
        return start <= self.now < end

    def run(self, pacer: Pacer, until_s: float, latency_s: float = 0.002) -> list[tuple[float, int]]:
        """Rounds of ``pacer.allowed`` requests sent together and answered together; (time, limit) per round."""
        seen = []
        while self.now < until_s:
            sent = pacer.allowed
            self.now += latency_s * (1 + sent / 4)  # the job's own load makes it slower
            for _ in range(sent):
                pacer.answered(latency_s * (1 + sent / 4), online=self.online())
            seen.append((self.now, pacer.allowed))
        return seen


def test_on_a_fake_clock_the_job_yields_while_online_traffic_is_about_and_takes_everything_after():
    suite = FakeSuite(online_between=(1.0, 2.0))
    pacer = Pacer(16)
    seen = suite.run(pacer, 3.0)
    before = [limit for t, limit in seen if 0.5 <= t < 1.0]
    during = [limit for t, limit in seen if 1.1 <= t < 2.0]
    after = [limit for t, limit in seen if 2.5 <= t]
    assert set(before) == {16}  # alone, at the ceiling although its latency is 5x the quiet one
    assert set(during) == {1}  # online traffic: down to one request in flight within 0.1 s
    assert set(after) == {16}  # back to the ceiling within half a second
    first_cut = next(t for t, limit in seen if t >= 1.0 and limit < 16)
    assert first_cut - 1.0 < 0.02


def test_a_floor_under_one_request_is_a_share_of_one_requests_time():
    pacer = Pacer(8, initial=2, floor=0.25)
    for _ in range(10):
        pacer.answered(0.01, online=True)
    assert pacer.limit == 0.25 and pacer.allowed == 1  # one request at a time, a quarter of the time busy
    assert pacer.pause_s(0.010) == pytest.approx(0.030)
    pacer.answered(0.01, online=False)  # the window went quiet: back over one at once, no pause
    assert pacer.limit >= 1 and pacer.pause_s(0.010) == 0.0
    with pytest.raises(ValueError):
        Pacer(4, floor=0)
    with pytest.raises(ValueError):
        Pacer(4, floor=5)


async def test_under_one_the_gate_shuts_after_each_answer_for_its_share():
    pacer = Pacer(4, initial=1, floor=0.25)
    for _ in range(4):
        pacer.answered(0.01, online=True)
    assert pacer.limit == 0.25
    gate = PacedGate(pacer)
    loop = asyncio.get_running_loop()
    await gate.acquire()
    gate.release(busy_s=0.05)  # held the suite 50 ms: shut for 150 ms
    began = loop.time()
    await gate.acquire()
    waited = loop.time() - began
    assert 0.14 <= waited < 1.0, waited
    gate.release()  # no time held: no pause
    began = loop.time()
    await asyncio.wait_for(gate.acquire(), 0.5)
    assert loop.time() - began < 0.05
    gate.release()
