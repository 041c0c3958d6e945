"""The rollout controller on a fake clock: promotion, automatic rollback, data, abort, rollback."""

from __future__ import annotations

import pytest
from rollout_support import Behaviour, make_rig, unavailable

from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound, Status


async def test_healthy_canary_is_promoted_through_every_step_to_100():
    rig = make_rig()
    rig.traffic.versions = {"1": Behaviour(0.001, 0.010), "2": Behaviour(0.001, 0.011)}
    status = await rig.controller.start("m", "2", stable="1")
    assert status["phase"] == "progressing" and status["step"] == 1 and status["weights"] == {"1": 95, "2": 5}
    assert rig.target.canary_weights() == [5]

    await rig.run_for(59)  # not judged before the dwell is over
    assert rig.target.canary_weights() == [5] and rig.traffic.reads == 0
    await rig.run_for(1)
    assert rig.target.canary_weights() == [5, 20]
    await rig.run_for(60)
    await rig.run_for(60)
    assert rig.target.canary_weights() == [5, 20, 50, 100]
    assert rig.controller.status("m")["phase"] == "progressing"
    await rig.run_for(60)

    status = rig.controller.status("m")
    assert status["phase"] == "completed" and status["reason"] == "completed"
    assert status["weights"] == {"1": 0, "2": 100} and status["applied"]
    assert rig.target.current["m"] == {"1": 0, "2": 100}
    assert rig.events.kinds == [
        "rollout_started", "rollout_promoted", "rollout_promoted", "rollout_promoted", "rollout_completed"
    ]  # fmt: skip
    # The 100% step has no stable traffic: it is judged against stable's numbers from the 50% window.
    last = status["last_judgement"]
    assert last["verdict"] == "pass" and last["baseline"] == "earlier"
    assert last["canary"]["requests"] == 6000 and last["stable"]["requests"] == 3000
    assert [h["event"] for h in status["history"]] == rig.events.kinds
    assert [h["canary_weight"] for h in status["history"]] == [5, 20, 50, 100, 100]
    first = status["history"][1]["judgement"]
    assert first["canary"] == {"requests": 300, "errors": 0, "error_rate": 0.0, "p99_s": 0.011}
    assert first["stable"]["requests"] == 5700 and first["stable"]["errors"] == 6
    actions = [a for a, _ in rig.events.audits]
    assert actions == ["rollout_start", "rollout_promote", "rollout_promote", "rollout_promote", "rollout_complete"]
    assert all(isinstance(v, str | int | float | bool) for _, d in rig.events.audits for v in d.values())
    # Nothing more happens once complete.
    await rig.run_for(300, step_s=10)
    assert rig.target.canary_weights() == [5, 20, 50, 100]


async def test_canary_failing_20_percent_rolls_back_at_the_first_judgement():
    rig = make_rig()
    rig.traffic.versions = {"1": Behaviour(0.0), "2": Behaviour(0.2)}
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(60)

    status = rig.controller.status("m")
    assert status["phase"] == "rolled_back" and status["reason"] == "error_rate"
    assert "canary error rate 20% vs stable 0% (allowed +1 point)" in status["message"]
    assert "step 1/4" in status["message"]
    assert rig.target.canary_weights() == [5, 0] and rig.target.current["m"] == {"1": 100, "2": 0}
    assert status["last_judgement"]["canary"]["errors"] == 60
    kind, target, reason, message, details = rig.events.events[-1]
    assert (kind, target, reason) == ("rollout_rolled_back", "m", "error_rate")
    assert details["judgement"]["canary"]["error_rate"] == pytest.approx(0.2)
    assert details["weights"] == {"1": 100, "2": 0} and details["applied"]
    assert rig.events.audits[-1][0] == "rollout_auto_rollback"
    await rig.run_for(120)
    assert rig.target.canary_weights() == [5, 0]


async def test_canary_three_times_slower_rolls_back():
    rig = make_rig(steps=(20, 100))
    rig.traffic.versions = {"1": Behaviour(0.0, 0.010), "2": Behaviour(0.0, 0.031)}
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(60)

    status = rig.controller.status("m")
    assert status["phase"] == "rolled_back" and status["reason"] == "p99_latency"
    assert "canary p99 3.1x stable (31 ms vs 10 ms; allowed 1.5x)" in status["message"]
    assert status["last_judgement"]["p99_ratio"] == pytest.approx(3.1)
    assert rig.target.current["m"] == {"1": 100, "2": 0}


