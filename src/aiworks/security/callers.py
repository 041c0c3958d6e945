"""Who is calling an internal service, and whether that caller may call this method.

Callers are names: ``gateway``, ``scheduler``, ``runtime``, ``cache``,
``monitor``, ``admin`` (the CLI, an operator) and ``supervisor`` (``aiworks
up``'s health checks). A server learns the name from the first source that
its settings turn on, in this order:

1. mutual TLS: the common name of the client certificate (``aiworks certs``
   issues one per name), which the handshake already proved;
2. a service mesh doing the mutual TLS (``mesh_mtls``, Istio STRICT): the
   ``URI=spiffe://<domain>/ns/<namespace>/sa/<account>`` of the last element of
   the ``x-forwarded-client-cert`` metadata, which the server's own sidecar
   appends; the account must end with ``-<name>`` and live in the server's own
   trust domain and namespace (the element's ``By=``);
3. plaintext on loopback: ``x-aiworks-caller: <name>`` with
   ``x-aiworks-caller-token: <hex HMAC-SHA256(secret, name)>``, the secret being
   the installation's 0600 ``internal_token_file`` (``aiworks up`` makes it): a
   ring (:mod:`aiworks.security.keyring`) whose first line's token clients present
   and any line's servers accept, re-read every ``internal_token_reload_s``;
4. ``insecure``: nobody is checked (logged as a warning at start-up).

:class:`CallerCheck` is the one grpc.aio server interceptor that applies a
service's table (method -> callers allowed, kept next to each servicer). It
runs once per call, so once per stream on the long-lived hot-path streams,
and adds nothing per message. Clients attach their metadata where channels
are made (:mod:`aiworks.core.rpc`). The HTTP control APIs (the supervisor's,
the monitor's) take the same credential as ``Authorization: Bearer
<name>.<token>``. Errors name the caller and the method, never a token.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import ipaddress
import logging
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from pathlib import Path

import grpc

from aiworks.core.errors import AIWorksError, InvalidArgument, PermissionDenied, Status, Unauthenticated
from aiworks.security.mesh_identity import mesh_peer

log = logging.getLogger(__name__)

CALLERS = ("gateway", "scheduler", "runtime", "cache", "monitor", "admin", "supervisor")
ANY_CALLER = frozenset(CALLERS)
CALLER_HEADER = "x-aiworks-caller"
TOKEN_HEADER = "x-aiworks-caller-token"
XFCC_HEADER = "x-forwarded-client-cert"
# The command-line tools' token file: this variable, else DEFAULT_TOKEN_FILE when it exists.
TOKEN_FILE_ENV = "AIWORKS_INTERNAL_TOKEN_FILE"
DEFAULT_TOKEN_FILE = Path(".aiworks/internal-token")
_SECRET_BYTES = 32
REFUSAL_LOG_INTERVAL_S = 10.0
_CURRENT: ContextVar[str | None] = ContextVar("aiworks_caller", default=None)


def current_caller() -> str | None:
    """The checked caller of the call being served (for audit lines); ``None`` outside one or when insecure."""
    return _CURRENT.get()


# ---- the secret and the tokens derived from it --------------------------------------------------


def caller_token(secret: bytes, name: str) -> str:
    """The token that proves ``name``: hex HMAC-SHA256 of the name under the installation's secret."""
    return hmac.new(secret, name.encode(), hashlib.sha256).hexdigest()


def token_key_id(secret: bytes) -> str:
    """A secret's id for logs and the ``aiworks_internal_token_info`` gauge: 8 hex digits of a hash, not the key."""
    return hashlib.sha256(b"aiworks internal token id\0" + secret).hexdigest()[:8]


def parse_ring(data: bytes, where: str) -> list[bytes]:
    """The ring in a secret file's bytes: its non-blank lines, stripped, first the current; duplicates once."""
    keys: list[bytes] = []
    for number, line in enumerate(data.splitlines(), 1):
        key = line.strip()
        if not key:
            continue
        if len(key) < 16:
            raise InvalidArgument(f"{where}: line {number} holds {len(key)} bytes; each key needs at least 16")
        if key not in keys:
            keys.append(key)
    if not keys:
        raise InvalidArgument(f"{where} holds no key")
    return keys


