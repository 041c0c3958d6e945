"""Credentials to tenants: API keys by hash, JWTs with HMAC and public keys, and the 401/403 that say why."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import grpc.aio
import jwt
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from starlette.datastructures import Headers

from aiworks.core.errors import AIWorksError, InvalidArgument, Status
from aiworks.gateway.auth import Authenticator, add_api_key, generate_api_key, hash_api_key, load_jwt_key
from aiworks.gateway.tenancy import load_tenancy

KEY_ACME, HASH_ACME = generate_api_key()
KEY_LAB, HASH_LAB = generate_api_key()
HMAC_SECRET = b"0123456789abcdef0123456789abcdef-hs256-test-secret"


def tenants_doc(jwt_settings: dict | None = None) -> dict:
    doc = {
        "tenants": [
            {"id": "acme", "models": ["*"], "api_keys": [HASH_ACME], "jwt_subjects": ["acme-backend"]},
            {"id": "lab", "models": ["iris"]},
        ]
    }
    if jwt_settings is not None:
        doc["jwt"] = jwt_settings
    return doc


@pytest.fixture
def config(write_yaml):
    tenants = write_yaml("tenants.yaml", tenants_doc())
    keys = write_yaml("keys.yaml", {"keys": [{"hash": HASH_LAB, "tenant": "lab", "label": "notebook"}]})
    return load_tenancy(tenants, keys)


def status_of(call) -> tuple[Status, str]:
    with pytest.raises(AIWorksError) as info:
        call()
    return info.value.status, info.value.message


# ---- API keys --------------------------------------------------------------------------------------------


def test_api_key_forms(config):
    auth = Authenticator(config)
    assert auth.required
    assert auth.authenticate({"x-api-key": KEY_ACME}).tenant_id == "acme"
    assert auth.authenticate({"Authorization": f"Bearer {KEY_LAB}"}).tenant_id == "lab"  # HTTP, any case
    principal = auth.authenticate([("user-agent", "grpc"), ("authorization", f"bearer {KEY_ACME}")])  # gRPC metadata
    assert principal.tenant_id == "acme" and principal.method == "api_key"
    assert principal.subject == HASH_ACME[:19]  # a hash prefix, never the key
    # The transports' own types, as the gateway will pass them.
    http_headers = Headers(raw=[(b"Authorization", f"Bearer {KEY_LAB}".encode())])
    assert auth.authenticate(http_headers).tenant_id == "lab"
    assert auth.authenticate(grpc.aio.Metadata(("x-api-key", KEY_ACME))).tenant_id == "acme"


def test_missing_and_bad_credentials_are_401_and_say_why(config):
    auth = Authenticator(config)
    status, message = status_of(lambda: auth.authenticate({}))
    assert status is Status.UNAUTHENTICATED and "credentials required" in message
    status, message = status_of(lambda: auth.authenticate({"x-api-key": KEY_ACME + "x"}))
    assert status is Status.UNAUTHENTICATED and message == "API key is not recognised"
    assert KEY_ACME not in message
    status, message = status_of(lambda: auth.authenticate({"authorization": f"Basic {KEY_ACME}"}))
    assert status is Status.UNAUTHENTICATED and "scheme is not supported" in message
    # A bare key where the scheme goes (issue 15, finding 9): none of it comes back.
    status, message = status_of(lambda: auth.authenticate({"authorization": KEY_ACME}))
    assert status is Status.UNAUTHENTICATED and "scheme is not supported" in message
    assert KEY_ACME[:8] not in message and KEY_ACME[-8:] not in message
    status, message = status_of(lambda: auth.authenticate({"authorization": "Bearer "}))
    assert status is Status.UNAUTHENTICATED and "no bearer token" in message
    status, message = status_of(lambda: auth.authenticate({"authorization": "Bearer eyJhbGciOi.eyJzdWIi.c2ln"}))
    assert status is Status.UNAUTHENTICATED and "JWTs are not accepted" in message


def test_model_not_allowed_is_403_naming_tenant_and_model(config):
    auth = Authenticator(config)
    assert auth.authenticate_for({"x-api-key": KEY_LAB}, "iris").tenant_id == "lab"
    status, message = status_of(lambda: auth.authenticate_for({"x-api-key": KEY_LAB}, "digits"))
    assert status is Status.PERMISSION_DENIED
    assert message == "tenant 'lab' may not use model 'digits'"


def test_demo_mode_is_anonymous():
    auth = Authenticator(load_tenancy(None))
    assert not auth.required
    principal = auth.authenticate_for({}, "anything")
    assert principal.tenant_id == "" and principal.method == "anonymous"


def test_start_up_refuses_a_config_no_request_could_pass(write_yaml):
    config = load_tenancy(write_yaml("t.yaml", {"tenants": [{"id": "acme"}]}))
    with pytest.raises(
        InvalidArgument, match="no API key hashes .* and no JWT settings: every request would be refused"
    ):
        Authenticator(config)
    with pytest.raises(InvalidArgument, match="a JWT key is configured but tenants file .* has no 'jwt' section"):
        Authenticator(config, HMAC_SECRET)
    with_jwt = load_tenancy(write_yaml("j.yaml", tenants_doc({"algorithms": ["HS256"]})))
    with pytest.raises(InvalidArgument, match="'jwt' section but no JWT key is configured"):
        Authenticator(with_jwt)
    with pytest.raises(InvalidArgument, match="HMAC secret is 5 bytes; HS256 needs at least 32"):
        Authenticator(with_jwt, b"short")


def test_add_api_key_round_trip(write_yaml, tmp_path):
    tenants = write_yaml("tenants.yaml", tenants_doc())
    keys_file = tmp_path / "api-keys.yaml"
    key = add_api_key(keys_file, "lab", "ci pipeline", tenants_file=tenants)
    assert key.startswith("aiw_") and len(key) > 40
    assert key not in keys_file.read_text()
    assert yaml.safe_load(keys_file.read_text())["keys"] == [
        {"hash": hash_api_key(key), "tenant": "lab", "label": "ci pipeline"}
    ]
    assert keys_file.stat().st_mode & 0o077 == 0
    second = add_api_key(keys_file, "lab")
    auth = Authenticator(load_tenancy(tenants, keys_file))
    assert auth.authenticate({"x-api-key": key}).tenant_id == "lab"
    assert auth.authenticate({"x-api-key": second}).tenant_id == "lab"
    with pytest.raises(InvalidArgument, match="defines no tenant 'ghost'"):
        add_api_key(keys_file, "ghost", tenants_file=tenants)


# ---- JWTs --------------------------------------------------------------------------------------------------

ISSUER = "https://auth.example.com/"
AUDIENCE = "aiworks"


def claims(**extra) -> dict:
    now = int(time.time())
    return {"iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 300, "sub": "user-1", **extra}


def pem_public(private) -> bytes:
    return private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def jwt_authenticator(write_yaml, algorithm: str, verify_key: bytes, **settings) -> Authenticator:
    jwt_settings = {"algorithms": [algorithm], "issuer": ISSUER, "audience": AUDIENCE, **settings}
    path = write_yaml(f"tenants-{algorithm}.yaml", tenants_doc(jwt_settings))
    key_file = path.with_suffix(".key")
    key_file.write_bytes(verify_key + b"\n")
    return Authenticator.from_files(load_tenancy(path), key_file)


KEYS = {
    "HS256": lambda: (HMAC_SECRET, HMAC_SECRET),
    "RS256": lambda: (lambda k: (k, pem_public(k)))(rsa.generate_private_key(public_exponent=65537, key_size=2048)),
    "ES256": lambda: (lambda k: (k, pem_public(k)))(ec.generate_private_key(ec.SECP256R1())),
    "EdDSA": lambda: (lambda k: (k, pem_public(k)))(ed25519.Ed25519PrivateKey.generate()),
}


@pytest.mark.parametrize("algorithm", sorted(KEYS))
def test_jwt_maps_its_tenant_claim(write_yaml, algorithm):
    signing, verify = KEYS[algorithm]()
    auth = jwt_authenticator(write_yaml, algorithm, verify)
    token = jwt.encode(claims(tenant="lab"), signing, algorithm=algorithm)
    principal = auth.authenticate({"authorization": f"Bearer {token}"})
    assert (principal.tenant_id, principal.method, principal.subject) == ("lab", "jwt", "user-1")
    # A tenant's jwt_subjects map to it too.
    token = jwt.encode(claims(tenant="acme-backend"), signing, algorithm=algorithm)
    assert auth.authenticate({"authorization": f"Bearer {token}"}).tenant_id == "acme"
    # API keys keep working beside JWTs.
    assert auth.authenticate({"x-api-key": KEY_ACME}).tenant_id == "acme"


def test_sub_names_a_tenant_only_when_the_tenants_file_opts_in(write_yaml):
    token = "Bearer " + jwt.encode(claims(sub="acme"), HMAC_SECRET, algorithm="HS256")  # no tenant claim
    closed = jwt_authenticator(write_yaml, "HS256", HMAC_SECRET)
    status, text = status_of(lambda: closed.authenticate({"authorization": token}))
    assert status is Status.PERMISSION_DENIED
    assert text == (
        "bearer JWT has no 'tenant' claim naming a tenant "
        "('sub' names one only with jwt.tenant_from_subject: true in the tenants file)"
    )
    opted_in = jwt_authenticator(write_yaml, "HS256", HMAC_SECRET, tenant_from_subject=True)
    assert opted_in.authenticate({"authorization": token}).tenant_id == "acme"
    # With the fallback on, the tenant claim still wins over "sub".
    both = "Bearer " + jwt.encode(claims(sub="acme", tenant="lab"), HMAC_SECRET, algorithm="HS256")
    assert opted_in.authenticate({"authorization": both}).tenant_id == "lab"


def test_jwt_tenant_claim_is_configurable(write_yaml):
    auth = jwt_authenticator(write_yaml, "HS256", HMAC_SECRET, tenant_claim="org")
    token = jwt.encode(claims(org="lab", tenant="acme"), HMAC_SECRET, algorithm="HS256")
    assert auth.authenticate({"authorization": f"Bearer {token}"}).tenant_id == "lab"


# The claims are made when the test runs, not at collection: in a long session a token built at
# collection time would have expired (exp is 300 s after iat) before its test ran.
@pytest.mark.parametrize(
    ("make_claims", "message"),
    [
        (lambda: claims(tenant="lab", exp=int(time.time()) - 60), "Signature has expired"),
        (lambda: claims(tenant="lab", aud="someone-else"), "Audience doesn't match"),
        (lambda: claims(tenant="lab", iss="https://evil.example.com/"), "Invalid issuer"),
        (lambda: {k: v for k, v in claims(tenant="lab").items() if k != "exp"}, 'missing the "exp" claim'),
        (lambda: claims(tenant="lab", nbf=int(time.time()) + 600), "not yet valid"),
    ],
    ids=["expired", "audience", "issuer", "no-exp", "not-yet-valid"],
)
def test_invalid_jwts_are_401_and_say_why(write_yaml, make_claims, message):
    auth = jwt_authenticator(write_yaml, "HS256", HMAC_SECRET)
    token = jwt.encode(make_claims(), HMAC_SECRET, algorithm="HS256")
    status, text = status_of(lambda: auth.authenticate({"authorization": f"Bearer {token}"}))
    assert status is Status.UNAUTHENTICATED
    assert text.startswith("bearer JWT is not valid") and message in text


def test_forged_and_confused_jwts_are_refused(write_yaml):
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public_pem = pem_public(private)
    auth = jwt_authenticator(write_yaml, "RS256", public_pem)
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forged = jwt.encode(claims(tenant="acme"), other, algorithm="RS256")
    assert status_of(lambda: auth.authenticate({"authorization": f"Bearer {forged}"}))[0] is Status.UNAUTHENTICATED
    unsigned = jwt.encode(claims(tenant="acme"), None, algorithm="none")
    status, text = status_of(lambda: auth.authenticate({"authorization": f"Bearer {unsigned}"}))
    assert status is Status.UNAUTHENTICATED and "alg value is not allowed" in text
    # Algorithm confusion: HS256 "signed" with the public key as the HMAC secret.
    signing_input = (
        b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
        + b"."
        + b64(json.dumps(claims(tenant="acme")).encode())
    )
    confused = signing_input + b"." + b64(hmac.new(public_pem, signing_input, hashlib.sha256).digest())
    status, text = status_of(lambda: auth.authenticate({"authorization": f"Bearer {confused.decode()}"}))
    assert status is Status.UNAUTHENTICATED and "alg value is not allowed" in text


def b64(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


def test_jwt_of_an_unknown_tenant_is_403(write_yaml):
    auth = jwt_authenticator(write_yaml, "HS256", HMAC_SECRET)
    token = jwt.encode(claims(tenant="nobody"), HMAC_SECRET, algorithm="HS256")
    status, text = status_of(lambda: auth.authenticate({"authorization": f"Bearer {token}"}))
    assert status is Status.PERMISSION_DENIED and text == "JWT claim 'tenant' is 'nobody', which maps to no tenant"


def test_verified_tokens_are_remembered_until_they_expire(write_yaml, monkeypatch):
    auth = jwt_authenticator(write_yaml, "HS256", HMAC_SECRET, leeway_s=0)
    token = jwt.encode(claims(tenant="lab", exp=int(time.time()) + 2), HMAC_SECRET, algorithm="HS256")
    calls = []
    real_decode = jwt.decode
    monkeypatch.setattr(jwt, "decode", lambda *a, **k: calls.append(1) or real_decode(*a, **k))
    for _ in range(5):
        assert auth.authenticate({"authorization": f"Bearer {token}"}).tenant_id == "lab"
    assert len(calls) == 1  # one signature check for five requests
    time.sleep(2.1)
    status, text = status_of(lambda: auth.authenticate({"authorization": f"Bearer {token}"}))
    assert status is Status.UNAUTHENTICATED and "expired" in text


def test_key_type_must_fit_the_algorithms(write_yaml, tmp_path):
    ec_pem = pem_public(ec.generate_private_key(ec.SECP256R1()))
    with pytest.raises(InvalidArgument, match="an EC public key, which cannot verify RS256"):
        jwt_authenticator(write_yaml, "RS256", ec_pem)
    with pytest.raises(InvalidArgument, match="PEM key, but the algorithms are HMAC"):
        jwt_authenticator(write_yaml, "HS256", ec_pem + b"\n" + b"x" * 40)
    with pytest.raises(InvalidArgument, match="must be a PEM public key"):
        jwt_authenticator(write_yaml, "ES256", HMAC_SECRET)
    with pytest.raises(InvalidArgument, match="cannot be read"):
        load_jwt_key(tmp_path / "missing.pem")


# ---- work tokens: what batch jobs and queued requests run with -------------------------------------------

CREDENTIAL_KEY = b"credential-key-for-the-work-token-tests-0123456789"


def test_work_token_runs_as_its_submitter_after_the_submitters_jwt_expired(write_yaml):
    from aiworks.security.work_tokens import WorkTokens

    settings = {"algorithms": ["HS256"], "issuer": "idp", "audience": "aiworks"}
    auth = Authenticator(load_tenancy(write_yaml("t.yaml", tenants_doc(settings))), HMAC_SECRET,
                         work_tokens=WorkTokens(CREDENTIAL_KEY))  # fmt: skip
    short = jwt.encode({"tenant": "acme", "sub": "alice", "iss": "idp", "aud": "aiworks", "exp": time.time() + 2},
                       HMAC_SECRET, algorithm="HS256")  # fmt: skip
    submitter = auth.authenticate({"authorization": f"Bearer {short}"})
    token = auth.mint_work_token(submitter, "batch", "digits", 3600)
    assert token.startswith("aiwt1.") and short not in token and "alice" not in token.split(".")[0]
    # 50 minutes later the 2-s JWT is long dead (exp is checked by PyJWT's own clock); the work it submitted still runs, as the same tenant and subject.
    later = time.time() + 3000
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "time", lambda: later)
        worker = auth.authenticate({"authorization": f"Bearer {token}"})
        assert (worker.tenant_id, worker.method, worker.subject) == ("acme", "work_token", "alice")
        assert worker.is_work_token
        patch.setattr(time, "time", lambda: later + 700)  # past its lifetime: the work outlived its window
        status, message = status_of(lambda: auth.authenticate({"authorization": f"Bearer {token}"}))
        assert status is Status.UNAUTHENTICATED and "expired" in message and token not in message


def test_work_token_dies_with_its_api_key_and_tenant(config, write_yaml):
    from aiworks.security.work_tokens import WorkTokens

    tokens = WorkTokens(CREDENTIAL_KEY)
    auth = Authenticator(config, work_tokens=tokens)
    token = auth.mint_work_token(auth.authenticate({"x-api-key": KEY_LAB}), "async", "iris", 60)
    assert KEY_LAB not in token and HASH_LAB.removeprefix("sha256:") in tokens.verify(token).key
    worker = auth.authenticate({"authorization": f"Bearer {token}"})
    assert worker.tenant_id == "lab"
    auth.authorize(worker, "iris")  # its work's model, and no other, even one its tenant may use
    assert status_of(lambda: auth.authorize(worker, "digits"))[0] is Status.PERMISSION_DENIED
    acme = auth.mint_work_token(auth.authenticate({"x-api-key": KEY_ACME}), "batch", "iris", 60)
    status, message = status_of(lambda: auth.authorize(auth.authenticate({"authorization": f"Bearer {acme}"}), "bert"))
    assert status is Status.PERMISSION_DENIED and "may use model 'iris' only" in message
    # Another gateway replica with the same credential key file and tenants verifies it too.
    assert Authenticator(config, work_tokens=WorkTokens(CREDENTIAL_KEY)).authenticate(
        {"authorization": f"Bearer {token}"}).tenant_id == "lab"  # fmt: skip
    # The lab's key revoked (gone from the keys file): the work it submitted is refused, naming the key's prefix.
    revoked = load_tenancy(write_yaml("t2.yaml", tenants_doc()), write_yaml("k2.yaml", {"keys": []}))
    status, message = status_of(lambda: Authenticator(revoked, work_tokens=tokens).authenticate(
        {"authorization": f"Bearer {token}"}))  # fmt: skip
    assert status is Status.UNAUTHENTICATED and "revoked" in message and "sha256:" + HASH_LAB[7:19] in message
    # The tenant removed: all of its work stops.
    gone = load_tenancy(write_yaml("t3.yaml", {"tenants": [tenants_doc()["tenants"][0]]}))
    status, message = status_of(lambda: Authenticator(gone, work_tokens=tokens).authenticate(
        {"authorization": f"Bearer {token}"}))  # fmt: skip
    assert status is Status.UNAUTHENTICATED and "'lab' is no longer" in message
    # Its key retired in place (a rotation taken without a restart): remembered as verified, refused all the same.
    tokens.reload([b"the-key-that-replaced-the-old-one", CREDENTIAL_KEY])
    assert auth.authenticate({"authorization": f"Bearer {token}"}).tenant_id == "lab", "the old key still verifies"
    tokens.reload([b"the-key-that-replaced-the-old-one"])
    status, message = status_of(lambda: auth.authenticate({"authorization": f"Bearer {token}"}))
    assert status is Status.UNAUTHENTICATED and "does not hold" in message


def test_work_token_forgeries_are_refused(config):
    from aiworks.security.work_tokens import WorkTokens

    auth = Authenticator(config, work_tokens=WorkTokens(CREDENTIAL_KEY))
    token = auth.mint_work_token(auth.authenticate({"x-api-key": KEY_LAB}), "batch", "iris", 60)
    prefix, key_id, payload, mac = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["t"] = "acme"  # the lab's token made to say acme
    forged_payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    cases = {
        f"{prefix}.{key_id}.{forged_payload}.{mac}": "altered",
        token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB"): "altered",
        WorkTokens(b"another-installation-credential-key-0123").mint(
            tenant="acme", method="jwt", subject="x", work="batch", model="iris", lifetime_s=60): "credential key",
        "aiwt1.nonsense": "malformed",
        f"{prefix}.{key_id}.!!!.{mac}": "altered",
    }
    for forged, reason in cases.items():
        status, message = status_of(lambda f=forged: auth.authenticate({"authorization": f"Bearer {f}"}))
        assert status is Status.UNAUTHENTICATED and reason in message, (forged, message)
    # A gateway without the credential key file accepts none, and says why.
    status, message = status_of(lambda: Authenticator(config).authenticate({"authorization": f"Bearer {token}"}))
    assert status is Status.UNAUTHENTICATED and "no credential key file" in message
    # A work token never mints another (so it cannot extend its own life); demo mode mints nothing.
    worker = auth.authenticate({"authorization": f"Bearer {token}"})
    assert status_of(lambda: auth.mint_work_token(worker, "batch", "iris", 10**6))[0] is Status.PERMISSION_DENIED
    demo = Authenticator(load_tenancy(None), work_tokens=WorkTokens(CREDENTIAL_KEY))
    assert demo.mint_work_token(demo.authenticate({}), "batch", "iris", 60) is None


def test_a_batch_jobs_work_token_is_refused_once_its_job_has_ended(config):
    """The token names its job; the gateway refuses it once the job store reports the job ended (cancelled,
    completed, failed or expired), whether the token was verified and remembered before or not."""
    from aiworks.security.work_tokens import WorkTokens

    auth = Authenticator(config, work_tokens=WorkTokens(CREDENTIAL_KEY))
    submitter = auth.authenticate({"x-api-key": KEY_LAB})
    token = auth.mint_work_token(submitter, "batch", "iris", 3600, "batch_a")
    fresh = auth.mint_work_token(submitter, "batch", "iris", 3600, "batch_a")  # never verified before the end
    other = auth.mint_work_token(submitter, "batch", "iris", 3600, "batch_b")
    queued = auth.mint_work_token(submitter, "async", "iris", 60)  # a queued request's names no job
    assert WorkTokens(CREDENTIAL_KEY).verify(token).work_id == "batch_a"
    worker = auth.authenticate({"authorization": f"Bearer {token}"})
    assert worker.work_id == "batch_a"  # verified, and now remembered
    now = time.time()
    auth.ended_work.note([("batch_a", now, now + 3600)])
    for ended in (token, fresh):
        status, message = status_of(lambda t=ended: auth.authenticate({"authorization": f"Bearer {t}"}))
        assert status is Status.UNAUTHENTICATED and "batch job 'batch_a' has ended" in message, message
    assert auth.authenticate({"authorization": f"Bearer {other}"}).work_id == "batch_b"
    assert auth.authenticate({"authorization": f"Bearer {queued}"}).work_id == ""
    # An entry leaves once its token would have expired anyway: the register stays bounded.
    auth.ended_work.note([("batch_c", now, now + 1)], now=now + 2)
    assert "batch_a" in auth.ended_work and "batch_c" not in auth.ended_work and len(auth.ended_work) == 1
    assert auth.ended_work.read_to == now
