"""The gateway's trace and log settings (Triton's trace and logging extensions) over its sampling and log level."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace.sampling import Decision

from aiworks.core import tracing
from aiworks.core.errors import InvalidArgument
from aiworks.gateway.diagnostics import Diagnostics


@pytest.fixture
def diagnostics(monkeypatch):
    """Tracing on at a ratio of 1 (as with an exporter), put back afterwards; the root logger's level too."""
    monkeypatch.setattr(tracing, "_tracer", object())
    tracing.SAMPLING.start(1.0, adjustable=True)
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.INFO)
    yield Diagnostics("spans.jsonl")
    tracing.SAMPLING.start(1.0, adjustable=True)
    logging.getLogger().setLevel(level)


def _sampled(model: str, trace_ids: range) -> int:
    sampler = tracing._AdjustableRatio()
    return sum(
        sampler.should_sample(None, t, "gateway infer", attributes={"aiworks.model": model}).decision
        is Decision.RECORD_AND_SAMPLE
        for t in trace_ids
    )


def test_the_settings_read_as_tritons_with_this_servers_values(diagnostics):
    assert diagnostics.trace_settings() == {
        "trace_level": ["TIMESTAMPS"], "trace_rate": ["1"], "trace_count": ["-1"], "log_frequency": ["0"],
        "trace_file": ["spans.jsonl"], "trace_mode": ["opentelemetry"],
    }  # fmt: skip


def test_a_rate_becomes_the_ratio_for_every_model_and_one_models_own(diagnostics):
    assert diagnostics.update_trace_settings({"trace_rate": ["4"]})["trace_rate"] == ["4"]
    assert tracing.SAMPLING.ratio == 0.25
    diagnostics.update_trace_settings({"trace_level": ["OFF"]}, "quiet")
    assert diagnostics.trace_settings("quiet")["trace_level"] == ["OFF"]
    assert diagnostics.trace_settings("quiet")["trace_rate"] == ["4"]  # the rate stays while off
    assert tracing.SAMPLING.for_model("quiet") == 0.0 and tracing.SAMPLING.for_model("loud") == 0.25
    # The sampler reads the ratios of the moment: none of "quiet", about a quarter of the rest.
    step = 2**64 // 1000
    assert _sampled("quiet", range(1, 2**64, step)) == 0
    assert 200 <= _sampled("loud", range(1, 2**64, step)) <= 300
    diagnostics.update_trace_settings({"trace_level": None}, "quiet")
    assert tracing.SAMPLING.for_model("quiet") == 0.25
    diagnostics.update_trace_settings({"trace_rate": None})
    assert tracing.SAMPLING.ratio == 1.0 and diagnostics.trace_settings()["trace_rate"] == ["1"]


@pytest.mark.parametrize(
    "updates, message",
    [
        ({"trace_level": ["TENSORS"]}, "TENSORS is not supported"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, "cannot be combined"),
        ({"trace_rate": ["0"]}, "at least 1"),
        ({"trace_rate": ["often"]}, "must be an integer"),
        ({"trace_rate": ["1", "2"]}, "one value"),
        ({"trace_count": ["5"]}, "'trace_count' cannot be changed"),
        ({"trace_mode": ["triton"]}, "'trace_mode' cannot be changed"),
        ({"trace_file": ["/var/log/x"]}, "'trace_file' cannot be changed"),
        ({"trace_colour": ["red"]}, "unknown trace setting 'trace_colour'"),
    ],
)
def test_what_this_server_cannot_honour_is_refused_by_name(diagnostics, updates, message):
    with pytest.raises(InvalidArgument, match=message):
        diagnostics.update_trace_settings(updates)
    assert tracing.SAMPLING.ratio == 1.0


def test_settings_given_at_their_current_value_are_accepted(diagnostics):
    assert diagnostics.update_trace_settings({"trace_count": ["-1"], "trace_mode": ["opentelemetry"]})


def test_timestamps_need_an_exporter_and_a_fixed_sampler_cannot_change(diagnostics, monkeypatch):
    monkeypatch.setattr(tracing, "_tracer", None)
    assert diagnostics.trace_settings()["trace_level"] == ["OFF"]
    with pytest.raises(InvalidArgument, match="needs a span exporter"):
        diagnostics.update_trace_settings({"trace_level": ["TIMESTAMPS"]})
    tracing.SAMPLING.adjustable = False
    with pytest.raises(InvalidArgument, match="OTEL_TRACES_SAMPLER"):
        diagnostics.update_trace_settings({"trace_rate": ["2"]})


def test_log_categories_map_onto_one_level(diagnostics):
    root = logging.getLogger()
    assert diagnostics.log_settings() == {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
                                          "log_verbose_level": 0, "log_format": "ISO8601"}  # fmt: skip
    assert diagnostics.update_log_settings({"log_verbose_level": 2})["log_verbose_level"] == 2
    assert root.level == logging.DEBUG
    diagnostics.update_log_settings({"log_verbose_level": 0, "log_info": False})
    assert root.level == logging.WARNING
    diagnostics.update_log_settings({"log_warning": False})
    assert root.level == logging.ERROR
    got = diagnostics.update_log_settings({"log_error": False})
    assert root.level > logging.CRITICAL and not any(v for k, v in got.items() if k.startswith("log_") and v is True)
    diagnostics.update_log_settings({"log_error": True, "log_warning": True, "log_info": True})
    assert root.level == logging.INFO


@pytest.mark.parametrize(
    "updates, message",
    [
        ({"log_warning": False}, "log_info on with log_warning off"),
        ({"log_info": "yes"}, "must be a boolean"),
        ({"log_verbose_level": -1}, "integer >= 0"),
        ({"log_format": "default"}, "'log_format' cannot be changed"),
        ({"log_file": "/tmp/x.log"}, "'log_file' cannot be changed"),
        ({"log_colour": True}, "unknown log setting 'log_colour'"),
    ],
)
def test_log_settings_one_level_cannot_express_are_refused(diagnostics, updates, message):
    with pytest.raises(InvalidArgument, match=message):
        diagnostics.update_log_settings(updates)
    assert logging.getLogger().level == logging.INFO
