"""The tiers side by side (issue #19's performance targets): online capacity, a batch job alone and beside online load, nearline.

One suite (gateway with a tenants file, the Batch API, asynchronous
requests, a private redis-server; digits v1, one row per request), one
``aiworks batch runner`` and one ``aiworks nearline worker``. Phases, one
after the other:

  capacity    closed loops of each of ``--concurrencies`` clients for ``--probe-s``: the suite's online
              capacity is the best rows/s, at the best concurrency (the runner's ``--concurrency``);
  job alone   a ``--alone-rows`` job with nothing else running: its steady rows/s (first progress to
              last line) against capacity (target: at least 0.8);
  online      an open loop (Poisson arrivals, seeded) at ``--online-share`` (0.5) of capacity for
              ``--online-s``: p50 / p99 from each request's arrival time to its answer;
  beside      the same open loop while a ``--rows`` job (200,000 in full mode) runs, from the job's
              first line to its last or for at most ``--beside-max-s`` (then the job is cancelled);
              the runner runs and is stopped (SIGSTOP) in turns of ``--switch-s`` (5 s), and the
              online p99 of the windows it ran is read against the windows it was stopped, each
              side as the median of its windows' p99s (target: within 15 %; :class:`Switch` says
              why), with the job's rows/s and whether it finished while the online load ran. The
              ``online`` phase's p99 is kept beside it (``..._phases``) for comparison;
  after       the same open loop again for ``--online-s`` once the job has ended (the phases
              before and after bracket the host's drift);
  nearline    the worker's capacity: a burst of ``--nearline-burst`` async requests drained (rows/s from
              the first result to the last); then async requests at ``--nearline-factor`` (2) × that
              rate, open loop, for ``--nearline-s`` (10): all complete?, p50 / p99 from submission to the
              stored result (the record's ``completed_at``), and the gateway's and the worker's RSS
              before, at most during, and after.

Jobs are submitted with ``chunk_size`` ``--chunk-size`` (1000): the runner
keeps two chunks in flight, so a chunk's tail does not drain the pipe.
The runner paces itself on the runtime's ``online_load`` signal
(docs/tiers.md, "Online first"); ``--unguarded`` turns that, the
runtime's share rule and its batch lane off, for comparison. The nearline class deadline is
``--nearline-deadline-s`` (120 s here, so every request is answered rather
than expired; the statuses are counted). Prints one JSON object and writes
it to ``bench/results/tiers-<time>.json``.

Usage: python bench/tiers.py [--short] [--rows 200000] [--chunk-size 1000] [--unguarded]
(full: about 10 min, --short about 2.5 min, on a quiet 2-core machine; docs/benchmarks.md, "Tiers")
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import redis
import requests
from tenant_suite import TenantSuite, quiet_collector, tenant_suite

from aiworks.demo.models import digits_split
from aiworks.supervisor.supervisor import free_port

ENDPOINT = "/v2/models/digits/versions/1/infer"
ENDED = ("completed", "failed", "cancelled", "expired")


def _body(row: np.ndarray) -> bytes:
    return orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row.tolist()}]})


def _pcts(seconds: list[float]) -> dict:
    if not seconds:
        return {"n": 0}
    ms = np.asarray(seconds) * 1e3
    return {"n": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2), "max_ms": round(float(ms.max()), 1)}  # fmt: skip


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuShares:
    """Each process's share of one core over a phase: where the machine's CPU went (the job's cost beside online)."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.began = time.monotonic()
        self.start = {name: _cpu_s(pid) for name, pid in pids.items()}

    def result(self) -> dict[str, float]:
        wall = time.monotonic() - self.began
        return {name: round((_cpu_s(pid) - self.start[name]) / wall, 3) for name, pid in self.pids.items()}


# ---- online load ---------------------------------------------------------------------------------


async def closed_loop(suite: TenantSuite, bodies: list[bytes], concurrency: int, duration_s: float) -> dict:
    latencies: list[float] = []
    headers = {**suite.headers, "content-type": "application/json"}
    stop_at = time.monotonic() + duration_s

    async def client(session: aiohttp.ClientSession, i: int) -> None:
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            async with session.post(suite.base + ENDPOINT, data=bodies[i % len(bodies)], headers=headers) as reply:
                await reply.read()
                assert reply.status == 200, reply.status
            latencies.append(time.perf_counter() - start)
            i += concurrency

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        began = time.monotonic()
        await asyncio.gather(*(client(session, k) for k in range(concurrency)))
        elapsed = time.monotonic() - began
    return {"concurrency": concurrency, "rows_per_s": round(len(latencies) / elapsed, 1), **_pcts(latencies)}


async def open_loop(suite: TenantSuite, bodies: list[bytes], rate: float, until, seed: int = 7,
                    arrivals: list[tuple[float, float]] | None = None) -> dict:  # fmt: skip
    """Requests at Poisson arrivals of ``rate``/s until ``until()`` is true; latency from each arrival time.

    ``arrivals``: a list to fill with (arrival time, latency) pairs, for :func:`by_window`.
    """
    headers = {**suite.headers, "content-type": "application/json"}
    gaps = np.random.default_rng(seed)
    latencies: list[float] = []
    failures = 0
    pending: set[asyncio.Task] = set()

    async def one(session: aiohttp.ClientSession, body: bytes, due: float) -> None:
        nonlocal failures
        try:
            async with session.post(suite.base + ENDPOINT, data=body, headers=headers) as reply:
                await reply.read()
                ok = reply.status == 200
        except aiohttp.ClientError:
            ok = False
        if ok:
            latencies.append(time.perf_counter() - due)
            if arrivals is not None:
                arrivals.append((due, latencies[-1]))
        else:
            failures += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        began = due = time.perf_counter()
        sent = 0
        while not until():
            due += gaps.exponential(1.0 / rate)
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            task = asyncio.create_task(one(session, bodies[sent % len(bodies)], due))
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += 1
        elapsed = time.perf_counter() - began
        await asyncio.gather(*pending)
    return {"rate": round(rate, 1), "sent": sent, "sent_per_s": round(sent / elapsed, 1), "failed": failures,
            "seconds": round(elapsed, 1), **_pcts(latencies)}  # fmt: skip


class Switch:
    """Runs a process for ``period_s``, stops it (SIGSTOP) for ``period_s``, and so on: windows with and without it.

    The online latencies of the windows on and off are then read under the same
    host: this VM stalls now and then for 0.1-0.5 s (a neighbour's noise), and
    a p99 over one phase of minutes counts how many stalls fell into it. The
    online-alone phase read a p99 of 16 to 101 ms in runs minutes apart;
    alternating windows expose both sides to the same stalls. The windows go in
    pairs, one of each, in an order drawn per pair (seeded): work in the suite
    that recurs every few seconds cannot fall on one side only.
    """

    def __init__(self, pid: int, period_s: float, *, calibrate: bool = False):
        self.pid, self.period_s = pid, period_s
        self.calibrate = calibrate  # the "on" windows keep it stopped too: what the measure reads with no job
        self.windows: list[tuple[float, float, bool]] = []  # (from, to, the process ran), perf_counter times
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        order = np.random.default_rng(19)
        try:
            while True:
                first = bool(order.integers(2))
                for on in (first, not first):
                    began = time.perf_counter()
                    os.kill(self.pid, signal.SIGCONT if on and not self.calibrate else signal.SIGSTOP)
                    await asyncio.sleep(self.period_s)
                    self.windows.append((began, time.perf_counter(), on))
        finally:
            os.kill(self.pid, signal.SIGCONT)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def by_window(arrivals: list[tuple[float, float]], windows: list[tuple[float, float, bool]],
              settle_s: float) -> list[tuple[bool, list[float]]]:  # fmt: skip
    """Each window's (the job ran, latencies of the requests that arrived in it after its first ``settle_s``)."""
    out = [(on, []) for _, _, on in windows]
    if not windows:
        return out
    starts = np.array([w[0] for w in windows])
    for due, latency in arrivals:
        k = int(np.searchsorted(starts, due, side="right")) - 1
        if k >= 0 and windows[k][0] + settle_s <= due < windows[k][1]:
            out[k][1].append(latency)
    return out


def interleaved(arrivals: list[tuple[float, float]], windows: list[tuple[float, float, bool]], args) -> dict:
    """The online latencies in the windows the job ran and was stopped: pooled, and the median of the windows' p99s.

    The median over windows is the figure the target is read on: one host
    stall of 0.2-0.5 s puts a single window's p99 (and a pooled p99 over a
    few minutes) at hundreds of ms whichever side it falls on, and says
    nothing of the job.
    """
    out: dict = {"period_s": args.switch_s, "settle_s": args.settle_s}
    sides: dict[bool, list[float]] = {}
    if windows:  # the job's first seconds: its start (a quarter of the ceiling in flight until the first signal)
        out["first_2_s"] = _pcts([lat for due, lat in arrivals if due < windows[0][0] + 2.0])
    settle_windows = [(a, min(a + args.settle_s, b), ran) for a, b, ran in windows]  # each window's first settle_s
    settled, settling_periods = by_window(arrivals, windows, args.settle_s), by_window(arrivals, settle_windows, 0.0)
    for on, name in ((True, "job_running"), (False, "job_stopped")):
        mine = [lat for ran, lat in settled if ran == on and len(lat) >= 100]
        pooled = [x for lat in mine for x in lat]
        p99s = [float(np.percentile(lat, 99)) * 1e3 for lat in mine]
        p50s = [float(np.percentile(lat, 50)) * 1e3 for lat in mine]
        settling = [x for ran, lat in settling_periods if ran == on for x in lat]
        sides[on] = p99s
        out[name] = {**_pcts(pooled), "windows": len(mine), "settling": _pcts(settling),
                     "window_p99s_ms": [round(v, 2) for v in p99s],
                     "window_p99_median_ms": round(float(np.median(p99s)), 2) if p99s else None,
                     "window_p50_median_ms": round(float(np.median(p50s)), 2) if p50s else None}  # fmt: skip
    if sides.get(True) and sides.get(False):
        out["ratio_95_ci"] = _bootstrap_ratio(sides[True], sides[False])
    # Each pair's window with the job against its window without (seconds apart, the same host): the median of
    # those ratios, a second reading that drift between the first and last minutes of the phase cannot move.
    pairs = [(a[1], b[1]) if a[0] else (b[1], a[1]) for a, b in zip(settled[0::2], settled[1::2])
             if a[0] != b[0] and min(len(a[1]), len(b[1])) >= 100]
    if pairs:
        ratios = [float(np.percentile(on, 99) / np.percentile(off, 99)) for on, off in pairs]
        out["paired_p99_ratio_median"] = round(float(np.median(ratios)), 3)
        out["pairs"] = len(ratios)
    return out


def _bootstrap_ratio(running: list[float], stopped: list[float], draws: int = 2000) -> list[float]:
    """A 95 % interval of median(running) / median(stopped), the windows of each side resampled (seeded).

    The windows' p99s scatter widely on this VM, so the ratio of two medians
    moves by several per cent between runs that changed nothing
    (``--calibrate``); the interval says how far this run's figure can be read.
    """
    rng = np.random.default_rng(19)
    a, b = np.asarray(running), np.asarray(stopped)
    ratios = (np.median(rng.choice(a, (draws, a.size)), axis=1) / np.median(rng.choice(b, (draws, b.size)), axis=1))
    return [round(float(v), 3) for v in np.percentile(ratios, [2.5, 97.5])]


# ---- batch jobs ----------------------------------------------------------------------------------


def submit_job(suite: TenantSuite, data: bytes, chunk_size: int) -> str:
    uploaded = requests.post(f"{suite.base}/v1/files", headers=suite.headers, data={"purpose": "batch"},
                             files={"file": ("rows.jsonl", data)}, timeout=300).json()  # fmt: skip
    body = {"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "completion_window": "24h", "chunk_size": chunk_size}
    reply = requests.post(f"{suite.base}/v1/batches", headers=suite.headers, json=body, timeout=30)
    reply.raise_for_status()
    return reply.json()["id"]


class JobWatch:
    """Polls a job (and the runner's in-flight limit) in the background: progress, steady rows/s, the end."""

    def __init__(self, suite: TenantSuite, job_id: str, metrics_port: int):
        self.suite, self.job_id, self.metrics_port = suite, job_id, metrics_port
        self.doc: dict = {}
        self.first: tuple[float, int] | None = None  # (when, lines done) at the first progress seen
        self.last: tuple[float, int] | None = None  # the same when the last line was in
        self.limits: list[float] = []
        self.started = asyncio.Event()
        self.ended = asyncio.Event()
        self.task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        url = f"{self.suite.base}/v1/batches/{self.job_id}"
        metrics = f"http://127.0.0.1:{self.metrics_port}/metrics"
        next_limit = 0.0
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(url, headers=self.suite.headers) as reply:
                    self.doc = await reply.json()
                done = self.doc["request_counts"]["completed"] + self.doc["request_counts"]["failed"]
                now = time.monotonic()
                if self.first is None and done:
                    self.first = (now, done)
                    self.started.set()
                if self.last is None and self.doc["status"] in ("finalizing", *ENDED):
                    self.last = (now, done)
                if self.doc["status"] in ENDED:
                    self.started.set()
                    self.ended.set()
                    return
                if now >= next_limit:
                    next_limit = now + 1.0
                    # a short timeout: the runner may be stopped (Switch), and the job's progress must not wait
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with session.get(metrics, timeout=aiohttp.ClientTimeout(total=0.5)) as reply:
                            for line in (await reply.text()).splitlines():
                                if line.startswith("aiworks_batch_in_flight_limit "):
                                    self.limits.append(float(line.split()[-1]))
                await asyncio.sleep(0.1)

    def steady_rows_per_s(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return round((self.last[1] - self.first[1]) / (self.last[0] - self.first[0]), 1)

    def summary(self) -> dict:
        counts = self.doc.get("request_counts", {})
        limits = self.limits
        return {"status": self.doc.get("status"), "completed": counts.get("completed"), "failed": counts.get("failed"),
                "steady_rows_per_s": self.steady_rows_per_s(),
                "seconds": round(self.last[0] - self.first[0], 1) if self.first and self.last else None,
                "in_flight_limit": {"samples": len(limits), "median": float(np.median(limits)) if limits else None,
                                    "min": min(limits, default=None), "max": max(limits, default=None)}}  # fmt: skip


async def job_alone(suite: TenantSuite, data: bytes, metrics_port: int, chunk_size: int) -> dict:
    watch = JobWatch(suite, await asyncio.to_thread(submit_job, suite, data, chunk_size), metrics_port)
    await watch.ended.wait()
    return watch.summary()


async def job_beside_online(suite: TenantSuite, data: bytes, metrics_port: int, bodies, rate: float, args,
                            pids: dict[str, int]) -> dict:  # fmt: skip
    """The online open loop from the job's first lines to its last, or ``--beside-max-s`` (then the job is cancelled)."""
    watch = JobWatch(suite, await asyncio.to_thread(submit_job, suite, data, args.chunk_size), metrics_port)
    await watch.started.wait()
    stop_at = time.monotonic() + args.beside_max_s
    cpu = CpuShares(pids)
    switch = Switch(pids["runner"], args.switch_s, calibrate=args.calibrate) if args.switch_s else None
    arrivals: list[tuple[float, float]] = []
    try:
        online = await open_loop(suite, bodies, rate, lambda: watch.last is not None or time.monotonic() >= stop_at,
                                 arrivals=arrivals)  # fmt: skip
    finally:
        if switch is not None:
            await switch.stop()
    online["cpu_cores"] = cpu.result()
    if switch is not None:
        online["interleaved"] = interleaved(arrivals, switch.windows, args)
    finished = watch.last is not None
    if not finished:
        watch.last = (time.monotonic(), sum(watch.doc["request_counts"][k] for k in ("completed", "failed")))
        cancel = f"{suite.base}/v1/batches/{watch.job_id}/cancel"
        await asyncio.to_thread(requests.post, cancel, headers=suite.headers, timeout=30)
    await watch.ended.wait()
    return {"online": online, "job": {**watch.summary(), "finished_beside_online": finished}}


# ---- nearline ------------------------------------------------------------------------------------


async def submit_async(suite: TenantSuite, bodies: list[bytes], count: int, rate: float | None,
                       refused: dict[int, int], retried: dict[int, int] | None = None, *, key: str | None = None,
                       seed: int = 11) -> list[tuple]:  # fmt: skip
    """``count`` async requests, open loop at ``rate``/s (None: as fast as 32 submitters go); (id, sent_at) each.

    As a real client would: at most 256 connections (more submissions wait for one, their clock already
    running), and a 429 or 503 (the gateway shedding load) is retried after its ``Retry-After``, counted in
    ``retried`` by status; ``sent_at`` stays the first attempt's. Submissions answered otherwise are
    counted in ``refused`` by status. ``key``: another tenant's API key (default: the suite's tenant).
    """
    auth = {"authorization": f"Bearer {key}"} if key else suite.headers
    headers = {**auth, "content-type": "application/json", "prefer": "respond-async"}
    sent: list[tuple[str, float]] = []
    gaps = np.random.default_rng(seed)
    retried = {} if retried is None else retried

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        at = time.time()
        while True:
            async with session.post(suite.base + ENDPOINT, data=bodies[i % len(bodies)], headers=headers) as reply:
                doc = await reply.read()
                if reply.status in (429, 503):
                    retried[reply.status] = retried.get(reply.status, 0) + 1
                    await asyncio.sleep(float(reply.headers.get("retry-after", "1")))
                    continue
                if reply.status != 202:
                    refused[reply.status] = refused.get(reply.status, 0) + 1
                    if len(refused) == 1 and refused[reply.status] == 1:
                        print(f"nearline: submission answered {reply.status}: {doc[:200]!r}", file=sys.stderr)
                    return
            break
        sent.append((orjson.loads(doc)["id"], at))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256 if rate else 32)) as session:
        if rate is None:
            await asyncio.gather(*(one(session, i) for i in range(count)))
        else:
            tasks, due = [], time.perf_counter()
            for i in range(count):
                due += gaps.exponential(1.0 / rate)
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one(session, i)))
            await asyncio.gather(*tasks)
    return sent


