"""Authentication: which tenant a request belongs to, from its HTTP headers or gRPC metadata.

Credentials, in this order of precedence:

- ``authorization: Bearer <token>``: a JWT when the token looks like one
  (three base64url parts, the first starting ``eyJ``), else an API key;
- ``x-api-key: <key>``: an API key.

API keys are random (:func:`generate_api_key`: 32 bytes from ``secrets``), so
storing and comparing their SHA-256 is enough: with 256 bits of entropy
there is nothing to brute-force, so a slow password hash (or a pepper) would
only add cost to every request. A request costs one SHA-256 of the presented
key; the digest is looked up in a dict and then compared with
``hmac.compare_digest``. The dict lookup's timing depends only on the
digest, which an attacker cannot steer towards a stored one without a
preimage, so it reveals nothing about stored keys.

JWTs are verified with PyJWT against one key read at start-up (an HMAC
secret, or a PEM public key or certificate for RS*/PS*/ES*/EdDSA) and parsed
once. The tenant comes from a configured claim (``tenant`` by default),
falling back to ``sub`` only when the tenants file opts in
(``jwt.tenant_from_subject: true``): otherwise any token whose subject
happens to equal a tenant id would act as that tenant. The value is a tenant
id or one of a tenant's ``jwt_subjects``. Verified tokens are remembered (bounded LRU) until they
expire or for :data:`TOKEN_CACHE_S`, whichever comes first, so a client that
reuses its token pays for one signature check, not one per request. Work
tokens (what batch jobs and queued requests run with,
:mod:`aiworks.security.work_tokens`) are remembered the same way.

Failures: no or invalid credentials are UNAUTHENTICATED (401) and say why,
never echoing the credential; a valid identity without a tenant, or a tenant
asking for a model it may not use, is PERMISSION_DENIED (403).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import jwt
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from aiworks.core.errors import Internal, InvalidArgument, PermissionDenied, Unauthenticated
from aiworks.gateway.tenancy import (
    ANONYMOUS,
    HMAC_ALGORITHMS,
    TENANT_ID_PATTERN,
    TenancyConfig,
    Tenant,
    load_tenancy,
)
from aiworks.security.work_tokens import EndedWork, TokenError, WorkTokens, is_work_token

log = logging.getLogger(__name__)

API_KEY_PREFIX = "aiw_"
TOKEN_CACHE_S = 300.0
_HMAC_MIN_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}  # RFC 7518 3.2: at least the hash's size
_KEY_TYPES = {
    "RS": (rsa.RSAPublicKey,),
    "PS": (rsa.RSAPublicKey,),
    "ES": (ec.EllipticCurvePublicKey,),
    "Ed": (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey),
}


_KEY_KINDS = {
    "RSA": rsa.RSAPublicKey,
    "EC": ec.EllipticCurvePublicKey,
    "Ed25519": ed25519.Ed25519PublicKey,
    "Ed448": ed448.Ed448PublicKey,
}


def unauthenticated(message: str) -> Unauthenticated:
    return Unauthenticated(message)


def permission_denied(message: str) -> PermissionDenied:
    return PermissionDenied(message)


# ---- API keys --------------------------------------------------------------------------------------------


def hash_api_key(key: str) -> str:
    """The stored form of an API key: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_api_key() -> tuple[str, str]:
    """A new API key and its hash. Show the key once; store only the hash."""
    key = API_KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_api_key(key)


def add_api_key(
    api_keys_file: Path | str, tenant_id: str, label: str = "", tenants_file: Path | str | None = None
) -> str:
    """Create a key for ``tenant_id``, append its hash to the API keys file, and return the key.

    For an ``aiworks tenants add-key`` command. With ``tenants_file`` the
    tenant must exist there. The file is rewritten atomically, readable by
    its owner only.
    """
    if not re.match(TENANT_ID_PATTERN, tenant_id):
        raise InvalidArgument(f"'{tenant_id}' is not a valid tenant id")
    if tenants_file is not None and load_tenancy(tenants_file).get(tenant_id) is None:
        raise InvalidArgument(f"tenants file {tenants_file} defines no tenant '{tenant_id}'")
    path = Path(api_keys_file)
    document = yaml.safe_load(path.read_text()) if path.exists() else None
    document = document or {"keys": []}
    if not isinstance(document.get("keys"), list):
        raise InvalidArgument(f"API keys file {path}: expected a mapping with a 'keys' list")
    key, digest = generate_api_key()
    entry = {"hash": digest, "tenant": tenant_id}
    if label:
        entry["label"] = label
    document["keys"].append(entry)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        yaml.safe_dump(document, out, sort_keys=False)
    os.replace(tmp, path)
    return key