def read_secrets(path: Path | str, what: str = "internal token file",
                 maker: str = "`aiworks up` or `aiworks certs --internal-token FILE`") -> list[bytes]:  # fmt: skip
    """The ring of secrets in ``path`` (one a line, the current first); an error naming the file otherwise."""
    return parse_ring(read_secret(path, what, maker), f"{what} {path}")


def read_secret(path: Path | str, what: str = "internal token file",
                maker: str = "`aiworks up` or `aiworks certs --internal-token FILE`") -> bytes:  # fmt: skip
    """The secret in ``path`` (surrounding whitespace dropped); an error naming the file (and ``maker``, what
    makes one) otherwise."""
    path = Path(path)
    try:
        data = path.read_bytes().strip()
    except FileNotFoundError:
        raise InvalidArgument(f"{what} {path} does not exist ({maker} makes one)") from None
    except PermissionError:
        raise InvalidArgument(f"{what} {path} is not readable by this process") from None
    except IsADirectoryError:
        raise InvalidArgument(f"{what} {path} is a folder, not a file") from None
    if len(data) < 16:
        raise InvalidArgument(f"{what} {path} holds {len(data)} bytes; a secret needs at least 16")
    if path.stat().st_mode & 0o004:
        log.warning("%s %s is readable by every user of this machine; make it mode 0600", what, path)
    return data