def results(store: redis.Redis, sent: list[tuple[str, float]], timeout_s: float) -> tuple[list, dict]:
    """Wait until every request has a stored result (or ``timeout_s``); (seconds from send to result, statuses)."""
    give_up = time.monotonic() + timeout_s
    while True:
        with store.pipeline(transaction=False) as pipe:
            for request_id, _ in sent:
                pipe.hmget(f"aiworks:async:req:{request_id}", "status", "completed_at")
            rows = pipe.execute()
        statuses: dict[str, int] = {}
        for status, _ in rows:
            key = status.decode() if status else "missing"
            statuses[key] = statuses.get(key, 0) + 1
        if statuses.get("queued", 0) == 0 or time.monotonic() > give_up:
            break
        time.sleep(0.5)
    waits = [float(done) - at for (_, at), (_, done) in zip(sent, rows) if done]
    return waits, statuses


async def nearline(suite: TenantSuite, bodies: list[bytes], worker: subprocess.Popen, args) -> dict:
    store = redis.Redis.from_url(suite.redis_url)
    refused: dict[int, int] = {}
    retried: dict[int, int] = {}
    burst = await submit_async(suite, bodies, args.nearline_burst, None, refused, retried)
    _, statuses = await asyncio.to_thread(results, store, burst, 120)
    with store.pipeline(transaction=False) as pipe:
        for request_id, _ in burst:
            pipe.hget(f"aiworks:async:req:{request_id}", "completed_at")
        done = sorted(float(v) for v in pipe.execute() if v)
    capacity = (len(done) - 1) / (done[-1] - done[0]) if len(done) > 1 and done[-1] > done[0] else 0.0
    gateway = suite.pid("gateway")
    rss_before = {"gateway": _rss_mb(gateway), "worker": _rss_mb(worker.pid)}
    peak = dict(rss_before)
    sampling = True

    async def sample() -> None:
        while sampling:
            peak["gateway"] = max(peak["gateway"], _rss_mb(gateway))
            peak["worker"] = max(peak["worker"], _rss_mb(worker.pid))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    rate = args.nearline_factor * capacity
    count = int(rate * args.nearline_s)
    began = time.monotonic()
    sent = await submit_async(suite, bodies, count, rate, refused, retried)
    submitted_s = time.monotonic() - began
    waits, statuses = await asyncio.to_thread(results, store, sent, args.nearline_deadline_s + 30)
    drained_s = time.monotonic() - began
    sampling = False
    await sampler
    store.close()
    return {
        "capacity_per_s": round(capacity, 1), "burst": len(burst), "rate": round(rate, 1), "sent": len(sent),
        "submitted_in_s": round(submitted_s, 1), "all_answered_in_s": round(drained_s, 1), "statuses": statuses,
        "refused": refused, "retried": retried, "all_completed": not refused and statuses.get("completed", 0) == len(sent),
        "submit_to_result": _pcts(waits),
        "rss_mb": {"before": rss_before, "peak": peak,
                   "after": {"gateway": _rss_mb(gateway), "worker": _rss_mb(worker.pid)}},
    }  # fmt: skip


