"""Renewed TLS certificates without a restart: a process re-reads its certificate, key and CA files.

cert-manager renews a certificate 30 days before it expires (``renewBefore``
in the chart) and the kubelet swaps the mounted Secret's files in place;
``aiworks certs`` run again on a machine writes new ones over the old. A
process that read its files once would go on presenting the old certificate
until it expires, and then every new connection to it, or from it, fails.

:class:`CertificateWatch` keeps one set of files (:class:`TLSFiles`) in step:
a daemon thread stats the three files every ``files.reload_s`` (10 s by
default, ``AIWORKS_<SVC>_TLS_RELOAD_S``), and when one changed it reads them,
checks that the key belongs to the certificate, and bumps ``generation``. A
set caught half written (the key of one certificate beside another) is
logged and skipped; the files in use stay until a consistent set appears.
The users of a watch only compare ``generation`` with the one they built
from, so nothing on a request's path touches the disk:

- gRPC servers (:func:`aiworks.security.tls.server_credentials`) hand the new
  files to gRPC's certificate fetcher, which runs at each handshake;
- HTTPS servers (:func:`aiworks.security.tls.http_ssl_context`) switch a new
  handshake to a context made from the new files;
- gRPC channels (:func:`aiworks.core.rpc.client_channel`) dial new
  connections with the new files; calls and streams already open finish on
  the connection they have.

The gauge ``aiworks_tls_certificate_expiry_timestamp_seconds{common_name}``
shows when the certificate in use expires, and the alert
``AIWorksCertificateExpiresSoon`` fires when it is 14 days or less away: a
renewal that did not happen, or was not taken.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_private_key

from aiworks.core.errors import InvalidArgument
from aiworks.core.metrics import TLS_CERT_EXPIRY

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Material:
    """One consistent set of PEM bytes, and the facts about the certificate that logs and the gauge show."""

    key: bytes
    cert: bytes
    ca: bytes | None
    serial: int
    common_name: str
    not_after: float  # POSIX seconds


def read_material(files) -> Material:
    """The files' bytes, checked: PEM, and the key the certificate's. Raises :class:`InvalidArgument` saying what
    is wrong (missing, unreadable, not PEM, or a key of another certificate)."""
    cert, key = files.cert_pem(), files.key_pem()
    ca = files.ca_pem() if files.ca else None
    try:
        parsed = x509.load_pem_x509_certificate(cert)
        private = load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"TLS certificate {files.cert} or key {files.key} cannot be parsed: {exc}") from None
    spki = (Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    if private.public_key().public_bytes(*spki) != parsed.public_key().public_bytes(*spki):
        raise InvalidArgument(f"TLS key {files.key} does not match certificate {files.cert}")
    names = parsed.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return Material(key, cert, ca, parsed.serial_number, str(names[0].value) if names else "",
                    parsed.not_valid_after_utc.timestamp())  # fmt: skip


def _stamp(files) -> tuple:
    """What changes when any of the files is replaced: its inode (the kubelet's swap), size and mtime."""
    out = []
    for path in (files.cert, files.key, files.ca):
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        out.append((st.st_ino, st.st_size, st.st_mtime_ns) if st else None)
    return tuple(out)


class CertificateWatch:
    """One set of TLS files, re-read when they change (see the module's text). ``material`` is the set in use,
    ``generation`` counts the changes taken (0 at start)."""

    def __init__(self, files):
        self.files = files
        self._lock = threading.Lock()
        self._stamp = _stamp(files)
        self.material = read_material(files)  # at start-up an unusable set is an error, as before
        self.generation = 0
        self._failure = ""
        self._publish(None)
        if files.reload_s > 0:
            threading.Thread(target=self._run, name=f"tls-watch {files.cert}", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.files.reload_s)
            try:
                self.check()
            except Exception:  # never let the watch die: the files in use stay
                log.exception("checking TLS files %s failed", self.files.cert)

    def check(self) -> bool:
        """Take the files if they changed and are usable; whether a new set was taken."""
        with self._lock:
            stamp = _stamp(self.files)
            if stamp == self._stamp:
                return False
            self._stamp = stamp
            try:
                material = read_material(self.files)
            except InvalidArgument as exc:
                # Retried when a file changes again (the rest of a half-written set lands).
                if str(exc) != self._failure:
                    log.error("TLS files changed but cannot be used (%s); still presenting certificate serial "
                              "%x", exc, self.material.serial)  # fmt: skip
                self._failure = str(exc)
                return False
            self._failure = ""
            if (material.key, material.cert, material.ca) == (self.material.key, self.material.cert, self.material.ca):
                return False
            old, self.material = self.material, material
            self.generation += 1
            self._publish(old)
        log.info("TLS files changed: now certificate serial %x for %s, valid until %s (was serial %x); new "
                 "connections use it, open ones keep theirs", material.serial, material.common_name or "?",
                 _when(material.not_after), old.serial)  # fmt: skip
        return True

    def _publish(self, old: Material | None) -> None:
        if old is not None and old.common_name != self.material.common_name:
            try:
                TLS_CERT_EXPIRY.remove(old.common_name)
            except KeyError:
                pass
        TLS_CERT_EXPIRY.labels(common_name=self.material.common_name).set(self.material.not_after)


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


_watches: dict[tuple, CertificateWatch] = {}
_watches_lock = threading.Lock()


def certificate_watch(files) -> CertificateWatch:
    """The process's one watch of ``files`` (servers and channels of one process share it, and its thread)."""
    key = (Path(files.cert).absolute(), Path(files.key).absolute(),
           Path(files.ca).absolute() if files.ca else None, files.reload_s)  # fmt: skip
    with _watches_lock:
        watch = _watches.get(key)
        if watch is None:
            return _watches.setdefault(key, CertificateWatch(files))
    watch.check()  # what is built now starts from the files as they are
    return watch
