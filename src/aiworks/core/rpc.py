"""gRPC plumbing shared by every service: servers, channels, health and errors.

Every server port and client channel of the suite is made here, plaintext or
TLS: :func:`add_port` binds a server (mutual TLS when given the service's
:class:`~aiworks.security.tls.TLSFiles`), :func:`client_channel` dials a peer
(presenting the service's certificate, trusting only its CA), and
:func:`blocking_channel` does the same for the synchronous tools (the
supervisor's health checks, ``aiworks status``). A peer is verified against
its service's name (``scheduler``, ``runtime``, ``cache``), which every
certificate from ``aiworks certs --services`` carries, not against the address
dialled: replicas advertise whatever they bound (an IP, ``runtime-1:8020``)
and all share one certificate, as all share one identity.

Who calls is checked where servers are made: :func:`create_server` takes the
service's :class:`~aiworks.security.callers.CallerCheck`, and every channel made
here presents this process's caller (:func:`use_process_caller`): its client
certificate under TLS, else the ``x-aiworks-caller`` metadata, added once per
call or stream by :class:`CallerChannel` (never per message). A TLS channel
is a :class:`RenewingChannel`: it follows renewed certificate files
(:mod:`aiworks.security.cert_watch`), as the servers' credentials do.

Servicer methods are wrapped by :func:`handle_errors`, which turns an
:class:`AIWorksError` into the gRPC status from the one error table, and any
other exception into INTERNAL with a log line. Clients turn failures back into
:class:`AIWorksError` with :func:`aiworks.core.errors.from_rpc_error`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from aiworks.core.errors import AIWorksError
from aiworks.security.callers import ClientCaller
from aiworks.security.tls import TLSFiles, channel_credentials, server_credentials

log = logging.getLogger(__name__)


MAX_RECONNECT_BACKOFF_S = 1.0  # the longest a channel waits before trying a lost peer again


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Peers are long-lived; keep connections warm and notice dead ones.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # A restarted peer is found again within a second: gRPC's default backoff (1 s, ×1.6, up to 120 s)
        # kept runtimes from registering with a restarted scheduler for seconds (docs/scheduler.md).
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF_S * 1000)),
    ]


def create_server(
    max_message_bytes: int, callers: grpc.aio.ServerInterceptor | None = None, *, max_metadata_bytes: int | None = None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A grpc.aio server with ``grpc.health.v1`` registered (status NOT_SERVING).

    ``callers`` (an internal service's :class:`~aiworks.security.callers.CallerCheck`)
    refuses calls from callers its table does not allow; health checks stay open.
    ``max_metadata_bytes`` bounds a call's metadata (soft and hard limit
    alike); unset, gRPC's defaults apply (8 KiB soft, 16 KiB hard).
    """
    options = channel_options(max_message_bytes)
    if max_metadata_bytes is not None:
        options += [("grpc.max_metadata_size", max_metadata_bytes), ("grpc.absolute_max_metadata_size", max_metadata_bytes)]
    server = grpc.aio.server(options=options, interceptors=[callers] if callers else None)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


async def set_serving(health_servicer, serving: bool, service: str = "") -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set(service, status)


def add_port(server, address: str, tls: TLSFiles | None, *, require_client_cert: bool = True) -> int:
    """Bind ``address`` (``host:port``) on ``server``: plaintext without ``tls``, else TLS.

    Internal services require a client certificate signed by ``tls.ca`` (mutual
    TLS); the gateway's public port passes ``require_client_cert=False``.
    Returns the bound port.
    """
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls, require_client_cert=require_client_cert))


def insecure_channel(address: str, max_message_bytes: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))


def client_channel(
    address: str,
    max_message_bytes: int,
    tls: TLSFiles | None = None,
    *,
    server_name: str | None = None,
    caller: ClientCaller | None = None,
) -> grpc.aio.Channel:
    """A channel to a peer service: plaintext without ``tls``, mutual TLS with it.

    ``server_name`` is the peer's service name, checked against its
    certificate instead of the host in ``address`` (see :func:`tls_options`).
    Over plaintext, ``caller`` (default: :func:`process_caller`) rides on every call.
    """
    options = channel_options(max_message_bytes)
    if tls is not None:
        options += tls_options(address, server_name)
        return RenewingChannel(lambda: grpc.aio.secure_channel(address, channel_credentials(tls), options=options), tls)
    return _with_caller(grpc.aio.insecure_channel(address, options=options), caller)


def blocking_channel(
    address: str, tls: TLSFiles | None = None, *, server_name: str | None = None, caller: ClientCaller | None = None
) -> grpc.Channel:
    """A synchronous channel (tools, the supervisor's health checks), plaintext or mutual TLS."""
    if tls is not None:
        options = tls_options(address, server_name)
        return RenewingChannel(lambda: grpc.secure_channel(address, channel_credentials(tls), options=options), tls)
    return _with_caller(grpc.insecure_channel(address), caller)


def _with_caller(channel, caller: ClientCaller | None):
    caller = caller or _process_caller
    return CallerChannel(channel, caller) if caller else channel