# ---- the run -------------------------------------------------------------------------------------


def _say(phase: str, doc):
    """A phase's result on stderr as it ends (the JSON on stdout comes at the end)."""
    print(f"{time.strftime('%H:%M:%S')} {phase}: {json.dumps(doc)}", file=sys.stderr, flush=True)
    return doc


def _process(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "aiworks", *args], env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=open(log, "ab"))  # noqa: SIM115  # fmt: skip


async def run(suite: TenantSuite, args) -> dict:
    _, x, _, _ = digits_split()
    x = x.astype(np.float32)
    bodies = [_body(r) for r in x[:512]]

    def job_data(n: int) -> bytes:
        return b"".join(_body(x[i % len(x)]) + b"\n" for i in range(n))

    quiet_collector()
    await closed_loop(suite, bodies, 4, 2.0)  # warm-up
    probes = [await closed_loop(suite, bodies, c, args.probe_s) for c in args.concurrencies]
    _say("capacity", probes)
    best = max(probes, key=lambda p: p["rows_per_s"])
    capacity = best["rows_per_s"]
    metrics_port = free_port()
    runner_env = {"AIWORKS_BATCH_POLL_INTERVAL_S": "0.1", "AIWORKS_BATCH_CREDENTIAL_KEY_FILE": str(suite.credential_key)}
    if args.unguarded:
        runner_env["AIWORKS_BATCH_ADAPTIVE"] = "false"
    concurrency = args.job_concurrency or best["concurrency"]
    runner = _process(["batch", "runner", "--redis-url", suite.redis_url, "--gateway-url", suite.base,
                       "--concurrency", str(concurrency), "--metrics-port", str(metrics_port)],
                      runner_env, suite.work / "runner.log")  # fmt: skip
    worker = _process(["nearline", "worker", "--redis-url", suite.redis_url, "--gateway-url", suite.base,
                       "--concurrency", str(args.nearline_concurrency), "--deadline-s", str(args.nearline_deadline_s),
                       "--credential-key-file", str(suite.credential_key)],
                      {}, suite.work / "worker.log")  # fmt: skip
    try:
        alone = _say("job alone", await job_alone(suite, job_data(args.alone_rows), metrics_port, args.chunk_size))
        rate = args.online_share * capacity
        pids = {c.name: c.process.pid for c in suite.supervisor.children}
        pids |= {"runner": runner.pid, "load generator": os.getpid()}
        data = job_data(args.rows)
        cpu = CpuShares(pids)
        started = time.monotonic()
        arrivals: list[tuple[float, float]] = []
        online = await open_loop(suite, bodies, rate, lambda: time.monotonic() - started >= args.online_s,
                                 arrivals=arrivals)  # fmt: skip
        if arrivals:  # the open loop's own first seconds, to read the beside phase's first_2_s against
            online["first_2_s"] = _pcts([lat for due, lat in arrivals if due < arrivals[0][0] + 2.0])
        online["cpu_cores"] = cpu.result()
        _say("online alone", online)
        beside = _say("beside", await job_beside_online(suite, data, metrics_port, bodies, rate, args, pids))
        # The same load again once the job has ended (A-B-A): the phases before and after bracket the host's drift.
        started = time.monotonic()
        cpu = CpuShares(pids)
        after = await open_loop(suite, bodies, rate, lambda: time.monotonic() - started >= args.online_s)
        after["cpu_cores"] = cpu.result()
        _say("online after", after)
        near = _say("nearline", await nearline(suite, bodies, worker, args))
    finally:
        for process in (runner, worker):
            process.terminate()
            process.wait(10)
    steady = alone["steady_rows_per_s"] or 0.0
    return {
        "capacity": {"rows_per_s": capacity, "best_concurrency": best["concurrency"], "probes": probes},
        "job_alone": {**alone, "rows": args.alone_rows, "runner_concurrency": concurrency},
        "online_alone": online, "online_after_job": after, "online_beside_job": beside["online"], "job_beside_online": {**beside["job"], "rows": args.rows},
        "nearline": near,
        "ratios": {
            "job_alone_vs_capacity": round(steady / capacity, 3),  # target >= 0.8
            "online_p99_beside_vs_alone": _interleaved_ratio(beside["online"], "window_p99_median_ms"),  # <= 1.15
            "online_p99_beside_vs_alone_pooled": _interleaved_ratio(beside["online"], "p99_ms"),
            "online_p99_beside_vs_alone_paired": beside["online"].get("interleaved", {}).get("paired_p99_ratio_median"),
            "online_p99_beside_vs_alone_95_ci": beside["online"].get("interleaved", {}).get("ratio_95_ci"),
            "online_p50_beside_vs_alone": _interleaved_ratio(beside["online"], "window_p50_median_ms"),
            "online_p99_beside_vs_alone_phases": round(beside["online"]["p99_ms"] / online["p99_ms"], 3),
            "online_p50_beside_vs_alone_phases": round(beside["online"]["p50_ms"] / online["p50_ms"], 3),
            "online_p99_beside_vs_after_phases": round(beside["online"]["p99_ms"] / after["p99_ms"], 3),
            "job_beside_vs_alone": round((beside["job"]["steady_rows_per_s"] or 0.0) / steady, 3) if steady else None,
            "nearline_rate_vs_capacity": round(near["rate"] / near["capacity_per_s"], 2) if near["capacity_per_s"] else None,
        },
    }  # fmt: skip


