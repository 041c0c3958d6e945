"""Services: a virtual IP per ClusterIP Service, proxied to its ready endpoints (kube-proxy's userspace mode).

Each accepted connection goes to the next ready endpoint, round robin, as
kube-proxy balances connections; a long-lived gRPC connection stays on the
endpoint it reached. Endpoints change as pods become ready or go away.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable


class ServiceProxy:
    """Listens on ``address:port`` for each Service port and forwards to ``endpoints()``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="service-proxy", daemon=True)
        self._thread.start()
        self._servers: list[asyncio.AbstractServer] = []
        self.connections = 0

    def add(self, address: str, port: int, endpoints: Callable[[], list[tuple[str, int]]]) -> None:
        """Proxy ``address:port``; ``endpoints()`` is read for every new connection."""
        turn = itertools.count()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            ready = endpoints()
            if not ready:  # no endpoint: refused, as kube-proxy rejects it
                writer.close()
                return
            host, target_port = ready[next(turn) % len(ready)]
            try:
                up_reader, up_writer = await asyncio.open_connection(host, target_port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)

        async def start() -> None:
            self._servers.append(await asyncio.start_server(handle, address, port, reuse_address=True))

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        try:
            writer.close()
        except RuntimeError:
            pass
