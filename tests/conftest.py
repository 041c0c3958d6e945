"""Shared fixtures (the demo model repository, built once per session; a private redis-server) and a watchdog that ends a hung run."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# pytest-timeout (pyproject: 300 s) fails a test that runs too long, but only while the test runs: a thread
# the test left looping still holds up its teardown (joining the event loop's executor) or the interpreter's
# exit, and the run then waits for ever, printing nothing. This watchdog bounds both: past its limit it prints
# every thread's stack, so the culprit is named, and ends the run non-zero.
WATCHDOG_SLACK_S = 300  # past a test's own timeout: setup, call and teardown together
EXIT_GRACE_S = 120  # after the session ended


def _watchdog(config, seconds: float, what: str, exit_code: int) -> threading.Timer:
    def fire() -> None:
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=True)  # else what follows lands in the capture buffer, unseen
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.current_thread())
        sys.stderr.write(f"\npytest watchdog: {what} did not finish within {seconds:.0f} s; "
                         f"threads: {names}. Their stacks:\n")  # fmt: skip
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(exit_code)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 300)
    timer = _watchdog(item.config, limit + WATCHDOG_SLACK_S, item.nodeid, 3)
    try:
        yield
    finally:
        timer.cancel()


def pytest_sessionfinish(session, exitstatus):
    _watchdog(session.config, EXIT_GRACE_S, "the process's exit", int(exitstatus) or 3)


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    """The demo repository (iris, digits v1 and v2), built offline once per session.

    AIWORKS_TEST_MODEL_REPOSITORY points at a prebuilt one to save the build.
    """
    from aiworks.demo.models import build_demo_repository

    prebuilt = os.environ.get("AIWORKS_TEST_MODEL_REPOSITORY")
    if prebuilt:
        return Path(prebuilt)
    target = tmp_path_factory.mktemp("repo") / "model-repository"
    build_demo_repository(target, progress=lambda m: None)
    return target


@pytest.fixture
def redis_url(tmp_path):
    """The URL of a redis-server of this test's own, on a free port, stopped after it (tests/cache/support.py)."""
    from cache.support import RedisServer

    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server.url
    server.stop()