def _interleaved_ratio(online: dict, key: str) -> float | None:
    """The online ``key`` in the windows the job ran ÷ the windows it was stopped (None: not interleaved)."""
    sides = online.get("interleaved")
    if not sides or not sides["job_stopped"].get(key) or not sides["job_running"].get(key):
        return None
    return round(sides["job_running"][key] / sides["job_stopped"][key], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--short", action="store_true", help="a short run (about 2 min): fewer rows, shorter phases")
    parser.add_argument("--rows", type=int, help="lines of the job beside online load (default 200000; short 20000)")
    parser.add_argument("--alone-rows", type=int, help="lines of the job alone (default 20000; short 6000)")
    parser.add_argument(
        "--chunk-size", type=int, default=1000, help="the jobs' chunk_size (the gateway's default: 100)"
    )
    parser.add_argument("--beside-max-s", type=float, help="longest online load beside the job (default 900; short 90)")
    parser.add_argument("--concurrencies", default="4,8,16,32,64", help="closed-loop clients probed for capacity")
    parser.add_argument("--probe-s", type=float, help="seconds per probe (default 5; short 2.5)")
    parser.add_argument("--online-share", type=float, default=0.5, help="the open loop's rate, a share of capacity")
    parser.add_argument("--online-s", type=float, help="seconds of online load alone (default 60; short 20); the "
                        "target is read in the beside phase's alternating windows")  # fmt: skip
    parser.add_argument("--switch-s", type=float, help="beside the job, the runner runs and is stopped (SIGSTOP) in "
                        "turns of this many seconds (default 5; short 2), so the online p99 with and without the job "
                        "is read in alternating windows (0: the job runs throughout; the ratio is then None)")
    parser.add_argument("--settle-s", type=float, default=0.5, help="arrivals left out at each window's start")
    parser.add_argument("--calibrate", action="store_true", help="keep the runner stopped in its windows too (the job "
                        "does not run): what the interleaved measure reads with no job, its own spread")
    parser.add_argument("--job-concurrency", type=int, help="the runner's ceiling (default: the best concurrency)")
    parser.add_argument(
        "--nearline-burst", type=int, help="async requests drained for capacity (default 3000; short 1500)"
    )
    parser.add_argument("--nearline-factor", type=float, default=2.0)
    parser.add_argument("--nearline-s", type=float, default=10.0)
    parser.add_argument("--nearline-concurrency", type=int, default=32, help="the worker's requests in flight")
    parser.add_argument("--nearline-deadline-s", type=float, default=120.0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--repository", help="a prebuilt demo repository (default: built in a temporary folder)")
    parser.add_argument("--unguarded", action="store_true", help="no runtime share rule and no runner pacing")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    args = parser.parse_args()
    short = args.short
    args.rows = args.rows or (20_000 if short else 200_000)
    args.alone_rows = args.alone_rows or (6_000 if short else 20_000)
    args.probe_s = args.probe_s or (2.5 if short else 5.0)
    args.beside_max_s = args.beside_max_s or (90.0 if short else 900.0)
    args.switch_s = args.switch_s if args.switch_s is not None else (2.0 if short else 5.0)
    args.online_s = args.online_s or (20.0 if short else 60.0)
    args.nearline_burst = args.nearline_burst or (1500 if short else 3000)
    args.concurrencies = [int(c) for c in args.concurrencies.split(",")]

    def env(work: Path) -> dict[str, str]:
        values = {"AIWORKS_GATEWAY_BATCH_FILES_URL": str(work / "files"), "AIWORKS_GATEWAY_ASYNC_REQUESTS": "true",
                  "AIWORKS_GATEWAY_ASYNC_DEADLINE_S": str(args.nearline_deadline_s)}  # fmt: skip
        if args.unguarded:
            values["AIWORKS_RUNTIME_BATCH_SHARE_WHEN_ONLINE"] = "1"
            values["AIWORKS_RUNTIME_BATCH_LANE_NICE"] = "0"
        return values

    began = time.time()
    with tenant_suite("aiworks-tiers-", env, replicas=args.replicas, repository=args.repository) as suite:
        result = asyncio.run(run(suite, args))
    result = {"mode": "short" if short else "full", "guarded": not args.unguarded, "replicas": args.replicas,
              "cpus": os.cpu_count(), "load_average": [round(v, 2) for v in os.getloadavg()],
              "wall_s": round(time.time() - began, 1), "command": " ".join(sys.argv), **result}  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tiers-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
