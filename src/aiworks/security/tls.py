"""TLS and mutual TLS for the services' gRPC servers, their channels, and the gateway's HTTP.

A service gets three paths (certificate, key, CA) from its Settings object
(``AIWORKS_<SVC>_TLS_CERT`` / ``_TLS_KEY`` / ``_TLS_CA``) and turns them into
:class:`TLSFiles` with :func:`tls_files`, which returns ``None`` when none is
set (plaintext, the embedded default) and fails at start-up, naming the
missing variable, when only some are. Internal gRPC servers then *require* a
client certificate signed by the CA: that is what makes the mesh mutual, and
what Istio's PeerAuthentication STRICT does at scale.

A renewed certificate is taken without a restart: servers and channels follow
the files through :mod:`aiworks.security.cert_watch`.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509

from aiworks.core.errors import InvalidArgument
from aiworks.security.cert_watch import Material, certificate_watch
from aiworks.security.certs import CA_CERT, TLS_CERT, TLS_KEY

log = logging.getLogger(__name__)


def read_pem(path: Path | None, what: str) -> bytes:
    """A PEM file's bytes, or an error naming the file and what is wrong with it."""
    if path is None:
        raise InvalidArgument(f"no TLS {what} file is configured, and mutual TLS needs one")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise InvalidArgument(f"TLS {what} file {path} does not exist (create it with `aiworks certs`)") from None
    except PermissionError:
        raise InvalidArgument(f"TLS {what} file {path} is not readable by this process") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"TLS {what} file {path} is not PEM")
    return data


@dataclass(frozen=True)
class TLSFiles:
    """A PEM certificate, its private key and the CA that signs the peers' certificates."""

    cert: Path
    key: Path
    ca: Path | None = None
    reload_s: float = 10.0  # how often the files are checked for a renewal (0: read once, at start-up)

    @classmethod
    def from_dir(cls, folder: Path | str, reload_s: float = 10.0) -> TLSFiles:
        """``folder``/tls.crt, tls.key and ca.crt, as ``aiworks certs`` writes them."""
        folder = Path(folder)
        return cls(folder / TLS_CERT, folder / TLS_KEY, folder / CA_CERT, reload_s)

    def cert_pem(self) -> bytes:
        return read_pem(self.cert, "certificate")

    def key_pem(self) -> bytes:
        return read_pem(self.key, "key")

    def ca_pem(self) -> bytes:
        return read_pem(self.ca, "CA certificate")


def tls_files(
    cert: str | Path | None, key: str | Path | None, ca: str | Path | None, *, env_prefix: str, reload_s: float = 10.0
) -> TLSFiles | None:
    """The TLS files from a service's settings, ``None`` when TLS is off.

    ``env_prefix`` (``AIWORKS_SCHEDULER_``) names the variables in the error
    raised when the certificate and key are not set together.
    """
    if not cert and not key and not ca:
        return None
    if not cert or not key:
        missing = [f"{env_prefix}TLS_{n}" for n, v in (("CERT", cert), ("KEY", key)) if not v]
        raise InvalidArgument(f"TLS needs both a certificate and a key; set {' and '.join(missing)}")
    return TLSFiles(Path(cert), Path(key), Path(ca) if ca else None, reload_s)


TLS_DIR_ENV = "AIWORKS_TLS_DIR"


def tool_tls(tls_dir: str | Path | None = None, environ: Mapping[str, str] | None = None) -> TLSFiles | None:
    """A command-line tool's client files: ``tls_dir``, else ``$AIWORKS_TLS_DIR``; ``None`` (plaintext) without either.

    The folder holds ``tls.crt``, ``tls.key`` and ``ca.crt`` (``.aiworks/certs/admin`` under ``aiworks up --tls``).
    """
    folder = tls_dir or (os.environ if environ is None else environ).get(TLS_DIR_ENV)
    if not folder:
        return None
    files = TLSFiles.from_dir(folder)
    missing = [p.name for p in (files.cert, files.key, files.ca) if not p.is_file()]
    if missing:
        raise InvalidArgument(
            f"TLS folder {folder} has no {', '.join(missing)}: point --tls-dir or {TLS_DIR_ENV} at a folder "
            "from `aiworks certs` (for `aiworks up --tls`: .aiworks/certs/admin)"
        )
    return files


# ---- gRPC --------------------------------------------------------------------------------------