class _CallerMetadata:
    """A multi-callable that adds the caller's metadata to each call (or stream) it starts."""

    __slots__ = ("_inner", "_caller")

    def __init__(self, inner, caller: ClientCaller):
        self._inner = inner
        self._caller = caller

    def _merged(self, metadata):
        # Read at each call: a rotated internal token (ClientCaller.reload) reaches the calls made after it.
        ours = self._caller.metadata()
        return ours if metadata is None else (*tuple(metadata), *ours)

    def __call__(self, *args, metadata=None, **kwargs):
        return self._inner(*args, metadata=self._merged(metadata), **kwargs)

    def with_call(self, *args, metadata=None, **kwargs):
        return self._inner.with_call(*args, metadata=self._merged(metadata), **kwargs)

    def future(self, *args, metadata=None, **kwargs):
        return self._inner.future(*args, metadata=self._merged(metadata), **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class CallerChannel:
    """A gRPC channel (grpc.aio or blocking) whose every call carries the caller's metadata.

    Only the multi-callable factories the stubs use are wrapped; the rest is
    the channel's own. A grpc.aio client interceptor would do the same but
    adds tasks per streamed message, which the hot-path streams cannot afford.
    """

    def __init__(self, channel, caller: ClientCaller):
        self._channel = channel
        self._caller = caller

    def unary_unary(self, *args, **kwargs):
        return _CallerMetadata(self._channel.unary_unary(*args, **kwargs), self._caller)

    def unary_stream(self, *args, **kwargs):
        return _CallerMetadata(self._channel.unary_stream(*args, **kwargs), self._caller)

    def stream_unary(self, *args, **kwargs):
        return _CallerMetadata(self._channel.stream_unary(*args, **kwargs), self._caller)

    def stream_stream(self, *args, **kwargs):
        return _CallerMetadata(self._channel.stream_stream(*args, **kwargs), self._caller)

    def __getattr__(self, name):
        return getattr(self._channel, name)

    def __enter__(self):
        self._channel.__enter__()
        return self

    def __exit__(self, *exc):
        return self._channel.__exit__(*exc)

    async def __aenter__(self):
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self._channel.__aexit__(*exc)


class _Renewed:
    """A multi-callable bound to the channel of its :class:`RenewingChannel`'s current certificate; bound again
    when that changes (an int compare per call or stream started, nothing per message)."""

    __slots__ = ("_owner", "_kind", "_args", "_kwargs", "_inner", "_generation")

    def __init__(self, owner: RenewingChannel, kind: str, args, kwargs):
        self._owner, self._kind, self._args, self._kwargs = owner, kind, args, kwargs
        self._generation = -1
        self._inner = None

    def _current(self):
        owner = self._owner
        if self._generation != owner.watch.generation:
            channel, self._generation = owner.current()
            self._inner = getattr(channel, self._kind)(*self._args, **self._kwargs)
        return self._inner

    def __call__(self, *args, **kwargs):
        return self._current()(*args, **kwargs)

    def with_call(self, *args, **kwargs):
        return self._current().with_call(*args, **kwargs)

    def future(self, *args, **kwargs):
        return self._current().future(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._current(), name)


class RenewingChannel:
    """A TLS channel (grpc.aio or blocking) that follows its certificate files (:mod:`aiworks.security.cert_watch`).

    gRPC's channel credentials are fixed when the channel is made, so a renewed
    certificate needs a new channel: calls started after the change go on one
    made from the new files, while the calls and streams already open finish
    on the old one, which stays open until this channel is closed.
    """

    def __init__(self, make, tls: TLSFiles):
        from aiworks.security.cert_watch import certificate_watch

        self.watch = certificate_watch(tls)
        self._make = make
        self._generation = self.watch.generation
        self._channel = make()
        self._old: list = []

    def current(self):
        """The channel for the certificate in use, and its generation."""
        generation = self.watch.generation
        if generation != self._generation:
            self._old.append(self._channel)
            self._channel, self._generation = self._make(), generation
        return self._channel, generation

    def unary_unary(self, *args, **kwargs):
        return _Renewed(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args, **kwargs):
        return _Renewed(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args, **kwargs):
        return _Renewed(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args, **kwargs):
        return _Renewed(self, "stream_stream", args, kwargs)

    def __getattr__(self, name):  # get_state, channel_ready, wait_for_state_change, subscribe ...
        return getattr(self.current()[0], name)

    def _all(self) -> list:
        channels, self._old = [*self._old, self._channel], []
        return channels

    def close(self, grace: float | None = None):
        channels = self._all()
        if isinstance(channels[-1], grpc.aio.Channel):

            async def close_all() -> None:
                for channel in channels:
                    await channel.close(grace)

            return close_all()
        for channel in channels:
            channel.close()
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
        return False


def tls_options(address: str, server_name: str | None) -> list[tuple[str, Any]]:
    """The name a TLS channel checks the server's certificate against: ``server_name`` when given.

    Without it the host in ``address`` is checked, as usual. With it, a peer
    dialled by IP (a runtime's advertised ``127.0.0.1:8020``, a pod IP) or by a
    replica's own DNS name (``runtime-1``) still verifies as the service it is.
    """
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


# Who this process is, for code its service's main cannot hand the files to.
_process_tls: TLSFiles | None = None


def use_process_tls(files: TLSFiles | None) -> None:
    """Record this process's TLS files (its service's ``tls_files()``), once, in its main."""
    global _process_tls
    _process_tls = files


def process_tls() -> TLSFiles | None:
    """The TLS files :func:`use_process_tls` recorded; ``None`` (plaintext) unless it was called."""
    return _process_tls


_process_caller: ClientCaller | None = None


def use_process_caller(caller: ClientCaller | None) -> None:
    """Record the caller this process presents on plaintext channels (its service's token), once, in its main."""
    global _process_caller
    _process_caller = caller


def process_caller() -> ClientCaller | None:
    """The caller :func:`use_process_caller` recorded; ``None`` (no metadata) unless it was called."""
    return _process_caller


def handle_errors(method):
    """Map exceptions raised by an async servicer method to gRPC statuses."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except AIWorksError as exc:
            if exc.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", str(int(max(1, exc.retry_after_s)))),))
            await context.abort(exc.status.grpc_code, exc.message)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a bug: say so, keep serving
            log.exception("unhandled error in %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    return wrapper
