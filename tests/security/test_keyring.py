"""The credential key file as a key ring (aiworks.security.keyring): a rotation's steps, rolled out one
process at a time, never leave a gateway sealing or minting under a key a runner, worker or other gateway
cannot open or verify; a retired key opens nothing."""

from __future__ import annotations

import asyncio
import logging
import stat

import pytest
from prometheus_client import REGISTRY

from aiworks.core.errors import InvalidArgument
from aiworks.security.callers import ensure_secret_file
from aiworks.security.keyring import KeyFileWatch, parse_keys, read_keys, rotate_file, rotated, watch_key_file
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


def _gauge() -> dict[str, str]:
    """The ``aiworks_credential_key_info`` samples: key id -> role."""
    return {s.labels["key_id"]: s.labels["role"] for m in REGISTRY.collect() if m.name == "aiworks_credential_key_info"
            for s in m.samples if s.value == 1}  # fmt: skip


def test_a_watched_key_file_hands_each_step_to_the_holders_and_a_broken_file_changes_nothing(tmp_path, caplog):
    """No restart: the sealer and the work tokens take each rotation step in place, the gauge follows, and
    a file that cannot be read or holds a bad line is logged once while the ring in use stays."""
    caplog.set_level(logging.INFO, logger="aiworks.security.keyring")
    path = tmp_path / "credential-key"
    ensure_secret_file(path)
    sealer, tokens = Sealer.from_file(path), WorkTokens.from_file(path)
    watch = KeyFileWatch(path, [sealer, tokens])
    (old,) = sealer.key_ids
    assert _gauge() == {old: "current"} and not watch.check(), "an unchanged file is no change"
    sealed_old, token_old = sealer.seal(CREDENTIAL, "job a"), tokens.mint(**CLAIMS)

    rotate_file(path, "stage")
    assert watch.check() and sealer.key_ids[0] == old and len(sealer.key_ids) == 2
    new = sealer.key_ids[1]
    assert _gauge() == {old: "current", new: "previous"}
    rotate_file(path, "promote")
    assert watch.check() and sealer.key_ids == (new, old) and len(tokens.key_ids) == 2
    assert _gauge() == {new: "current", old: "previous"}
    assert sealer.seal(CREDENTIAL, "job b").startswith(f"aiw1.{new}."), "the new key seals at once"
    assert sealer.open(sealed_old, "job a") == CREDENTIAL and tokens.verify(token_old).tenant == "alice"
    assert f"now credential key ids {new} (seals), {old} (opens only); work tokens:" in caplog.text

    good = path.read_bytes()
    caplog.clear()
    for broken in (b"short\n", b"\n\n"):
        path.write_bytes(broken)
        assert not watch.check() and not watch.check(), "a broken file keeps the ring"
    path.unlink()
    assert not watch.check() and not watch.check()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3, "each failure logged once, not every interval"
    assert "line 1 holds 5 bytes" in errors[0] and "holds no key" in errors[1] and "cannot be read" in errors[2]
    assert all(f"keeping credential key ids {new} (seals)" in e for e in errors)
    assert sealer.key_ids == (new, old) and _gauge() == {new: "current", old: "previous"}
    assert "short" not in caplog.text and good.decode().split()[0] not in caplog.text, "no key reaches the log"

    path.write_bytes(good)
    rotate_file(path, "retire")
    assert watch.check() and sealer.key_ids == (new,) and _gauge() == {new: "current"}
    with pytest.raises(SealError, match="a retired key opens nothing"):
        sealer.open(sealed_old, "job a")
    with pytest.raises(TokenError, match="does not hold"):
        tokens.verify(token_old)


def test_the_watch_task_reads_the_file_off_the_loop_every_interval(tmp_path):
    path = tmp_path / "credential-key"
    ensure_secret_file(path)
    sealer = Sealer.from_file(path)

    async def main() -> tuple[str, ...]:
        assert watch_key_file(path, [None], 0.05) is None and watch_key_file(None, [sealer], 0.05) is None
        task = watch_key_file(path, [sealer, None], 0.05)
        rotate_file(path, "at-once")
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(sealer.key_ids) == 2:
                break
        task.cancel()
        return sealer.key_ids

    ids = asyncio.run(main())
    assert len(ids) == 2 and ids == Sealer.from_file(path).key_ids


def test_a_key_not_yet_read_makes_the_holder_read_the_file_at_once(tmp_path, monkeypatch):
    """One machine, one rotation at once: a gateway that took the new file seals and mints under the new key
    before a runner's (or another gateway's) next interval. The runner reads the file again when it meets the
    unknown key id, and opens the value; a key that is in no file is refused, and read for at most once a
    second."""
    path = tmp_path / "credential-key"
    ensure_secret_file(path)
    runner, verifier = Sealer.from_file(path), WorkTokens.from_file(path)
    watch = KeyFileWatch(path, [runner, verifier])
    rotate_file(path, "at-once")
    gateway = Sealer.from_file(path)
    sealed = gateway.seal(CREDENTIAL, "job n")
    assert runner.open(sealed, "job n") == CREDENTIAL and runner.key_ids == gateway.key_ids
    rotate_file(path, "at-once")  # another step, a second later than the last read: tokens too
    monkeypatch.setattr(watch, "_refreshed_at", float("-inf"))
    assert verifier.verify(WorkTokens.from_file(path).mint(**CLAIMS)).tenant == "alice"
    reads = []
    real_read = watch._read
    monkeypatch.setattr(watch, "_read", lambda: reads.append(1) or real_read())
    monkeypatch.setattr(watch, "_refreshed_at", float("-inf"))
    foreign = Sealer([b"a-key-that-is-in-no-file-0123456789"]).seal(CREDENTIAL, "job f")
    for _ in range(3):
        with pytest.raises(SealError, match="a retired key opens nothing"):
            runner.open(foreign, "job f")
    assert len(reads) == 1, "an unknown key reads the file at most once a second"