def server_credentials(files: TLSFiles, *, require_client_cert: bool = True) -> grpc.ServerCredentials:
    """Credentials for ``server.add_secure_port``: mutual TLS against ``files.ca`` by default.

    With ``require_client_cert`` the handshake fails for a client that sends no
    certificate or one the CA did not sign, before any RPC runs. A renewed
    certificate (or CA) is taken at the next handshake after the watch saw it.
    """
    if require_client_cert and not files.ca:
        files.ca_pem()  # the error naming the missing CA
    watch = certificate_watch(files)
    served = [watch.generation]

    def configuration(material: Material) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(material.key, material.cert)], material.ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:  # gRPC calls it at each handshake
        if served[0] == watch.generation:
            return None
        served[0] = watch.generation
        return configuration(watch.material)

    return grpc.dynamic_ssl_server_credentials(
        configuration(watch.material), fetch, require_client_authentication=require_client_cert
    )


def channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials:
    """Credentials for a client: trust only ``files.ca``, present ``files.cert`` (as the files are now)."""
    material = certificate_watch(files).material
    if material.ca is None:
        files.ca_pem()  # the error naming the missing CA
    return grpc.ssl_channel_credentials(
        root_certificates=material.ca, private_key=material.key, certificate_chain=material.cert
    )


def secure_channel(
    address: str,
    files: TLSFiles,
    options: Sequence[tuple[str, Any]] = (),
    *,
    server_name: str | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel over mutual TLS.

    ``server_name`` is the name checked against the server certificate when it
    differs from the host in ``address`` (a service reached by IP whose
    certificate names it ``scheduler``).
    """
    opts = list(options)
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(address, channel_credentials(files), options=opts)


def peer_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The common name of the client certificate behind an RPC (``gateway``), ``None`` without mTLS."""
    auth = context.auth_context() or {}
    names = auth.get("x509_common_name") or []
    return names[0].decode() if names else None


# ---- HTTP (uvicorn) ----------------------------------------------------------------------------


def http_ssl_context(files: TLSFiles, *, require_client_cert: bool = False) -> ssl.SSLContext:
    """A server-side SSLContext: TLS 1.2 or later, client certificates checked against the CA when given.

    The gateway's public HTTP usually authenticates tenants with tokens, so
    client certificates are optional there unless ``require_client_cert``.
    A renewed certificate is taken at the next handshake after the watch saw
    it: the context's SNI callback (which OpenSSL runs for every ClientHello,
    with or without a server name) moves the connection to a context made
    from the new files.
    """
    watch = certificate_watch(files)
    ctx = _server_context(files, require_client_cert)
    current = {watch.generation: ctx}

    def renewed(conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _ctx: ssl.SSLContext) -> None:
        generation = watch.generation
        if generation not in current:
            try:
                current.clear()
                current[generation] = _server_context(files, require_client_cert)
            except InvalidArgument as exc:  # changed again since the watch read it: this handshake keeps ctx
                log.warning("HTTPS keeps its certificate for now: %s", exc)
                return
        if current[generation] is not ctx:
            conn.context = current[generation]

    ctx.sni_callback = renewed
    return ctx


def _server_context(files: TLSFiles, require_client_cert: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, files)
    if files.ca:
        ctx.load_verify_locations(cadata=files.ca_pem().decode())
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    elif require_client_cert:
        raise InvalidArgument("client certificates are required but no CA file is configured to check them")
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def client_ssl_context(files: TLSFiles | None = None, *, ca: Path | None = None) -> ssl.SSLContext:
    """A client-side SSLContext trusting the CA (``files.ca`` or ``ca``), presenting ``files.cert`` if given."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca_path = ca or (files.ca if files else None)
    if ca_path is None:
        raise InvalidArgument("a client TLS context needs the CA certificate that signed the server")
    ctx.load_verify_locations(cadata=read_pem(Path(ca_path), "CA certificate").decode())
    if files is not None:
        _load_chain(ctx, files)
    return ctx


def _load_chain(ctx: ssl.SSLContext, files: TLSFiles) -> None:
    files.cert_pem()  # clear errors for missing files before OpenSSL's terse ones
    files.key_pem()
    try:
        ctx.load_cert_chain(str(files.cert), str(files.key))
    except ssl.SSLError as exc:
        raise InvalidArgument(f"TLS key {files.key} does not match certificate {files.cert}: {exc}") from None


def uvicorn_ssl_options(files: TLSFiles, *, require_client_cert: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that serve HTTPS with :func:`http_ssl_context`."""

    def factory(config: Any, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        return http_ssl_context(files, require_client_cert=require_client_cert)

    http_ssl_context(files, require_client_cert=require_client_cert)  # fail at start-up, not at bind
    return {"ssl_context_factory": factory}


def certificate_names(path: Path) -> list[str]:
    """The DNS names and IP addresses a PEM certificate is valid for (for status pages and errors)."""
    cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(v) for v in san.get_values_for_type(x509.DNSName) + san.get_values_for_type(x509.IPAddress)]
