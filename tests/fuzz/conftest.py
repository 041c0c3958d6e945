"""Fuzzing fixtures: one suite as real processes (scheduler, one runtime, a gateway with tenancy and an audit log).

The fuzzers send as tenant ``fuzz`` (models iris and digits, not an admin, so
it cannot unload what the others fuzz). Every test ends with
:func:`assert_responsive`: no 5xx is checked per request, and the gateway's
own event-loop lag (``aiworks_event_loop_lag_max_seconds``) must have stayed
under 100 ms through all the fuzzing so far, with no ERROR line in its log.

Budgets: each fuzzer runs a bounded number of examples with no shrinking
deadline, so the folder takes a few tens of seconds after the suite starts.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
import schemathesis
from e2e.e2e_support import Suite, start_suite

from aiworks.gateway.auth import generate_api_key

LAG_BUDGET_S = 0.1
KEY, KEY_HASH = generate_api_key()
HEADERS = {"x-api-key": KEY}


def pytest_collection_modifyitems(items):
    for item in items:
        if "/fuzz/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def fuzz_suite(model_repository, tmp_path_factory) -> Suite:
    work = tmp_path_factory.mktemp("fuzz")
    tenants = work / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"id": "fuzz", "models": ["iris", "digits"], "api_keys": [KEY_HASH]}]}))
    env = {"AIWORKS_GATEWAY_TENANTS_FILE": str(tenants), "AIWORKS_GATEWAY_AUDIT_LOG": str(work / "audit.jsonl")}
    suite = start_suite(model_repository, work / "logs", replicas=1, cache=False, extra_env=env)
    suite.audit_log = work / "audit.jsonl"
    yield suite
    suite.supervisor.stop()


@pytest.fixture(scope="session")
def gateway_schema(fuzz_suite):
    return schemathesis.openapi.from_url(f"{fuzz_suite.base}/openapi.json")


def gateway_metric(suite: Suite, name: str, labels: str = "") -> float:
    """One sample of the gateway's /metrics, by name and label text (``service="gateway"``); 0 when absent."""
    port = suite.supervisor.child("gateway").metrics_port
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", re.M)
    total = 0.0
    for found, value in pattern.findall(text):
        if labels in found:
            total += float(value)
    return total


def assert_responsive(suite: Suite) -> None:
    """The gateway's loop never stalled 100 ms, and it logged no ERROR, through the fuzzing so far.

    The stall is the loop's lag less the time its thread waited for a CPU (aiworks.core.looplag): on a
    machine shared with other test runs, that wait alone can pass 100 ms and says nothing of the gateway.
    """
    stall = gateway_metric(suite, "aiworks_event_loop_stall_max_seconds", 'service="gateway"')
    lag = gateway_metric(suite, "aiworks_event_loop_lag_max_seconds", 'service="gateway"')
    assert stall < LAG_BUDGET_S, f"the gateway's event loop stalled for {stall * 1e3:.0f} ms (lag {lag * 1e3:.0f} ms)"
    log = suite.supervisor.child("gateway").log_path.read_text(errors="replace")
    errors = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not errors, "\n".join(errors[:20])
