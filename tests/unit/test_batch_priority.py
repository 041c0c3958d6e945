"""The batch runner lowers its own CPU priority at start (``nice``), and never raises it."""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = "import os, sys; from aiworks.batch.cli import _lower_priority; _lower_priority(int(sys.argv[1])); " \
         "print(os.getpriority(os.PRIO_PROCESS, 0))"  # fmt: skip


def _niceness_after(nice: int, started_at: int = 0) -> int:
    argv = [sys.executable, "-c", _PROBE, str(nice)]
    if started_at:
        argv = ["nice", "-n", str(started_at), *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return int(done.stdout.strip())


BASE = os.getpriority(os.PRIO_PROCESS, 0)  # what the children inherit (CI may itself run under nice)


def test_the_runner_takes_the_niceness_it_is_given() -> None:
    assert _niceness_after(19) == 19
    assert _niceness_after(7) == max(7, BASE)


def test_zero_leaves_it_as_started_and_a_higher_start_is_kept() -> None:
    assert _niceness_after(0) == BASE
    assert _niceness_after(5, started_at=12) == min(19, BASE + 12)
