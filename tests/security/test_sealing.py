"""Sealed credentials (aiworks.security.sealing): what the gateway keeps in Redis for a batch job or a queued
request, and what a runner or worker with the same key file, another one, or none makes of it."""

from __future__ import annotations

import pytest

from aiworks.core.errors import Status
from aiworks.security.callers import ensure_secret_file
from aiworks.security.sealing import Sealer, SealError, is_sealed, load_sealer, seal, unseal

KEY = "Bearer aiw_0123456789abcdef0123456789abcdef"


def test_a_sealed_credential_opens_under_its_key_and_record_only(tmp_path) -> None:
    path = tmp_path / "credential-key"
    ensure_secret_file(path)
    gateway, runner = Sealer.from_file(path), Sealer.from_file(path)
    sealed = gateway.seal(KEY, "batch job batch_1")
    assert is_sealed(sealed) and "aiw_" not in sealed and "0123456789abcdef" not in sealed
    assert sealed != gateway.seal(KEY, "batch job batch_1"), "a fresh nonce each time"
    assert runner.open(sealed, "batch job batch_1") == KEY
    # Copied onto another job's record, it does not open.
    with pytest.raises(SealError, match="does not open"):
        runner.open(sealed, "batch job batch_2")
    # Changed by one character, it does not open either.
    tail = sealed[-3]
    changed = sealed[:-3] + ("A" if tail != "A" else "B") + sealed[-2:]
    with pytest.raises(SealError, match="does not open"):
        runner.open(changed, "batch job batch_1")


def test_another_key_is_named_by_its_id_rather_than_sending_a_wrong_credential(tmp_path) -> None:
    ensure_secret_file(tmp_path / "a")
    ensure_secret_file(tmp_path / "b")
    a, b = Sealer.from_file(tmp_path / "a"), Sealer.from_file(tmp_path / "b")
    sealed = a.seal(KEY, "request req_1")
    with pytest.raises(SealError) as caught:
        b.open(sealed, "request req_1")
    assert a.key_id in caught.value.message and b.key_id in caught.value.message
    assert caught.value.status is Status.INTERNAL
    assert KEY not in caught.value.message


def test_stores_keep_nothing_or_a_sealed_value_and_open_a_clear_one_from_before_sealing(tmp_path) -> None:
    ensure_secret_file(tmp_path / "k")
    sealer = Sealer.from_file(tmp_path / "k")
    assert seal(sealer, None, "x") is None and seal(sealer, "", "x") is None
    stored = seal(sealer, KEY, "batch job j")
    assert is_sealed(stored) and unseal(sealer, stored, "batch job j") == KEY
    # A job or request written in clear (before sealing, or by a gateway without a key) still runs.
    assert unseal(sealer, KEY, "batch job j") == KEY and unseal(None, KEY, "batch job j") == KEY
    assert unseal(None, None, "batch job j") is None
    with pytest.raises(SealError, match="no credential key file"):
        unseal(None, stored, "batch job j")


def test_a_runner_given_a_key_file_it_cannot_read_stops_naming_the_variable(tmp_path, caplog) -> None:
    with pytest.raises(SystemExit, match="AIWORKS_BATCH_CREDENTIAL_KEY_FILE: credential key file .* does not exist"):
        load_sealer(tmp_path / "missing", "AIWORKS_BATCH_CREDENTIAL_KEY_FILE", "jobs")
    (tmp_path / "short").write_text("tiny\n")
    with pytest.raises(SystemExit, match="holds 4 bytes"):
        load_sealer(tmp_path / "short", "AIWORKS_BATCH_CREDENTIAL_KEY_FILE", "jobs")
    assert load_sealer(None, "AIWORKS_BATCH_CREDENTIAL_KEY_FILE", "jobs") is None
    assert "AIWORKS_BATCH_CREDENTIAL_KEY_FILE" in caplog.text
