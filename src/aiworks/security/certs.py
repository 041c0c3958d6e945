"""A local certificate authority and the certificates the services present.

``aiworks certs`` is the embedded answer to Istio's mTLS: one CA per
installation, one certificate per service. Keys are ECDSA P-256 because every
TLS stack the suite touches accepts it (gRPC's BoringSSL, Python's OpenSSL,
Envoy, curl, browsers); Ed25519 certificates are still refused by several of
them. Each service folder holds ``tls.crt``, ``tls.key`` and ``ca.crt``, the
names of a Kubernetes TLS secret with cert-manager's CA key, so one folder
mounts as one secret.

The CA is reused when it exists: reissuing it would invalidate every
certificate already handed out. ``force=True`` replaces it. Leaf certificates
are reissued on every run, which is harmless (same CA) and picks up new
hostnames. Private keys are written mode 0600 through a temporary file and a
rename, so a reader never sees a half-written or briefly world-readable key.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from aiworks.core.errors import AIWorksError, InvalidArgument, Status

DEFAULT_HOSTNAMES = ("localhost", "127.0.0.1")
SERVICES = ("gateway", "scheduler", "runtime", "cache", "monitor")
CA_VALID_DAYS = 3650
LEAF_VALID_DAYS = 825  # the longest lifetime Apple's and the CA/B forum's clients accept for a leaf

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
TLS_CERT = "tls.crt"
TLS_KEY = "tls.key"


class CertificateError(AIWorksError):
    """A CA or certificate file cannot be used as it is."""

    status = Status.FAILED_PRECONDITION


def write_private_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` with ``mode`` from the first byte on, replacing it atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it; never widened
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_private_file(path, pem, 0o600)


def _write_certs(path: Path, certs: Iterable[x509.Certificate]) -> None:
    write_private_file(path, b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs), 0o644)


def subject_alternative_names(hostnames: Iterable[str]) -> list[x509.GeneralName]:
    """DNS names and IP addresses for a SAN extension; IPs become IPAddress entries, as TLS clients require."""
    names: list[x509.GeneralName] = []
    for raw in hostnames:
        host = raw.strip()
        if not host:
            continue
        try:
            entry: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            if any(c.isspace() or c in "/:@" for c in host):
                raise InvalidArgument(f"{host!r} is neither a hostname nor an IP address") from None
            entry = x509.DNSName(host)
        if entry not in names:
            names.append(entry)
    if not names:
        raise InvalidArgument("a certificate needs at least one hostname or IP address")
    return names


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA certificate and its key, able to issue service certificates."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, common_name: str = "AIWorks local CA", valid_days: int = CA_VALID_DAYS) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "AIWorks"),
                x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            ]
        )
        now = _now()
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=valid_days))
            # path_length=0: this CA signs leaves only, never another CA.
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        try:
            cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
        except FileNotFoundError:
            raise CertificateError(f"CA certificate {cert_path} does not exist") from None
        except ValueError as exc:
            raise CertificateError(f"CA certificate {cert_path} is not a PEM certificate: {exc}") from None
        try:
            key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        except FileNotFoundError:
            raise CertificateError(
                f"CA key {key_path} does not exist next to {cert_path}: new certificates cannot be signed "
                "(restore the key, or pass --force to create a new CA and reissue every certificate)"
            ) from None
        except (ValueError, TypeError) as exc:
            raise CertificateError(f"CA key {key_path} is not an unencrypted PEM private key: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
            raise CertificateError(f"CA key {key_path} does not belong to the CA certificate {cert_path}")
        return cls(cert, key)

    def save(self, cert_path: Path, key_path: Path) -> None:
        _write_key(Path(key_path), self.key)
        _write_certs(Path(cert_path), [self.cert])

    def issue(
        self,
        common_name: str,
        hostnames: Sequence[str],
        *,
        valid_days: int = LEAF_VALID_DAYS,
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        """A certificate for ``common_name`` valid for ``hostnames``, usable as TLS server and client."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        ca_ski = self.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "AIWorks"),
                        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                    ]
                )
            )
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=valid_days), self.cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            # Every service both serves and calls its peers, so one certificate does both.
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(subject_alternative_names(hostnames)), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert, key


def load_or_create_ca(
    ca_dir: Path, *, force: bool = False, common_name: str = "AIWorks local CA"
) -> tuple[CertificateAuthority, bool]:
    """The CA in ``ca_dir`` (``ca.crt`` + ``ca.key``), created when missing or when ``force``; and whether it is new."""
    cert_path, key_path = Path(ca_dir) / CA_CERT, Path(ca_dir) / CA_KEY
    if not force and (cert_path.exists() or key_path.exists()):
        if not cert_path.exists():
            raise CertificateError(
                f"{key_path} exists without {cert_path}; pass --force to create a new CA and reissue every certificate"
            )
        return CertificateAuthority.load(cert_path, key_path), False
    ca = CertificateAuthority.create(common_name)
    ca.save(cert_path, key_path)
    return ca, True


@dataclass
class IssuedCertificates:
    """What :func:`write_certificates` wrote."""

    ca_cert: Path
    ca_created: bool
    server_dir: Path
    service_dirs: dict[str, Path] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [f"CA {'created' if self.ca_created else 'reused'}: {self.ca_cert}"]
        lines.append(f"server certificate: {self.server_dir / TLS_CERT} (key {self.server_dir / TLS_KEY}, mode 0600)")
        for svc, folder in self.service_dirs.items():
            lines.append(f"{svc}: {folder / TLS_CERT}, {folder / TLS_KEY}, {folder / CA_CERT}")
        return "\n".join(lines)


def write_leaf(ca: CertificateAuthority, folder: Path, common_name: str, hostnames: Sequence[str]) -> Path:
    """Issue a certificate and write ``folder``/tls.crt, tls.key (0600) and ca.crt."""
    cert, key = ca.issue(common_name, hostnames)
    folder.mkdir(parents=True, exist_ok=True)
    _write_key(folder / TLS_KEY, key)
    _write_certs(folder / TLS_CERT, [cert])
    _write_certs(folder / CA_CERT, [ca.cert])
    return folder


def write_certificates(
    out_dir: Path,
    hostnames: Sequence[str] = DEFAULT_HOSTNAMES,
    services: Sequence[str] = (),
    *,
    ca_dir: Path | None = None,
    force: bool = False,
) -> IssuedCertificates:
    """Write the CA (unless it exists), ``out_dir``/tls.crt + tls.key + ca.crt, and one folder per service.

    Each service certificate is valid for ``hostnames`` plus the service's own
    name, which is its DNS name under docker compose.
    """
    out_dir = Path(out_dir)
    unknown = [s for s in services if not s or "/" in s or s.startswith(".")]
    if unknown:
        raise InvalidArgument(f"service names must be plain folder names, got {unknown}")
    subject_alternative_names(hostnames)  # fail before touching the disk
    ca, created = load_or_create_ca(Path(ca_dir) if ca_dir else out_dir, force=force)
    write_leaf(ca, out_dir, hostnames[0], hostnames)
    result = IssuedCertificates(
        ca_cert=(Path(ca_dir) if ca_dir else out_dir) / CA_CERT, ca_created=created, server_dir=out_dir
    )
    for svc in services:
        result.service_dirs[svc] = write_leaf(ca, out_dir / svc, svc, [*hostnames, svc])
    return result