async def test_slower_but_under_the_floor_or_the_ratio_is_promoted():
    rig = make_rig(steps=(50, 100), p99_floor_s=0.005)
    rig.traffic.versions = {"1": Behaviour(0.0, 0.001), "2": Behaviour(0.0, 0.004)}  # 4x, but 4 ms
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(120)
    assert rig.controller.status("m")["phase"] == "completed"


async def test_short_of_data_the_dwell_is_extended_then_it_rolls_back():
    rig = make_rig(min_requests=50, max_extensions=2)
    rig.traffic.rate_rps = 2.0  # 5% of 2 rps for 60 s: 6 canary requests a window
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(60)
    status = rig.controller.status("m")
    assert status["phase"] == "progressing" and status["extensions"] == 1 and status["dwell_left_s"] == 60
    assert rig.events.kinds[-1] == "rollout_extended"
    assert "6 canary request(s) in 60 s (need 50)" in rig.events.events[-1][3]
    await rig.run_for(60)
    assert rig.controller.status("m")["extensions"] == 2
    await rig.run_for(60)

    status = rig.controller.status("m")
    assert status["phase"] == "rolled_back" and status["reason"] == "insufficient_data"
    assert "insufficient data after 180 s" in status["message"] and "18 canary request(s)" in status["message"]
    assert rig.target.canary_weights() == [5, 0]
    assert rig.events.kinds == ["rollout_started", "rollout_extended", "rollout_extended", "rollout_rolled_back"]


async def test_an_extension_that_collects_enough_data_goes_on():
    rig = make_rig(min_requests=50)
    rig.traffic.rate_rps = 10.0  # 30 canary requests in the first window, 60 once extended
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(120)
    status = rig.controller.status("m")
    assert status["step"] == 2 and rig.target.canary_weights() == [5, 20]
    assert status["history"][-1]["judgement"]["canary"]["requests"] == 60
    assert status["extensions"] == 0  # a new step starts a new window


async def test_metrics_outage_counts_as_missing_data():
    rig = make_rig(max_extensions=1)
    rig.traffic.failing = unavailable("no metrics endpoint answered")
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(60)
    assert rig.controller.status("m")["extensions"] == 1
    assert "metrics unavailable: no metrics endpoint answered" in rig.events.events[-1][3]
    await rig.run_for(60)
    assert rig.controller.status("m")["reason"] == "insufficient_data"
    assert rig.target.current["m"] == {"1": 100, "2": 0}


async def test_abort_stops_where_it_is_and_returns_traffic_to_stable():
    rig = make_rig()
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(60)
    assert rig.target.canary_weights() == [5, 20]
    await rig.run_for(30)

    status = await rig.controller.abort("m")
    assert status["phase"] == "aborted" and status["applied"] and status["weights"] == {"1": 100, "2": 0}
    assert "aborted at step 2/4 (20% to v2)" in status["message"]
    assert rig.target.canary_weights() == [5, 20, 0]
    assert rig.events.kinds[-1] == "rollout_aborted" and rig.events.audits[-1][0] == "rollout_abort"
    await rig.run_for(120)
    assert rig.target.canary_weights() == [5, 20, 0]
    with pytest.raises(AIWorksError) as err:
        await rig.controller.abort("m")
    assert err.value.status is Status.FAILED_PRECONDITION
    with pytest.raises(NotFound):
        await rig.controller.abort("other")


async def test_rollback_after_completion_returns_to_the_previous_stable():
    rig = make_rig(steps=(50, 100))
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(120)
    assert rig.controller.status("m")["phase"] == "completed"
    with pytest.raises(AIWorksError, match="rollback") as err:
        await rig.controller.abort("m")
    assert err.value.status is Status.FAILED_PRECONDITION

    status = await rig.controller.rollback("m")
    assert status["phase"] == "rolled_back" and status["reason"] == "manual"
    assert "after completion" in status["message"]
    assert rig.target.current["m"] == {"1": 100, "2": 0}
    assert rig.events.kinds[-1] == "rollout_rolled_back" and rig.events.audits[-1][0] == "rollout_rollback"
    with pytest.raises(AIWorksError, match="already back on v1") as err:
        await rig.controller.rollback("m")
    assert err.value.status is Status.FAILED_PRECONDITION


