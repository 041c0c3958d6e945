"""Version weights, failover, latency-aware routing and outlier ejection through the real suite.

The tests share one suite and run in file order: the kill test leaves one of
the two original runtimes, and the later tests add runtimes of their own.
Each assertion holds whatever number of replicas the suite has at the time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections import Counter
from unittest import mock

import numpy as np
import pytest
from qos_support import ExtraRuntime, KServeClient, child_pid, closed_loop, replica_status, scheduler_status

from aiworks.security.callers import TOKEN_FILE_ENV
from aiworks.status import format_status
from aiworks.traffic_cli import add_traffic_parser

IRIS = np.array([[5.1, 3.5, 1.4, 0.2]], dtype=np.float32)


def traffic(suite, *argv: str, capsys=None) -> str:
    parser = argparse.ArgumentParser()
    add_traffic_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["traffic", "--scheduler", suite.supervisor.scheduler_address, *argv])
    with mock.patch.dict(os.environ, {TOKEN_FILE_ENV: str(suite.supervisor.token_file)}):  # acts as admin
        args.func(args)
    return capsys.readouterr().out if capsys else ""


async def test_weights_90_10_split_requests_without_a_version(pair_suite, capsys):
    assert "v1=90 (90%)  v2=10 (10%)" in traffic(pair_suite, "set", "digits", "1=90", "2=10", capsys=capsys)
    assert "v2=10" in traffic(pair_suite, "get", "digits", capsys=capsys)
    shown = format_status(scheduler_status(pair_suite))  # what `aiworks status` prints
    assert "digits           v1 90 (90%), v2 10 (10%)" in shown and "runtime-0" in shown
    client = KServeClient(pair_suite.grpc_url)
    rng = np.random.default_rng(1)
    versions: Counter = Counter()
    try:

        async def caller():
            for _ in range(125):
                x = rng.random((1, 64), dtype=np.float32)
                versions[(await client.infer(client.request("digits", x))).model_version] += 1

        await asyncio.gather(*(caller() for _ in range(8)))
        pinned = await client.infer(client.request("digits", rng.random((1, 64), dtype=np.float32), version="1"))
        assert pinned.model_version == "1"  # a named version ignores the weights
    finally:
        await client.close()
        traffic(pair_suite, "set", "digits", "--clear")
    assert sum(versions.values()) == 1000
    assert 850 <= versions["1"] <= 950 and 50 <= versions["2"] <= 150, versions
    assert not scheduler_status(pair_suite).traffic  # cleared


async def test_kill_9_of_one_runtime_under_load_fails_no_request(pair_suite):
    if replica_status(pair_suite, "runtime-1") is None:
        pytest.skip("runtime-1 is gone already")
    client = KServeClient(pair_suite.grpc_url)
    pid = child_pid(pair_suite, "runtime-1")

    async def kill_soon():
        await asyncio.sleep(1.5)
        os.kill(pid, signal.SIGKILL)

    try:
        killer = asyncio.ensure_future(kill_soon())
        counts = await closed_loop(client, lambda i: client.request("iris", IRIS), clients=8, duration_s=5.0)
        await killer
    finally:
        await client.close()
    assert counts["errors"] == [] and counts["ok"] > 100, counts["errors"][:5]
    deadline = time.monotonic() + 10
    while replica_status(pair_suite, "runtime-1") is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert replica_status(pair_suite, "runtime-1") is None, "the dead replica was not removed"


async def test_a_slowed_replica_gets_less_traffic(pair_suite):
    slow = ExtraRuntime(pair_suite, "runtime-slow", ["iris"], {"AIWORKS_RUNTIME_DEBUG_DELAY_MS": "40"})
    pair_suite.extras.append(slow)
    slow.start()
    before = {r.replica_id: r.rows_done for r in scheduler_status(pair_suite).replicas}
    client = KServeClient(pair_suite.grpc_url)
    try:
        counts = await closed_loop(client, lambda i: client.request("iris", IRIS), clients=16, duration_s=4.0)
        after = {r.replica_id: r.rows_done for r in scheduler_status(pair_suite).replicas if r.replica_id in before}
    finally:
        await client.close()
        slow.stop()
    assert counts["errors"] == [], counts["errors"][:5]
    served = {rid: after[rid] - before[rid] for rid in after}
    fair = 1 / len(served)
    share = served["runtime-slow"] / sum(served.values())
    print(f"rows served per replica: {served}")
    assert share < fair / 2, f"the slow replica served {share:.0%} of the rows (fair share {fair:.0%}): {served}"


async def test_a_hanging_replica_is_ejected_then_returns(pair_suite):
    hang = ExtraRuntime(pair_suite, "runtime-hang", ["iris"], {"AIWORKS_RUNTIME_DEBUG_DELAY_MS": "3000"})
    pair_suite.extras.append(hang)
    hang.start()
    client = KServeClient(pair_suite.grpc_url)
    seen_ejected = None
    stop = asyncio.Event()

    async def watch():
        nonlocal seen_ejected
        while seen_ejected is None:
            r = replica_status(pair_suite, "runtime-hang")
            if r is not None and r.ejected:
                seen_ejected = r
            await asyncio.sleep(0.1)

    try:
        watcher = asyncio.ensure_future(watch())
        started = time.monotonic()
        while seen_ejected is None and time.monotonic() - started < 20:
            counts = await closed_loop(client, lambda i: client.request("iris", IRIS), clients=8, duration_s=1.0)
            assert counts["errors"] == [], counts["errors"][:5]  # its timeouts are retried elsewhere
        watcher.cancel()
    finally:
        stop.set()
        await client.close()
    assert seen_ejected is not None, "the hanging replica was never ejected"
    assert seen_ejected.times_ejected >= 1 and 0 < seen_ejected.ejected_for_s <= 3 * seen_ejected.times_ejected
    deadline = time.monotonic() + 3 * seen_ejected.times_ejected + 3
    back = None
    while time.monotonic() < deadline:
        back = replica_status(pair_suite, "runtime-hang")
        if back is not None and not back.ejected:
            break
        await asyncio.sleep(0.2)
    assert back is not None and not back.ejected and back.live, "the ejected replica did not come back"
    hang.stop()
