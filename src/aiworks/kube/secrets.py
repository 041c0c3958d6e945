"""What the chart's install hook makes: the services' certificates, the first API key and Redis's password.

Run as ``aiworks kube ensure-secrets`` in a pre-install/pre-upgrade hook Job,
before any workload starts. Every step is idempotent: a Secret that exists
and still fits is kept, so upgrades change nothing unless something is
missing, about to expire, or must now name more hosts. Keys and passwords
are generated here and written only to Secrets, never to logs.

Secrets, for a release whose full name is ``P``:

- ``P-ca``: the release's CA (``tls.crt``, ``tls.key``); only this hook reads it.
- ``P-<service>-tls`` for gateway, scheduler, runtime, cache, monitor and
  admin: ``tls.crt``, ``tls.key``, ``ca.crt``, the layout cert-manager writes
  too. The certificate's common name is the service's identity.
- ``P-api-keys``: ``api-keys.yaml`` (the key's SHA-256 hash, which the
  gateway mounts) and ``api-key`` (the key itself, for the operator).
- ``P-redis``: ``password``, ``users.acl`` (Redis's ACL file) and
  ``redis-url`` (what the services are given).
- ``P-internal-token``: ``internal-token``, the installation's secret that
  admins' bearer tokens for the monitor's control API derive from.
- ``P-credential-key``: ``credential-key``, the key the gateway seals callers'
  credentials under while their batch jobs and asynchronous requests wait in
  Redis (``aiworks.security.sealing``); the tiers' pods open them with it.
"""

from __future__ import annotations

import datetime as dt
import secrets as random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from aiworks.kube.api import KubeAPI, Secret
from aiworks.security.certs import CertificateAuthority, subject_alternative_names

RENEW_BEFORE = dt.timedelta(days=30)
MANAGED_BY = {"app.kubernetes.io/managed-by": "aiworks-install-hook"}


@dataclass
class Plan:
    """What to ensure; empty parts are skipped."""

    prefix: str
    services: Mapping[str, Sequence[str]] = field(default_factory=dict)  # identity -> extra DNS names
    validity_days: int = 365
    api_key_tenant: str | None = None
    redis_host: str | None = None  # host:port of the release's Redis
    internal_token: bool = False
    credential_key: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _ca(api: KubeAPI, plan: Plan, log: Callable[[str], None]) -> tuple[CertificateAuthority, bool]:
    name = f"{plan.prefix}-ca"
    found = api.get_secret(name)
    if found is not None and {"tls.crt", "tls.key"} <= set(found.data):
        cert = x509.load_pem_x509_certificate(found.data["tls.crt"])
        key = serialization.load_pem_private_key(found.data["tls.key"], password=None)
        if cert.not_valid_after_utc - RENEW_BEFORE > dt.datetime.now(dt.UTC):
            return CertificateAuthority(cert, key), False
        log(f"CA {name} expires {cert.not_valid_after_utc:%Y-%m-%d}: making a new one")
    ca = CertificateAuthority.create(f"AIWorks {plan.prefix} CA")
    version = found.resource_version if found else ""
    api.put_secret(Secret(name, {"tls.crt": _pem_cert(ca.cert), "tls.key": _pem_key(ca.key)},
                          {**plan.labels, **MANAGED_BY}, version), secret_type="kubernetes.io/tls")  # fmt: skip
    log(f"created the CA in Secret {name}")
    return ca, True


def _leaf_fits(found: Secret | None, ca: CertificateAuthority, names: Sequence[str]) -> bool:
    if found is None or not {"tls.crt", "tls.key", "ca.crt"} <= set(found.data):
        return False
    cert = x509.load_pem_x509_certificate(found.data["tls.crt"])
    if found.data["ca.crt"] != _pem_cert(ca.cert) or cert.issuer != ca.cert.subject:
        return False
    if cert.not_valid_after_utc - RENEW_BEFORE <= dt.datetime.now(dt.UTC):
        return False
    try:
        have = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return set(subject_alternative_names(names)) <= set(have)