async def test_rollback_in_progress_works_like_abort():
    rig = make_rig()
    await rig.controller.start("m", "2", stable="1")
    status = await rig.controller.rollback("m")
    assert status["phase"] == "rolled_back" and rig.target.canary_weights() == [5, 0]


async def test_one_rollout_per_model_at_a_time():
    rig = make_rig()
    await rig.controller.start("m", "2", stable="1")
    with pytest.raises(AIWorksError, match="in progress") as err:
        await rig.controller.start("m", "3", stable="1")
    assert err.value.status is Status.ALREADY_EXISTS
    await rig.controller.start("n", "2", stable="1")  # another model is fine
    assert {r["model"] for r in rig.controller.status()} == {"m", "n"}
    await rig.controller.abort("m")
    status = await rig.controller.start("m", "3")  # stable: the version serving now (the target's)
    assert status["stable"] == "1" and status["canary"] == "3" and status["history"][0]["event"] == "rollout_started"


async def test_start_is_refused_without_changing_anything():
    rig = make_rig()
    with pytest.raises(AIWorksError, match="not ready") as err:
        await rig.controller.start("m", "9", stable="1")
    assert err.value.status is Status.FAILED_PRECONDITION
    with pytest.raises(InvalidArgument, match="already serves"):
        await rig.controller.start("m", "1")
    with pytest.raises(InvalidArgument, match="last step must be 100"):
        await rig.controller.start("m", "2", stable="1", steps=[5, 50])
    with pytest.raises(InvalidArgument, match="unknown rollout setting"):
        await rig.controller.start("m", "2", stable="1", dwell=5)
    rig.target.failing = unavailable()
    with pytest.raises(AIWorksError, match="scheduler unreachable"):
        await rig.controller.start("m", "2", stable="1")
    assert rig.target.calls == [] and rig.controller.status() == [] and rig.events.events == []
    with pytest.raises(NotFound):
        rig.controller.status("m")


async def test_weights_that_cannot_be_applied_are_retried_and_then_the_window_starts():
    rig = make_rig()
    await rig.controller.start("m", "2", stable="1")
    rig.target.failing = unavailable()
    await rig.run_for(60)  # judged healthy; promotion to 20% fails
    status = rig.controller.status("m")
    assert status["step"] == 2 and not status["applied"] and "scheduler unreachable" in status["apply_error"]
    await rig.run_for(5)
    assert rig.events.kinds.count("action_failed") == 1  # once, not every round
    rig.target.failing = None
    await rig.run_for(1)
    status = rig.controller.status("m")
    assert status["applied"] and status["dwell_left_s"] == 60 and rig.target.canary_weights() == [5, 20]


async def test_abort_while_the_target_is_down_is_kept_and_applied_later():
    rig = make_rig()
    await rig.controller.start("m", "2", stable="1")
    rig.target.failing = unavailable()
    status = await rig.controller.abort("m")
    assert status["phase"] == "aborted" and not status["applied"]
    rig.target.failing = None
    await rig.run_for(1)
    assert rig.controller.status("m")["applied"] and rig.target.current["m"] == {"1": 100, "2": 0}


async def test_emit_failures_do_not_stop_a_rollback():
    def broken(*args):
        raise RuntimeError("event log full")

    rig = make_rig(emit=broken)
    rig.traffic.versions = {"2": Behaviour(0.5)}
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(60)
    assert rig.controller.status("m")["phase"] == "rolled_back" and rig.target.current["m"]["2"] == 0


async def test_the_final_step_compares_errors_with_an_earlier_baseline_and_not_latency():
    rig = make_rig(steps=(50, 100))
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(60)
    assert rig.target.canary_weights() == [50, 100]
    rig.traffic.versions = {"2": Behaviour(0.0, 0.050)}  # 5x slower once it serves alone: not compared
    await rig.run_for(60)
    status = rig.controller.status("m")
    assert status["phase"] == "completed"
    assert "not compared: no stable traffic in this window" in status["message"]

    rig = make_rig(steps=(50, 100))
    await rig.controller.start("m", "2", stable="1")
    await rig.run_for(60)
    rig.traffic.versions = {"2": Behaviour(0.05)}  # failing once it serves alone: caught
    await rig.run_for(60)
    status = rig.controller.status("m")
    assert status["phase"] == "rolled_back" and status["reason"] == "error_rate"
    assert status["last_judgement"]["baseline"] == "earlier" and status["weights"] == {"1": 100, "2": 0}
