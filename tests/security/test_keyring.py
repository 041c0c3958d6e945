"""The credential key file as a key ring (aiworks.security.keyring): a rotation's steps, rolled out one
process at a time, never leave a gateway sealing or minting under a key a runner, worker or other gateway
cannot open or verify; a retired key opens nothing."""

from __future__ import annotations

import stat

import pytest

from aiworks.core.errors import InvalidArgument
from aiworks.security.callers import ensure_secret_file
from aiworks.security.keyring import parse_keys, read_keys, rotate_file, rotated
from aiworks.security.sealing import Sealer, SealError
from aiworks.security.work_tokens import TokenError, WorkTokens

CREDENTIAL = "Bearer aiwt1.example"
CLAIMS = dict(tenant="alice", method="api_key", subject="k", work="batch", model="digits", lifetime_s=60)


def _works_between(gateway: list[bytes], other: list[bytes]) -> bool:
    """Whether what a gateway holding ``gateway`` seals and mints, a process holding ``other`` opens and verifies."""
    try:
        Sealer(other).open(Sealer(gateway).seal(CREDENTIAL, "batch job b"), "batch job b")
        WorkTokens(other).verify(WorkTokens(gateway).mint(**CLAIMS))
    except (SealError, TokenError):
        return False
    return True


def test_each_rollout_step_works_between_processes_on_either_side_of_it() -> None:
    before = [b"the-key-everything-was-sealed-under"]
    staged = rotated(before, "stage")
    promoted = rotated(staged, "promote")
    retired = rotated(promoted, "retire")
    assert staged[0] == before[0] and len(staged) == 2, "staging seals under the same key"
    assert promoted == [staged[1], before[0]] and retired == [staged[1]]
    # While a step rolls out, some processes hold the file before it and some after: both ways work.
    for older, newer in ((before, staged), (staged, promoted), (promoted, retired)):
        assert _works_between(older, newer) and _works_between(newer, older), (older, newer)
    # Skipping the staging step is what breaks: a runner still on the old file cannot open the new key's seal.
    assert not _works_between(promoted, before)
    # at-once is stage and promote in one, for installs that restart every process together.
    at_once = rotated(before, "at-once")
    assert at_once[1:] == before and at_once[0] != before[0] and _works_between(at_once, before) is False


def test_what_an_older_key_sealed_opens_until_it_is_retired_and_then_names_the_ids() -> None:
    old = [b"0123456789abcdef-old-installation-key"]
    sealed = Sealer(old).seal(CREDENTIAL, "request req_1")
    token = WorkTokens(old).mint(**CLAIMS)
    ring = rotated(old, "at-once")
    sealer = Sealer(ring)
    assert sealer.open(sealed, "request req_1") == CREDENTIAL
    assert WorkTokens(ring).verify(token).tenant == "alice"
    assert sealer.key_ids == (Sealer(ring[:1]).key_id, Sealer(old).key_id)
    assert sealer.seal(CREDENTIAL, "x").startswith(f"aiw1.{sealer.key_id}.")
    assert WorkTokens(ring).mint(**CLAIMS).startswith(f"aiwt1.{WorkTokens(ring).key_id}.")
    assert sealer.describe() == f"credential key ids {sealer.key_ids[0]} (seals), {sealer.key_ids[1]} (opens only)"
    tokens = WorkTokens(ring)
    assert tokens.describe() == f"work tokens: credential key ids {tokens.key_ids[0]} (mints), {tokens.key_ids[1]} " \
        "(verifies only)"
    retired = Sealer(rotated(ring, "retire"))
    with pytest.raises(SealError) as caught:
        retired.open(sealed, "request req_1")
    assert Sealer(old).key_id in caught.value.message and retired.key_id in caught.value.message
    assert "retired" in caught.value.message and CREDENTIAL not in caught.value.message
    with pytest.raises(TokenError, match="does not hold"):
        WorkTokens(rotated(ring, "retire")).verify(token)


def test_key_files_parse_line_by_line_and_a_file_of_one_line_is_a_ring_of_one(tmp_path) -> None:
    path = tmp_path / "credential-key"
    first = ensure_secret_file(path)
    assert read_keys(path) == [first]
    assert Sealer.from_file(path).key_id == Sealer(first).key_id, "the same key id as before key rings"
    assert parse_keys(b"\n  aaaaaaaaaaaaaaaaaaaa  \n\nbbbbbbbbbbbbbbbbbbbb\naaaaaaaaaaaaaaaaaaaa\n") == [
        b"aaaaaaaaaaaaaaaaaaaa", b"bbbbbbbbbbbbbbbbbbbb"]  # fmt: skip
    with pytest.raises(InvalidArgument, match="line 2 holds 5 bytes"):
        parse_keys(b"aaaaaaaaaaaaaaaaaaaa\nshort\n")
    with pytest.raises(InvalidArgument, match="stage a new one before promoting"):
        rotated([first], "promote")


def test_rotating_a_file_keeps_it_private_and_replaces_it_whole(tmp_path) -> None:
    path = tmp_path / "credential-key"
    first = ensure_secret_file(path)
    keys = rotate_file(path, "stage")
    assert read_keys(path) == keys and keys[0] == first and len(keys[1]) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    rotate_file(path, "promote")
    assert read_keys(path) == [keys[1], first]
    assert rotate_file(path, "retire") == [keys[1]]
    assert [p.name for p in tmp_path.iterdir()] == ["credential-key"], "no temporary file left behind"