def ensure_certificates(api: KubeAPI, plan: Plan, log: Callable[[str], None]) -> list[str]:
    """One certificate per identity, signed by the release's CA; returns the Secrets written."""
    ca, _ = _ca(api, plan, log)
    written = []
    for identity, extra in plan.services.items():
        name = f"{plan.prefix}-{identity}-tls"
        names = [identity, *extra]
        found = api.get_secret(name)
        if _leaf_fits(found, ca, names):
            continue
        cert, key = ca.issue(identity, names, valid_days=plan.validity_days)
        data = {"tls.crt": _pem_cert(cert), "tls.key": _pem_key(key), "ca.crt": _pem_cert(ca.cert)}
        api.put_secret(Secret(name, data, {**plan.labels, **MANAGED_BY}, found.resource_version if found else ""),
                       secret_type="kubernetes.io/tls")  # fmt: skip
        written.append(name)
        log(f"issued the {identity} certificate into Secret {name} (valid {plan.validity_days} days)")
    return written


def ensure_api_key(api: KubeAPI, plan: Plan, log: Callable[[str], None]) -> bool:
    """The first API key, for ``plan.api_key_tenant``, unless the Secret exists; True when made."""
    from aiworks.gateway.cli import new_api_key as generate_api_key

    name = f"{plan.prefix}-api-keys"
    if api.get_secret(name) is not None:
        return False
    key, digest = generate_api_key()
    document = {"keys": [{"hash": digest, "tenant": plan.api_key_tenant, "label": "made by the install hook"}]}
    data = {"api-keys.yaml": yaml.safe_dump(document, sort_keys=False).encode(), "api-key": key.encode()}
    api.put_secret(Secret(name, data, {**plan.labels, **MANAGED_BY}))
    log(f"made an API key for tenant '{plan.api_key_tenant}' in Secret {name} (key 'api-key')")
    return True


def ensure_redis_password(api: KubeAPI, plan: Plan, log: Callable[[str], None]) -> bool:
    """Redis's password, its ACL file and the URL the services get, unless the Secret exists."""
    name = f"{plan.prefix}-redis"
    if api.get_secret(name) is not None:
        return False
    password = random.token_urlsafe(32)
    data = {
        "password": password.encode(),
        # Redis ACL syntax: the default user, on, with this password, all keys, channels and commands.
        "users.acl": f"user default on >{password} ~* &* +@all\n".encode(),
        "redis-url": f"redis://:{password}@{plan.redis_host}/0".encode(),
    }
    api.put_secret(Secret(name, data, {**plan.labels, **MANAGED_BY}))
    log(f"made Redis's password in Secret {name}")
    return True


def ensure_random_secret(api: KubeAPI, plan: Plan, key: str, what: str, log: Callable[[str], None]) -> bool:
    """Secret ``PREFIX-<key>`` holding ``key``: 43 URL-safe random characters (the files that read it need 16
    bytes or more), unless the Secret exists. Kept across upgrades: what was derived or sealed from it stays."""
    name = f"{plan.prefix}-{key}"
    if api.get_secret(name) is not None:
        return False
    api.put_secret(Secret(name, {key: random.token_urlsafe(32).encode()}, {**plan.labels, **MANAGED_BY}))
    log(f"made {what} in Secret {name}")
    return True


def ensure_secrets(api: KubeAPI, plan: Plan, log: Callable[[str], None] = print) -> None:
    if plan.services:
        ensure_certificates(api, plan, log)
    if plan.api_key_tenant:
        ensure_api_key(api, plan, log)
    if plan.redis_host:
        ensure_redis_password(api, plan, log)
    if plan.internal_token:  # the monitor's control API: admins' bearer tokens derive from it
        ensure_random_secret(api, plan, "internal-token", "the installation's internal token", log)
    if plan.credential_key:  # the tiers: callers' credentials waiting in Redis are sealed under it
        ensure_random_secret(api, plan, "credential-key", "the tiers' credential key", log)
