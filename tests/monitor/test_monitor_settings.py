"""The monitor's one Settings object: environment, defaults and checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from aiworks.cli import build_parser
from aiworks.monitor.settings import MonitorSettings


def test_environment_and_defaults(monkeypatch):
    monkeypatch.setenv("AIWORKS_MONITOR_SCHEDULER_ADDRESS", "scheduler:8010")
    monkeypatch.setenv("AIWORKS_MONITOR_PROMETHEUS_URL", "")  # the chart renders an empty value when unset
    monkeypatch.setenv("AIWORKS_MONITOR_SCALE_OUT_SUSTAIN_S", "2.5")
    s = MonitorSettings()
    assert s.scheduler_address == "scheduler:8010" and s.prometheus_url is None and s.supervisor_url is None
    assert s.scale_out_sustain_s == 2.5 and s.port == 8040 and s.platform == "local"


def test_a_missing_scheduler_and_inconsistent_bounds_fail_at_start(monkeypatch):
    monkeypatch.delenv("AIWORKS_MONITOR_SCHEDULER_ADDRESS", raising=False)
    with pytest.raises(ValidationError, match="scheduler_address"):
        MonitorSettings()
    with pytest.raises(ValidationError, match="min_replicas"):
        MonitorSettings(scheduler_address="s:1", min_replicas=5, max_replicas=2)
    with pytest.raises(ValidationError):
        MonitorSettings(scheduler_address="s:1", platform="nomad")


def test_the_monitor_command_names_the_variable_when_the_scheduler_is_missing(monkeypatch):
    monkeypatch.delenv("AIWORKS_MONITOR_SCHEDULER_ADDRESS", raising=False)
    args = build_parser("monitor").parse_args(["monitor", "--port", "0"])
    with pytest.raises(SystemExit, match="AIWORKS_MONITOR_"):
        args.func(args)
