"""`aiworks kube ensure-secrets`, the chart's install hook, against the box's API server over HTTPS: it makes
the certificates, the first API key and Redis's password once, keeps them on a rerun (helm upgrade), and
reissues what no longer fits, from the same CA."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from aiworks.gateway.auth import hash_api_key
from aiworks.kube.api import KubeAPI
from aiworks.kube.secrets import Plan, ensure_secrets
from aiworks.security.certs import write_certificates

from .box.apiserver import FakeAPIServer

IDENTITIES = {"gateway": ["aiworks-gateway", "localhost"], "scheduler": ["aiworks-scheduler"], "admin": []}


@pytest.fixture
def api(tmp_path: Path):
    certs = write_certificates(tmp_path / "tls", ["127.0.0.1"])
    server = FakeAPIServer("127.0.0.1", certs.server_dir / "tls.crt", certs.server_dir / "tls.key",
                           {"hook-token": "system:serviceaccount:aiworks:aiworks-setup"}, pods=list,
                           deployments=list, delete_pod=lambda n: False, scale=lambda n, r: False, port=0)  # fmt: skip
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("hook-token")
    (account / "namespace").write_text("aiworks")
    (account / "ca.crt").write_bytes(certs.ca_cert.read_bytes())
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.port)}
    try:
        yield server, KubeAPI.in_cluster(env, account)
    finally:
        server.close()


def leaf(server: FakeAPIServer, identity: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(server.secret_data("aiworks", f"aiworks-{identity}-tls")["tls.crt"])


def test_makes_everything_once_and_keeps_it(api) -> None:
    server, client = api
    plan = Plan(prefix="aiworks", services=IDENTITIES, api_key_tenant="default", redis_host="aiworks-redis:6379",
                credential_key=True)  # fmt: skip
    ensure_secrets(client, plan, log=lambda m: None)
    made = {name: dict(server.secrets[("aiworks", name)]["data"]) for _, name in server.secrets}
    assert set(made) == {"aiworks-ca", "aiworks-gateway-tls", "aiworks-scheduler-tls", "aiworks-admin-tls",
                         "aiworks-api-keys", "aiworks-redis", "aiworks-credential-key"}  # fmt: skip
    # The tiers' credential key: a secret the gateway and the tiers' pods read as a file (16+ bytes).
    assert len(server.secret_data("aiworks", "aiworks-credential-key")["credential-key"]) >= 32
    gateway = leaf(server, "gateway")
    assert gateway.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "gateway"
    names = gateway.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert set(names) == {"gateway", "aiworks-gateway", "localhost"}
    keys = server.secret_data("aiworks", "aiworks-api-keys")
    [entry] = yaml.safe_load(keys["api-keys.yaml"])["keys"]
    assert entry["tenant"] == "default" and entry["hash"] == hash_api_key(keys["api-key"].decode())
    redis = server.secret_data("aiworks", "aiworks-redis")
    password = redis["password"].decode()
    assert redis["redis-url"].decode() == f"redis://:{password}@aiworks-redis:6379/0"
    assert redis["users.acl"].decode() == f"user default on >{password} ~* &* +@all\n"
    # helm upgrade: the hook runs again and changes nothing.
    calls = len(server.calls)
    ensure_secrets(client, plan, log=lambda m: None)
    writes = [c for c in server.calls[calls:] if c[1] != "GET"]
    assert not writes, writes
    assert {name: dict(server.secrets[("aiworks", name)]["data"]) for _, name in server.secrets} == made


def test_reissues_what_no_longer_fits_from_the_same_ca(api) -> None:
    server, client = api
    ensure_secrets(client, Plan(prefix="aiworks", services=IDENTITIES, validity_days=365), log=lambda m: None)
    ca = server.secret_data("aiworks", "aiworks-ca")["tls.crt"]
    scheduler = leaf(server, "scheduler")
    # A new name for the gateway, and a scheduler certificate close to its end.
    short = Plan(prefix="aiworks", services={**IDENTITIES, "gateway": ["aiworks-gateway", "localhost", "ai.example.com"]},
                 validity_days=20)  # fmt: skip
    ensure_secrets(client, short, log=lambda m: None)
    names = leaf(server, "gateway").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "ai.example.com" in names.get_values_for_type(x509.DNSName)
    assert leaf(server, "scheduler").serial_number == scheduler.serial_number, "still fits: kept"
    assert server.secret_data("aiworks", "aiworks-ca")["tls.crt"] == ca, "the same CA signs"
    # The gateway's new certificate lasts 20 days, within the 30-day renewal window: the next run reissues it.
    before = leaf(server, "gateway").serial_number
    ensure_secrets(client, short, log=lambda m: None)
    after = leaf(server, "gateway")
    assert after.serial_number != before
    assert after.not_valid_after_utc - dt.datetime.now(dt.UTC) < dt.timedelta(days=21)


def test_refuses_a_stranger(tmp_path: Path, api) -> None:
    server, client = api
    client._token = "not-a-token"
    with pytest.raises(Exception, match="401"):
        ensure_secrets(client, Plan(prefix="aiworks", api_key_tenant="default"), log=lambda m: None)
