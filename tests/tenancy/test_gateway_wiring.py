"""How the gateway wires the tenancy modules: the spec cache, settings, start-up errors and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from aiworks.core.errors import InvalidArgument, Status
from aiworks.gateway.auth import Authenticator
from aiworks.gateway.cli import format_report
from aiworks.gateway.metering import parse_time
from aiworks.gateway.settings import GatewaySettings
from aiworks.gateway.tenancy import load_tenancy
from aiworks.gateway.tenancy_layer import Tenancy, request_limit


def test_demo_mode_without_a_tenants_file(monkeypatch):
    for key in list(os.environ):
        if key.startswith("AIWORKS_GATEWAY_"):
            monkeypatch.delenv(key)
    tenancy = Tenancy.from_settings(GatewaySettings(scheduler_address="127.0.0.1:1"))
    assert tenancy.demo_mode and tenancy.audit is None
    principal = tenancy.auth.authenticate({})
    assert principal.method == "anonymous" and request_limit(principal, 100) == 100


def test_settings_build_every_piece(write_yaml, tmp_path, monkeypatch):
    tenants = write_yaml("tenants.yaml", {"tenants": [{"id": "acme", "max_request_bytes": 10, "admin": True}]})
    keys = tmp_path / "keys.yaml"
    audit_key = tmp_path / "audit.key"
    audit_key.write_bytes(b"k" * 32 + b"\n")
    monkeypatch.setenv("AIWORKS_GATEWAY_TENANTS_FILE", str(tenants))
    monkeypatch.setenv("AIWORKS_GATEWAY_MAX_STRING_BYTES", "7")
    monkeypatch.setenv("AIWORKS_GATEWAY_AUDIT_LOG", str(tmp_path / "audit.jsonl"))
    monkeypatch.setenv("AIWORKS_GATEWAY_AUDIT_KEY_FILE", str(audit_key))
    from aiworks.gateway.auth import add_api_key

    key = add_api_key(keys, "acme", tenants_file=tenants)
    monkeypatch.setenv("AIWORKS_GATEWAY_API_KEYS_FILE", str(keys))
    tenancy = Tenancy.from_settings(GatewaySettings(scheduler_address="127.0.0.1:1"))
    assert not tenancy.demo_mode and tenancy.filters.max_string_bytes == 7
    principal = tenancy.auth.authenticate({"X-Api-Key": key})
    assert principal.tenant.admin and request_limit(principal, 100) == 10
    assert tenancy.audit is not None and tenancy.audit.path.name == "audit.jsonl"


def test_the_redis_audit_sink_needs_redis_and_names_the_writer(monkeypatch):
    monkeypatch.setenv("AIWORKS_GATEWAY_AUDIT_SINK", "redis")
    with pytest.raises(InvalidArgument, match="audit_sink redis needs redis_url"):
        Tenancy.from_settings(GatewaySettings(scheduler_address="127.0.0.1:1"))
    monkeypatch.setenv("AIWORKS_GATEWAY_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("AIWORKS_GATEWAY_AUDIT_WRITER", "gateway-7")
    tenancy = Tenancy.from_settings(GatewaySettings(scheduler_address="127.0.0.1:1"))
    assert tenancy.audit is not None and tenancy.audit.path is None
    assert tenancy.audit.name == "redis stream aiworks:audit (writer gateway-7)"


def test_a_bad_tenants_file_stops_the_gateway_naming_it(write_yaml):
    bad = write_yaml("tenants.yaml", {"tenants": [{"id": "acme", "requests_per_second": -1}]})
    env = {**os.environ, "AIWORKS_GATEWAY_TENANTS_FILE": str(bad)}
    done = subprocess.run(
        [sys.executable, "-m", "aiworks", "gateway", "--scheduler-address", "127.0.0.1:1", "--metrics-port", "0"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert f"tenants file {bad}: tenant 'acme': field 'requests_per_second'" in done.stderr


def test_parse_time():
    assert parse_time("1767225600") == 1767225600.0
    assert parse_time("2026-01-01T00:00:00Z") == 1767225600.0
    assert parse_time("2026-01-01") == 1767225600.0  # no zone: UTC
    for bad in ("yesterday", "nan"):
        with pytest.raises(InvalidArgument) as info:
            parse_time(bad, "start")
        assert info.value.status is Status.INVALID_ARGUMENT and "'start'" in info.value.message


def test_add_key_command_prints_the_key_once_and_stores_its_hash(write_yaml, tmp_path):
    tenants = write_yaml("tenants.yaml", {"tenants": [{"id": "research"}]})
    keys = tmp_path / "api-keys.yaml"
    command = [sys.executable, "-m", "aiworks", "tenants", "add-key", "--api-keys-file", str(keys)]
    done = subprocess.run(
        [*command, "research", "--label", "notebook", "--tenants-file", str(tenants)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    key = done.stdout.strip()
    assert key.startswith("aiw_") and "shown once" in done.stderr
    assert key not in keys.read_text() and keys.stat().st_mode & 0o777 == 0o600
    [entry] = yaml.safe_load(keys.read_text())["keys"]
    assert entry["tenant"] == "research" and entry["label"] == "notebook"
    auth = Authenticator(load_tenancy(tenants, keys))
    assert auth.authenticate({"authorization": f"Bearer {key}"}).tenant_id == "research"

    refused = subprocess.run([*command, "nobody", "--tenants-file", str(tenants)], capture_output=True, text=True)
    assert refused.returncode != 0 and "defines no tenant 'nobody'" in refused.stderr


def test_usage_table():
    report = {
        "start": "2026-01-01T00:00:00Z",
        "end": "2026-01-01T02:00:00Z",
        "window_s": 3600,
        "source": "redis",
        "usage": [],
        "totals": [
            {
                "tenant": "acme",
                "model": "iris",
                "window_start": "2026-01-01T00:00:00Z",
                "window_end": "2026-01-01T02:00:00Z",
                "requests": 13,
                "rows": 22,
                "compute_seconds": 0.27,
                "cache_hits": 5,
                "prompt_tokens": 120,
                "completion_tokens": 64,
            },
        ],  # fmt: skip
    }
    lines = format_report(report).splitlines()
    assert lines[0] == "usage 2026-01-01T00:00:00Z .. 2026-01-01T02:00:00Z (windows of 3600 s, source redis)"
    assert lines[1].split() == [
        "tenant", "model", "requests", "rows", "compute_seconds", "cache_hits", "prompt_tokens", "completion_tokens"
    ]  # fmt: skip
    assert lines[2].split() == ["acme", "iris", "13", "22", "0.270", "5", "120", "64"]
    assert format_report(report, per_window=True).endswith("no usage in this period")
