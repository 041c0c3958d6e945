"""The gateway's HTTP server stops within ``shutdown_grace_s`` even while a response never ends.

A result-stream subscriber (SSE, ``GET /v2/streams/{name}``) stays connected for as long as its twin
runs. uvicorn's default waits on stop for every response still running, so one subscriber kept the
gateway from exiting until it was killed, and the usage and audit lines it flushes after the HTTP
server stops were lost. The server here is real uvicorn, built by the gateway's own ``http_config``.
"""

from __future__ import annotations

import asyncio
import threading
import time

import requests

from aiworks.gateway.server import _HttpServer, http_config
from aiworks.gateway.settings import GatewaySettings
from aiworks.supervisor.supervisor import free_port


async def _endless(scope, receive, send):
    """An SSE response that never ends, as a subscriber's stream with nothing published."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    while True:
        await send({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})
        await asyncio.sleep(0.05)


async def test_a_response_that_never_ends_does_not_hold_up_the_stop():
    settings = GatewaySettings(scheduler_address="127.0.0.1:1", host="127.0.0.1", http_port=free_port(),
                               shutdown_grace_s=0.5)  # fmt: skip
    server = _HttpServer(http_config(_endless, settings))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    subscribed, done = threading.Event(), threading.Event()
    ended: list[str] = []

    def subscriber() -> None:
        try:
            with requests.get(f"http://127.0.0.1:{settings.http_port}/v2/streams/twin", stream=True, timeout=30) as r:
                for _ in r.iter_content(chunk_size=None):
                    subscribed.set()
                    if done.is_set():
                        ended.append("left")
                        return
            ended.append("ended")
        except requests.exceptions.RequestException:
            ended.append("cut")  # the server closed the endless response at its stop, as it should

    thread = threading.Thread(target=subscriber, daemon=True)
    thread.start()
    try:
        assert await asyncio.to_thread(subscribed.wait, 10)
        started = time.monotonic()
        server.should_exit = True
        await asyncio.wait_for(task, 10)  # without the grace this waits for as long as the subscriber stays
        assert time.monotonic() - started < 0.5 + 2.0
        await asyncio.to_thread(thread.join, 5)
        assert ended in (["cut"], ["ended"]), ended  # the stop ended the subscriber's stream
    finally:
        done.set()
        server.should_exit = True