def ensure_secret_file(path: Path | str) -> bytes:
    """The secret in ``path``, created first (random, mode 0600) when the file does not exist.

    Creation writes a temporary file and hard-links it into place, so two
    processes racing to create it end up reading the same secret, and no
    reader ever sees a half-written one.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secrets.token_hex(_SECRET_BYTES).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        finally:
            tmp.unlink(missing_ok=True)
    return read_secret(path)


class ClientCaller:
    """A name and its token (the ring's first secret's), as a client presents them (metadata on gRPC, a bearer
    token on HTTP); channels read :meth:`metadata` at each call, so :meth:`reload` reaches the calls after it."""

    __slots__ = ("name", "token", "key_ids", "refresh", "_pairs")

    def __init__(self, name: str, token: str, key_ids: tuple[str, ...] = ()):
        self.name, self.key_ids, self.refresh = name, key_ids, None  # refresh: a KeyFileWatch's, unused by clients
        self._set(token)

    def _set(self, token: str) -> None:
        self.token = token
        self._pairs = ((CALLER_HEADER, self.name), (TOKEN_HEADER, token))

    @classmethod
    def from_secret(cls, name: str, secret: bytes | list[bytes]) -> ClientCaller:
        if name not in CALLERS:
            raise InvalidArgument(f"unknown caller {name!r}; callers are {', '.join(CALLERS)}")
        ring = [secret] if isinstance(secret, bytes) else list(secret)
        return cls(name, caller_token(ring[0], name), tuple(token_key_id(k) for k in ring))

    @classmethod
    def from_file(cls, name: str, path: Path | str) -> ClientCaller:
        return cls.from_secret(name, read_secrets(path))

    def reload(self, keys: list[bytes]) -> None:
        """Present the token of ``keys[0]`` from now on."""
        self.key_ids = tuple(token_key_id(k) for k in keys)
        self._set(caller_token(keys[0], self.name))

    def describe_keys(self) -> str:
        ids = self.key_ids or ("-",)
        also = f" (the file also holds {', '.join(ids[1:])})" if len(ids) > 1 else ""
        return f"internal token id {ids[0]} presented as {self.name}{also}"

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._pairs

    def bearer(self) -> str:
        """The ``Authorization`` header value for the HTTP control APIs."""
        return f"Bearer {self.name}.{self.token}"

    def __repr__(self) -> str:  # never print the token
        return f"ClientCaller({self.name!r})"


def tool_caller(environ: Mapping[str, str] | None = None) -> ClientCaller | None:
    """The command-line tools' identity, ``admin``: from ``$AIWORKS_INTERNAL_TOKEN_FILE``, else
    ``.aiworks/internal-token`` when it exists (``aiworks up`` run from this folder); ``None`` without either."""
    env = os.environ if environ is None else environ
    path = env.get(TOKEN_FILE_ENV) or (DEFAULT_TOKEN_FILE if DEFAULT_TOKEN_FILE.is_file() else None)
    return ClientCaller.from_file("admin", path) if path else None


# ---- the mesh's x-forwarded-client-cert (parsed in aiworks.security.mesh_identity) ---------------


def mesh_caller(xfcc: str) -> str:
    """The caller named by the last ``x-forwarded-client-cert`` element; UNAUTHENTICATED when it names none of ours."""
    peer = mesh_peer(xfcc)
    for name in CALLERS:
        if peer.service_account.endswith(f"-{name}"):
            return name
    raise Unauthenticated(
        f"service account {peer.service_account!r} names no caller (it must end with -{'/-'.join(CALLERS)})"
    )


# ---- the server side ----------------------------------------------------------------------------


class CallerAuth:
    """How one server tells its callers apart; built once at start-up from the service's settings."""

    def __init__(self, *, mtls: bool = False, mesh: bool = False, secret: bytes | list[bytes] | None = None,
                 insecure: bool = False):  # fmt: skip
        self.mtls, self.mesh, self.insecure = mtls, mesh, insecure
        self._tokens: dict[str, tuple[bytes, ...]] = {}
        self.key_ids: tuple[str, ...] = ()
        self.refresh = None  # set by a KeyFileWatch: read the token file now (a token of a secret not held yet)
        if secret:
            self.reload([secret] if isinstance(secret, bytes) else list(secret))

    def reload(self, keys: list[bytes]) -> None:
        """Accept the tokens of every secret of ``keys`` from now on (a rotation, taken in place)."""
        self._tokens = {name: tuple(caller_token(k, name).encode() for k in keys) for name in CALLERS}
        self.key_ids = tuple(token_key_id(k) for k in keys)

    def describe_keys(self) -> str:
        ids = self.key_ids or ("-",)
        return f"internal token ids {ids[0]} (current)" + "".join(f", {i} (accepted)" for i in ids[1:])

    def _verifies(self, name: str, token: bytes) -> bool:
        matched = False
        for expected in self._tokens.get(name, ()):  # each compared in constant time; at most a few
            matched |= hmac.compare_digest(expected, token)
        return matched

    @property
    def modes(self) -> list[str]:
        found = [
            m for m, on in (("mutual TLS", self.mtls), ("mesh mTLS", self.mesh), ("token", bool(self._tokens))) if on
        ]
        return found + (["INSECURE: callers unchecked"] if self.insecure else [])

    @property
    def describe(self) -> str:
        """The sources in use, for start-up logs and status pages (``mutual TLS, token``)."""
        return ", ".join(self.modes) or "none"

    def _token_caller(self, name: str | None, token: str | None) -> str:
        if not self._tokens:
            raise Unauthenticated(f"caller tokens are not accepted here (callers: {self.describe})")
        if (name or "") not in self._tokens:  # not echoed: a bearer header may carry some other secret there
            raise Unauthenticated(f"the caller named is none of {', '.join(CALLERS)}")
        presented = (token or "").encode("utf-8", "replace")
        if self._verifies(name, presented):
            return name
        # Perhaps a secret this process has not read yet (a rotation another process took first): read the file
        # now (at most once a second) before refusing.
        if self.refresh is not None and self.refresh() and self._verifies(name, presented):
            return name
        raise Unauthenticated(f"the token presented for caller {name!r} does not verify")

    def identify(self, metadata: Iterable[tuple[str, str]], common_name: str | None) -> str:
        """The caller's name from a call's client certificate and metadata; UNAUTHENTICATED when none proves one."""
        if self.mtls and common_name:
            return common_name
        values = {}
        for key, value in metadata or ():
            if key in (CALLER_HEADER, TOKEN_HEADER, XFCC_HEADER):
                values[key] = value
        if self.mesh and XFCC_HEADER in values:
            return mesh_caller(values[XFCC_HEADER])
        if CALLER_HEADER in values or TOKEN_HEADER in values:
            return self._token_caller(values.get(CALLER_HEADER), values.get(TOKEN_HEADER))
        raise Unauthenticated(f"no caller credentials (this service checks callers by {self.describe})")

    def identify_bearer(self, authorization: str | None) -> str:
        """The caller behind ``Authorization: Bearer <name>.<token>`` (the HTTP control APIs)."""
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        if not authorization:
            raise Unauthenticated("credentials required: send 'Authorization: Bearer <caller>.<token>'")
        if scheme.lower() != "bearer":
            raise Unauthenticated("only 'Authorization: Bearer <caller>.<token>' is accepted")
        name, _, token = credentials.strip().partition(".")
        return self._token_caller(name, token)


