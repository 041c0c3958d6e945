"""The monitor's static inventory (docker-compose: no supervisor, no Kubernetes API)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from aiworks.monitor.discovery import RUNNING, from_static
from aiworks.monitor.platform import LocalPlatform
from aiworks.monitor.settings import MonitorSettings


def test_terms_become_running_services_without_pools():
    inventory = from_static(["runtime-1=runtime@runtime-1:8021", "scheduler=scheduler@scheduler:8011"])
    runtime, scheduler = inventory.services
    assert (runtime.kind, runtime.metrics_address, runtime.replica_id, runtime.state) == (
        "runtime", "runtime-1:8021", "runtime-1", RUNNING,
    )  # fmt: skip
    assert scheduler.replica_id is None
    assert inventory.pools == ()  # nothing to scale through
    assert inventory.targets() == ["runtime-1:8021", "scheduler:8011"]


@pytest.mark.parametrize(
    "term, problem",
    [
        ("runtime-1", "NAME=KIND@HOST:PORT"),
        ("r=runtime@host", "NAME=KIND@HOST:PORT"),
        ("r=runtime@host:x", "NAME=KIND@HOST:PORT"),
        ("r=database@host:1", "kind 'database'"),
    ],
)
def test_bad_terms_are_refused_by_name(term, problem, monkeypatch):
    with pytest.raises(ValueError, match=problem):
        from_static([term])
    monkeypatch.setenv("AIWORKS_MONITOR_STATIC_SERVICES", f'["{term}"]')
    with pytest.raises(ValidationError, match="static_services"):
        MonitorSettings(scheduler_address="scheduler:8010")


def test_a_service_listed_twice_is_refused():
    with pytest.raises(ValueError, match="twice"):
        from_static(["a=cache@a:1", "a=cache@b:1"])


async def test_the_local_platform_without_supervisor_reports_the_static_inventory():
    static = from_static(["cache=cache@cache:8031"])
    platform = LocalPlatform(None, ejector=None, static=static)
    assert await platform.inventory() is static
    with pytest.raises(Exception, match="no supervisor"):
        await platform.scale("runtime", 3)
