"""One pipelined Redis connection for calls on a request's path (the gateway's limits).

redis-py checks a pooled connection out and back in for every call, with a
lock, a condition and its bookkeeping: about 100 us of CPU per call measured
on these machines, more than the round trip itself. A call here writes its
command to one shared socket and waits for its reply; one reader task hands
the replies, parsed by hiredis, to the callers in the order they sent, so
concurrent requests share the socket and its round trips (about 30 us of CPU
a call).
"""

from __future__ import annotations

import asyncio
from collections import deque

import hiredis
from redis.asyncio.connection import UnixDomainSocketConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError


class RedisPipe:
    """One Redis connection that every admission and release of a gateway replica shares, commands pipelined.

    A caller that stops waiting (its timeout) keeps its place in the queue,
    so later replies still reach their callers; a broken connection fails
    every caller waiting on it, and the next call reconnects. Plain
    ``redis://`` and ``unix://`` URLs (password, username, db); for any other
    URL (``rediss://`` included) :meth:`options` is None and the caller keeps
    to redis-py.
    """

    def __init__(self, options: dict, connect_timeout_s: float):
        self._options = options
        self._connect_timeout_s = connect_timeout_s
        self._connection: _Connection | None = None
        self._connecting = asyncio.Lock()

    @staticmethod
    def options(url: str) -> dict | None:
        """The connection options of ``url``, or None when this client does not handle them."""
        options = parse_url(url)
        kind = options.pop("connection_class", None)
        if kind not in (None, UnixDomainSocketConnection) or set(options) - _OPTIONS:
            return None
        return options

    async def call(self, *parts) -> object:
        """Send one command; its reply, or the error Redis answered (ResponseError, NoScriptError)."""
        connection = self._connection
        if connection is None or connection.broken:
            connection = await self._connect()
        return await connection.send(parts)

    async def _connect(self) -> _Connection:
        async with self._connecting:
            if self._connection is not None and not self._connection.broken:
                return self._connection
            options = self._options
            async with asyncio.timeout(self._connect_timeout_s):
                if "path" in options:
                    streams = await asyncio.open_unix_connection(options["path"])
                else:
                    streams = await asyncio.open_connection(options.get("host", "localhost"),
                                                            int(options.get("port", 6379)))  # fmt: skip
                connection = _Connection(*streams)
                try:
                    if options.get("password"):
                        user = [options["username"]] if options.get("username") else []
                        await connection.send(["AUTH", *user, options["password"]])
                    if int(options.get("db") or 0):
                        await connection.send(["SELECT", options["db"]])
                except BaseException:
                    await connection.close()
                    raise
            self._connection = connection
            return connection

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None


class _Connection:
    """One socket to Redis and the callers waiting on it, in the order their commands were sent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._writer = writer
        self._waiting: deque[asyncio.Future] = deque()
        self.broken = False
        self._reader = asyncio.get_running_loop().create_task(self._read(reader))

    def send(self, parts) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.broken:
            future.set_exception(RedisConnectionError("the connection to Redis is closed"))
            return future
        self._waiting.append(future)
        self._writer.write(_pack(parts))
        return future

    async def _read(self, reader: asyncio.StreamReader) -> None:
        parser = hiredis.Reader(replyError=ResponseError)
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    raise RedisConnectionError("Redis closed the connection")
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    future = self._waiting.popleft()
                    if future.done():  # its caller stopped waiting
                        continue
                    if isinstance(reply, ResponseError):
                        text = str(reply)
                        future.set_exception(NoScriptError(text) if text.startswith("NOSCRIPT") else reply)
                    else:
                        future.set_result(reply)
        except asyncio.CancelledError:
            self._fail(RedisConnectionError("the connection to Redis is closed"))
            raise
        except Exception as exc:
            self._fail(exc if isinstance(exc, RedisError | OSError) else RedisConnectionError(str(exc)))

    def _fail(self, exc: BaseException) -> None:
        self.broken = True
        self._writer.close()
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(exc)

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


_OPTIONS = frozenset({"host", "port", "path", "db", "username", "password"})


def _pack(parts) -> bytes:
    """A command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)