def check_allowed(caller: str, allowed: frozenset[str], what: str) -> None:
    """PERMISSION_DENIED unless ``caller`` is among ``allowed``."""
    if caller not in allowed:
        who = " or ".join(sorted(allowed)) or "no caller"
        raise PermissionDenied(f"caller {caller!r} may not call {what} (allowed: {who})")


def method_table(service, table: Mapping[str, Iterable[str]]) -> dict[str, frozenset[str]]:
    """``/pkg.Service/Method`` -> callers, from a servicer's table by method name; every method of the
    service's descriptor must be listed (a new RPC fails here until someone decides who may call it)."""
    methods = {m.name for m in service.methods}
    missing, unknown = methods - set(table), set(table) - methods
    if missing or unknown:
        raise ValueError(f"{service.full_name}: callers table lacks {sorted(missing)}, names unknown {sorted(unknown)}")
    for name, callers in table.items():
        bad = set(callers) - ANY_CALLER
        if bad:
            raise ValueError(f"{service.full_name}/{name}: unknown caller(s) {sorted(bad)}")
    return {f"/{service.full_name}/{name}": frozenset(callers) for name, callers in table.items()}


class CallerCheck(grpc.aio.ServerInterceptor):
    """Refuses a call unless its caller is allowed by the table; methods outside the table (health) stay open.

    Each method's handler is wrapped once and reused: the check costs one
    identification per call (per stream), nothing per message.
    """

    def __init__(self, auth: CallerAuth, table: Mapping[str, frozenset[str]]):
        self.auth = auth
        self.table = dict(table)
        self._wrapped: dict[str, tuple[object, object]] = {}
        self._refusals: dict[str, tuple[float, int]] = {}  # method -> (last logged, refused since)

    def _log_refusal(self, method: str, peer: str, message: str) -> None:
        """One warning per method per REFUSAL_LOG_INTERVAL_S, so a flood of strangers cannot flood the log."""
        now = time.monotonic()
        last, unlogged = self._refusals.get(method, (-REFUSAL_LOG_INTERVAL_S, 0))
        if now - last < REFUSAL_LOG_INTERVAL_S:
            self._refusals[method] = (last, unlogged + 1)
            return
        self._refusals[method] = (now, 0)
        more = f" ({unlogged} more refused since the last warning)" if unlogged else ""
        log.warning("refused %s from %s: %s%s", method, peer, message, more)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        allowed = self.table.get(method)
        if handler is None or allowed is None or self.auth.insecure:
            return handler
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = (handler, _guarded(handler, self._checker(method, allowed)))
            self._wrapped[method] = cached
        return cached[1]

    def _checker(self, method: str, allowed: frozenset[str]):
        auth = self.auth

        async def check(context) -> None:
            try:
                common_name = None
                if auth.mtls:
                    names = (context.auth_context() or {}).get("x509_common_name") or []
                    common_name = names[0].decode() if names else None
                caller = auth.identify(context.invocation_metadata(), common_name)
                check_allowed(caller, allowed, method)
                _CURRENT.set(caller)
            except AIWorksError as exc:
                self._log_refusal(method, context.peer(), exc.message)
                message = exc.message if method in exc.message else f"{method}: {exc.message}"
                await context.abort(exc.status.grpc_code, message)

        return check


def _guarded(handler, check):
    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    behavior = getattr(handler, kind)
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request, context):
            await check(context)
            async for response in behavior(request, context):
                yield response

        return handler._replace(**{kind: guarded_stream})

    async def guarded(request, context):
        await check(context)
        return await behavior(request, context)

    return handler._replace(**{kind: guarded})


# ---- the HTTP control APIs (the supervisor's, the monitor's) -------------------------------------