# ---- JWT keys --------------------------------------------------------------------------------------------


def load_jwt_key(path: Path | str) -> bytes:
    """The JWT verification key file's bytes: a PEM public key or certificate, or an HMAC secret."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"JWT key file {path} cannot be read: {exc.strerror or exc}") from None
    # A trailing newline is an editor's, not the secret's.
    return data.strip() if data.lstrip().startswith(b"-----BEGIN") else data.rstrip(b"\r\n")


def _verification_key(key: bytes | str, algorithms: tuple[str, ...]):
    """Parse the key once: bytes for HMAC, a cryptography public-key object otherwise."""
    raw = key.encode("utf-8") if isinstance(key, str) else key
    is_pem = raw.lstrip().startswith(b"-----BEGIN")
    if set(algorithms) <= HMAC_ALGORITHMS:
        if is_pem:
            raise InvalidArgument("JWT key is a PEM key, but the algorithms are HMAC (HS*); use a shared secret")
        need = max(_HMAC_MIN_BYTES[a] for a in algorithms)
        if len(raw) < need:
            raise InvalidArgument(f"JWT HMAC secret is {len(raw)} bytes; {'/'.join(algorithms)} needs at least {need}")
        return raw
    if not is_pem:
        raise InvalidArgument(f"JWT key must be a PEM public key or certificate for {'/'.join(algorithms)}")
    try:
        if b"CERTIFICATE" in raw.split(b"\n", 1)[0]:
            public = x509.load_pem_x509_certificate(raw).public_key()
        else:
            public = load_pem_public_key(raw)
    except ValueError as exc:
        raise InvalidArgument(f"JWT key is not a readable PEM public key or certificate: {exc}") from None
    for algorithm in algorithms:
        wanted = _KEY_TYPES[algorithm[:2]]
        if not isinstance(public, wanted):
            kind = next((k for k, types in _KEY_KINDS.items() if isinstance(public, types)), type(public).__name__)
            raise InvalidArgument(f"JWT key is an {kind} public key, which cannot verify {algorithm}")
    return public


# ---- the authenticator -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: its tenant, how it proved it, and the subject (JWT ``sub`` or the key's hash prefix)."""

    tenant: Tenant
    method: str  # "api_key", "jwt", "work_token" or "anonymous"
    subject: str = ""
    key_hash: str = ""  # an API key's full SHA-256 (hex), for the work tokens minted for its calls
    model: str = ""  # a work token's one model; "" for every other credential (the tenant's models)
    work_id: str = ""  # a batch job's work token: the job's id (refused once it has ended)

    @property
    def is_work_token(self) -> bool:
        """A batch job's or queued request's token (:mod:`aiworks.security.work_tokens`): inference only."""
        return self.method == "work_token"

    @property
    def tenant_id(self) -> str:
        return self.tenant.id


_ANONYMOUS = Principal(ANONYMOUS, "anonymous")
Headers = Mapping[str, str] | Iterable[tuple[str, str]]


def _read_headers(headers: Headers) -> tuple[str | None, str | None]:
    """``authorization`` and ``x-api-key``, matched case-insensitively (HTTP headers or gRPC metadata)."""
    authorization = api_key = None
    items = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in items:
        lower = name.lower()
        if lower == "authorization":
            authorization = value
        elif lower == "x-api-key":
            api_key = value
    return authorization, api_key


def _looks_like_jwt(token: str) -> bool:
    return token.startswith("eyJ") and token.count(".") == 2


def _job_ended(job_id: str) -> Unauthenticated:
    return unauthenticated(f"batch job '{job_id}' has ended (completed, failed, cancelled or expired): the work "
                           "token it ran with runs nothing more")  # fmt: skip


