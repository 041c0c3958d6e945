"""Result streams (issue #19, item 3): results/s delivered to two SSE subscribers, and end-to-end latency.

One suite (scheduler, runtime replica, gateway with result streams, a tenants file and a private
redis-server) and two subscribers of one stream, reading ``GET /v2/streams/{name}`` with aiohttp in
processes of their own (a twin is not the load generator's process). Two phases:

  delivery    records appended straight to the stream's Redis key, as fast as one pipelining
              writer goes, for ``--delivery-s``: results/s each subscriber received (the SSE path
              alone, no inference);
  end-to-end  ``--rate`` inferences/s (open loop, digits v1, one row each, HTTP) with
              ``parameters: {"publish": ...}`` for ``--duration-s``: each subscriber's p50 / p99 from
              the request's send to the event's arrival, and from the gateway's answer (the
              record's ``time``) to the arrival.

Prints one JSON object. Usage: python bench/streams.py [--rate 2500] [--duration-s 8] [--delivery-s 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time

import aiohttp
import numpy as np
import orjson
import redis.asyncio as redis
from tenant_suite import quiet_collector, tenant_suite

from aiworks.demo.models import digits_split

STREAM = "bench"


def _subscribe(url: str, key: str, ready, stop, conn) -> None:
    """One subscriber, in a process of its own (as a twin would be): reads the SSE stream until ``stop`` is set,
    then sends back each record's arrival time and data, and the other events (gap, dropped) in order."""

    async def main() -> None:
        arrivals: list[tuple[float, bytes]] = []
        events: list[str] = []

        async def read(r: aiohttp.ClientResponse) -> None:
            kind = b""
            async for line in r.content:
                if line.startswith(b"event: "):  # gap or dropped: its data line is no record
                    kind = line[7:].strip()
                elif line.startswith(b"data: "):
                    if not kind:
                        arrivals.append((time.time(), line[6:]))
                    else:
                        events.append(kind.decode())
                elif line == b"\n":
                    kind = b""

        async with aiohttp.ClientSession() as session:
            headers = {"authorization": f"Bearer {key}"}
            async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout()) as r:
                assert r.status == 200, await r.text()
                ready.set()
                reader = asyncio.create_task(read(r))
                while not stop.is_set():
                    await asyncio.sleep(0.05)
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
        conn.send((arrivals, events))

    asyncio.run(main())


class Subscriber:
    """A subscriber process; :meth:`finish` stops it and keeps what it read."""

    def __init__(self, url: str, key: str):
        ctx = mp.get_context("spawn")
        self.ready, self.stop = ctx.Event(), ctx.Event()
        self._conn, child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_subscribe, args=(url, key, self.ready, self.stop, child), daemon=True)
        self.process.start()
        child.close()  # the child's end lives in the child: recv() then ends (EOFError) if the child dies
        self.arrivals: list[tuple[float, bytes]] = []
        self.events: list[str] = []

    def finish(self) -> None:
        self.stop.set()
        try:
            self.arrivals, self.events = self._conn.recv()
        except EOFError:  # the subscriber died (its error is on stderr): nothing it read
            pass
        self.process.join(10)

    def between(self, t0: float, t1: float) -> list[tuple[float, bytes]]:
        return [a for a in self.arrivals if t0 <= a[0] < t1]


def _pcts(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ms = np.asarray(values) * 1000
    return {"n": len(values), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2)}  # fmt: skip


async def _delivery(store: redis.Redis, tenant: str, seconds: float) -> tuple[float, int]:
    """Append records as fast as one pipelining writer goes; (when it started, how many it wrote)."""
    key = f"aiworks:stream:{tenant}:{STREAM}"
    record = orjson.dumps({"model": "digits", "version": "1", "id": "x", "time": 0.0,
                           "outputs": [{"name": "label", "datatype": "INT64", "shape": [1], "data": [3]}]})  # fmt: skip
    start = time.time()
    written = 0
    while time.time() - start < seconds:
        async with store.pipeline(transaction=False) as pipe:
            for _ in range(200):
                pipe.xadd(key, {"r": record}, maxlen=10_000, approximate=True)
            await pipe.execute()
        written += 200
        await asyncio.sleep(0)
    await asyncio.sleep(1.0)  # the tail arrives
    return start, written


async def _end_to_end(session, base: str, key: str, rate: float, seconds: float) -> dict:
    _, x, _, _ = digits_split()
    rows = x.astype(np.float32)
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    quiet_collector()  # this process's collector out of the latencies
    start = time.time()
    sent, failures = 0, 0
    pending: set[asyncio.Task] = set()

    async def one(i: int) -> None:
        nonlocal failures
        body = orjson.dumps({"id": repr(time.time()), "parameters": {"publish": STREAM},
                             "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64],
                                         "data": rows[i % len(rows)].tolist()}]})  # fmt: skip
        async with session.post(f"{base}/v2/models/digits/versions/1/infer", data=body, headers=headers) as r:
            await r.read()
            failures += r.status != 200

    while time.time() - start < seconds:
        due = start + sent / rate
        await asyncio.sleep(max(0.0, due - time.time()))
        task = asyncio.create_task(one(sent))
        pending.add(task)
        task.add_done_callback(pending.discard)
        sent += 1
    await asyncio.gather(*pending)
    await asyncio.sleep(1.0)
    return {"start": start, "rate": rate, "sent": sent, "failed": failures}


def _latencies(subscribers: list[Subscriber], run: dict) -> dict:
    start = run.pop("start")
    result = {**run, "subscribers": []}
    for s in subscribers:
        from_send, from_answer = [], []
        for arrived, data in s.between(start, float("inf")):
            record = orjson.loads(data)
            if record["id"] != "x":
                from_send.append(arrived - float(record["id"]))
                from_answer.append(arrived - record["time"])
        result["subscribers"].append({"send_to_event": _pcts(from_send), "answer_to_event": _pcts(from_answer),
                                      "other_events": s.events})  # fmt: skip
    return result


async def _bench(base: str, key: str, redis_url: str, args) -> dict:
    store = redis.Redis.from_url(redis_url)
    await store.xadd(f"aiworks:stream:bench:{STREAM}", {"r": b'{"id": "x"}'})  # the stream exists
    subscribers = [Subscriber(f"{base}/v2/streams/{STREAM}", key) for _ in range(2)]
    try:
        for s in subscribers:
            assert await asyncio.to_thread(s.ready.wait, 60), "a subscriber did not connect"
        began, written = await _delivery(store, "bench", args.delivery_s)
        ended = time.time()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
            run = await _end_to_end(session, base, key, args.rate, args.duration_s)
    finally:
        for s in subscribers:
            await asyncio.to_thread(s.finish)
    await store.aclose()
    got = [len(s.between(began, ended)) for s in subscribers]
    delivery = {"written": written, "received": got,
                "results_per_s_each": [round(g / (ended - began)) for g in got]}  # fmt: skip
    return {"delivery": delivery, "end_to_end": _latencies(subscribers, run)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=2500.0,
                        help="inferences per second in the end-to-end phase (the target's: half of 5,000)")
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--delivery-s", type=float, default=5.0)
    parser.add_argument("--repository", help="a prebuilt demo repository (default: built in a temporary folder)")
    args = parser.parse_args()

    with tenant_suite(
        "aiworks-streams-", {"AIWORKS_GATEWAY_RESULT_STREAMS": "true"}, repository=args.repository
    ) as suite:
        result = asyncio.run(_bench(suite.base, suite.key, suite.redis_url, args))
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