def check_control_request(
    auth: CallerAuth | None,
    headers: Mapping[str, str],
    *,
    allowed: frozenset[str],
    what: str,
    body: bool,
    closed_hint: str = "",
) -> str | None:
    """The caller of a control API request, after the checks that keep web pages and strangers out.

    A bearer token (``Authorization: Bearer <caller>.<token>``) naming a caller
    in ``allowed``; with ``body`` (a POST), ``Content-Type: application/json``,
    which no cross-site form or simple fetch can send without a CORS preflight
    that these APIs never grant, and a ``Content-Length`` (no chunked bodies,
    none negative). ``auth`` ``None``: closed (``closed_hint`` says what to set);
    ``auth.insecure``: the caller is not checked (returns ``None``).
    ``headers.get`` must be case-insensitive.
    """
    if auth is None:
        raise Unauthenticated(f"{what} is closed: no token to check callers against{closed_hint}")
    caller = None
    if not auth.insecure:
        caller = auth.identify_bearer(headers.get("Authorization"))
        check_allowed(caller, allowed, what)
    if body:
        media_type = (headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise AIWorksError(
                f"{what} takes JSON only: send 'Content-Type: application/json', not {media_type or 'none'!r}",
                Status.UNSUPPORTED_MEDIA_TYPE,
            )
        if headers.get("Transfer-Encoding"):
            raise AIWorksError(f"{what}: send the body with a Content-Length, not chunked", Status.LENGTH_REQUIRED)
        length = headers.get("Content-Length")
        if length is None:
            raise AIWorksError(f"{what}: a Content-Length header is required", Status.LENGTH_REQUIRED)
        if not (length.strip().isascii() and length.strip().isdigit()):
            raise InvalidArgument(f"{what}: Content-Length must be a whole number of bytes >= 0")
    return caller


# ---- start-up: which sources a service uses, and where it may bind ------------------------------


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a port on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def own_caller(settings, service: str) -> ClientCaller | None:
    """The caller a service presents on plaintext channels (its name and token); exits naming a bad token file."""
    try:
        return settings.client_caller(service)
    except AIWorksError as exc:
        raise SystemExit(f"{service}: {exc}") from None


def server_check(settings, service: str, host: str, descriptor, table: Mapping[str, Iterable[str]]) -> CallerCheck:
    """The :class:`CallerCheck` of an internal service: :func:`server_auth` and the servicer's table."""
    return CallerCheck(server_auth(settings, service, host), method_table(descriptor, table))


def server_auth(settings, service: str, host: str) -> CallerAuth:
    """A service's :class:`CallerAuth` from its settings, checked against the address it binds.

    Refuses (``SystemExit`` with the settings to set) a service with no way to
    tell callers apart, and one bound beyond loopback that would trust a token
    sent in the clear. Logs the sources in use, loudly when ``insecure``.
    """
    prefix = settings.model_config.get("env_prefix", "")
    try:
        tls = settings.tls_files()
        secret = read_secrets(settings.internal_token_file) if settings.internal_token_file else None
    except AIWorksError as exc:
        raise SystemExit(f"{service}: {exc}") from None
    auth = CallerAuth(mtls=tls is not None, mesh=settings.mesh_mtls, secret=secret, insecure=settings.insecure)
    closed = f"mutual TLS ({prefix}TLS_CERT, {prefix}TLS_KEY, {prefix}TLS_CA), {prefix}MESH_MTLS=true behind a mesh"
    if not is_loopback(host) and not (auth.mtls or auth.mesh or auth.insecure):
        raise SystemExit(
            f"{service}: refusing to serve plaintext on {host}, beyond loopback, where anyone on the network could "
            f"call it or read its callers' tokens: set {closed} doing mutual TLS (Istio STRICT), "
            f"or {prefix}INSECURE=true to accept every caller unchecked"
        )
    if not auth.modes:
        raise SystemExit(
            f"{service}: no way to tell its callers apart: set {prefix}INTERNAL_TOKEN_FILE (`aiworks up` makes one), "
            f"{closed}, or {prefix}INSECURE=true to accept every caller unchecked"
        )
    if auth.insecure:
        log.warning(
            "INSECURE: %s accepts every caller on %s without checking who it is (%sINSECURE=true); "
            "anyone who reaches the port may infer, load models or change traffic",
            service, host, prefix,
        )  # fmt: skip
    return auth