class Authenticator:
    """Resolves credentials to a :class:`Principal`; built once at start-up from the tenancy config."""

    def __init__(self, config: TenancyConfig, jwt_key: bytes | str | None = None, *, token_cache_size: int = 4096,
                 work_tokens: WorkTokens | None = None):  # fmt: skip
        self.config = config
        # Mints and verifies the tokens batch jobs and queued requests run with (the credential key file's key).
        self.work_tokens = work_tokens
        # Batch jobs that have ended: their work tokens are refused (fed by batch_routes.watch_ended_jobs).
        self.ended_work = EndedWork()
        self._keys: dict[bytes, tuple[bytes, Tenant]] = {}
        self._claims: dict[str, Tenant] = {}
        self._jwt_key = None
        self._tokens: OrderedDict[str, tuple[Principal, float]] = OrderedDict()
        self._token_cache_size = token_cache_size
        if config.demo:
            if jwt_key is not None:
                log.warning("a JWT key is configured but there is no tenants file: demo mode ignores it")
            return
        for digest, tenant_id in config.key_hashes.items():
            raw = bytes.fromhex(digest.removeprefix("sha256:"))
            self._keys[raw] = (raw, config.tenants[tenant_id])
        if config.jwt is not None:
            if jwt_key is None:
                raise InvalidArgument(
                    f"tenants file {config.source} has a 'jwt' section but no JWT key is configured "
                    "(AIWORKS_GATEWAY_JWT_KEY_FILE)"
                )
            self._jwt_key = _verification_key(jwt_key, config.jwt.algorithms)
            for tenant in config.tenants.values():
                self._claims[tenant.id] = tenant
                for subject in tenant.jwt_subjects:
                    self._claims[subject] = tenant
        elif jwt_key is not None:
            raise InvalidArgument(
                f"a JWT key is configured but tenants file {config.source} has no 'jwt' section "
                "(algorithms, issuer, audience)"
            )
        if not self._keys and self._jwt_key is None:
            raise InvalidArgument(
                f"tenants file {config.source} defines tenants but no API key hashes (a tenant's 'api_keys' or "
                "AIWORKS_GATEWAY_API_KEYS_FILE) and no JWT settings: every request would be refused"
            )
        if self._jwt_key is None:
            reachable = {tenant.id for _, tenant in self._keys.values()}
            for tenant_id in sorted(set(config.tenants) - reachable):
                log.warning("tenant '%s' has no API key and JWTs are off: no request can reach it", tenant_id)

    @classmethod
    def from_files(cls, config: TenancyConfig, jwt_key_file: Path | str | None = None,
                   credential_key_file: Path | str | None = None) -> Authenticator:  # fmt: skip
        tokens = None
        if credential_key_file:
            try:
                tokens = WorkTokens.from_file(credential_key_file)
            except InvalidArgument as exc:
                raise InvalidArgument(f"AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE: {exc.message}") from None
        return cls(config, load_jwt_key(jwt_key_file) if jwt_key_file else None, work_tokens=tokens)

    @property
    def required(self) -> bool:
        """Whether requests must authenticate (false only in demo mode)."""
        return not self.config.demo

    def authenticate(self, headers: Headers) -> Principal:
        """The request's principal; UNAUTHENTICATED when credentials are missing or invalid."""
        if self.config.demo:
            return _ANONYMOUS
        authorization, api_key = _read_headers(headers)
        if authorization is not None:
            scheme, _, token = authorization.strip().partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer":
                # Never echo the header: a client that sends its bare key puts the key where the scheme goes.
                raise unauthenticated(
                    "the authorization header's scheme is not supported; send 'Bearer <API key or JWT>' "
                    "or an x-api-key header"
                )
            if not token:
                raise unauthenticated("authorization header has no bearer token")
            if is_work_token(token):
                return self._work_token(token)
            return self._jwt(token) if _looks_like_jwt(token) else self._api_key(token)
        if api_key is not None and api_key.strip():
            return self._api_key(api_key.strip())
        raise unauthenticated("credentials required: send 'authorization: Bearer <API key or JWT>' or 'x-api-key'")

    def authorize(self, principal: Principal, model: str) -> None:
        """PERMISSION_DENIED unless the principal's tenant may use ``model`` (a work token: its one model)."""
        if principal.model and model != principal.model:
            raise permission_denied(f"a work token may use model '{principal.model}' only, the model of the work "
                                    "it was minted for")  # fmt: skip
        if not principal.tenant.allows(model):
            raise permission_denied(f"tenant '{principal.tenant_id}' may not use model '{model}'")

    def authenticate_for(self, headers: Headers, model: str) -> Principal:
        """:meth:`authenticate`, then :meth:`authorize` for ``model``."""
        principal = self.authenticate(headers)
        self.authorize(principal, model)
        return principal

    # ---- credentials -------------------------------------------------------------------------------------

    def _api_key(self, key: str) -> Principal:
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found = self._keys.get(digest)
        # The lookup already matched; the constant-time comparison keeps the check honest if the map changes.
        if found is None or not hmac.compare_digest(found[0], digest):
            raise unauthenticated("API key is not recognised")
        hexed = digest.hex()
        return Principal(found[1], "api_key", "sha256:" + hexed[:12], hexed)

    def mint_work_token(self, principal: Principal, work: str, model: str, lifetime_s: float,
                        work_id: str = "") -> str | None:  # fmt: skip
        """The token a batch job (``work`` "batch", ``work_id`` the job's id) or a queued request ("async") on
        ``model`` runs with, for ``lifetime_s``; ``None`` for an anonymous caller (demo mode: nothing checks one)."""
        if principal.method == "anonymous":
            return None
        if principal.is_work_token:  # the routes refuse these first; a token never mints a longer-lived one
            raise permission_denied("a work token cannot submit work")
        if self.work_tokens is None:
            raise Internal("this gateway has no credential key file (AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE) to mint "
                           "the token the work runs with")  # fmt: skip
        return self.work_tokens.mint(tenant=principal.tenant_id, method=principal.method, subject=principal.subject,
                                     key=principal.key_hash, work=work, model=model, lifetime_s=lifetime_s,
                                     work_id=work_id)  # fmt: skip

    def _cached(self, token: str, now: float) -> Principal | None:
        """A bearer token verified before and not yet due for another check (JWTs and work tokens)."""
        cached = self._tokens.get(token)
        if cached is not None:
            if cached[1] > now:
                self._tokens.move_to_end(token)
                return cached[0]
            del self._tokens[token]
        return None

    def _remember(self, token: str, principal: Principal, expires: float) -> Principal:
        self._tokens[token] = (principal, expires)
        if len(self._tokens) > self._token_cache_size:
            self._tokens.popitem(last=False)
        return principal

    def _work_token(self, token: str) -> Principal:
        if self.work_tokens is None:
            raise unauthenticated("work tokens are not accepted by this gateway (it has no credential key file)")
        now = time.time()
        cached = self._cached(token, now)  # a job sends the same token with every request: verified once a while
        if cached is not None and self.work_tokens.holds_key_of(token):  # a key retired since: verified again, refused
            if cached.work_id and cached.work_id in self.ended_work:
                raise _job_ended(cached.work_id)
            return cached
        try:
            claims = self.work_tokens.verify(token, now)
        except TokenError as exc:
            raise unauthenticated(str(exc)) from None
        if claims.work_id and claims.work_id in self.ended_work:
            raise _job_ended(claims.work_id)
        tenant = self.config.tenants.get(claims.tenant)
        if tenant is None:
            raise unauthenticated(f"the work token's tenant '{claims.tenant}' is no longer in the tenants file")
        if claims.method == "api_key":
            try:
                found = self._keys.get(bytes.fromhex(claims.key))
            except ValueError:
                found = None
            if found is None or found[1].id != tenant.id:
                raise unauthenticated(f"the API key that submitted this {claims.work} work ({claims.subject}) was "
                                      "revoked")  # fmt: skip
        principal = Principal(tenant, "work_token", claims.subject, model=claims.model, work_id=claims.work_id)
        # The tenants and keys it is checked against are fixed for this authenticator's life.
        return self._remember(token, principal, min(float(claims.expires_at), now + TOKEN_CACHE_S))

    def _jwt(self, token: str) -> Principal:
        if self._jwt_key is None:
            raise unauthenticated("bearer JWTs are not accepted by this gateway; use an API key")
        now = time.time()
        cached = self._cached(token, now)
        if cached is not None:
            return cached
        settings = self.config.jwt
        required = ["exp"] + (["iss"] if settings.issuer else []) + (["aud"] if settings.audience else [])
        try:
            claims = jwt.decode(
                token,
                self._jwt_key,
                algorithms=list(settings.algorithms),
                audience=settings.audience,
                issuer=settings.issuer,
                leeway=settings.leeway_s,
                options={"require": required},
            )
        except jwt.PyJWTError as exc:
            raise unauthenticated(f"bearer JWT is not valid: {exc}") from None
        value = claims.get(settings.tenant_claim)
        claim = settings.tenant_claim
        if value is None and settings.tenant_from_subject:
            value, claim = claims.get("sub"), "sub"
        if not isinstance(value, str) or not value:  # a valid identity, but no tenant: 403
            if settings.tenant_from_subject:
                raise permission_denied(f"bearer JWT has no '{settings.tenant_claim}' or 'sub' claim naming a tenant")
            raise permission_denied(
                f"bearer JWT has no '{settings.tenant_claim}' claim naming a tenant "
                "('sub' names one only with jwt.tenant_from_subject: true in the tenants file)"
            )
        tenant = self._claims.get(value)
        if tenant is None:
            raise permission_denied(f"JWT claim '{claim}' is '{value[:64]}', which maps to no tenant")
        principal = Principal(tenant, "jwt", str(claims.get("sub", ""))[:128])
        return self._remember(token, principal, min(float(claims["exp"]) + settings.leeway_s, now + TOKEN_CACHE_S))
