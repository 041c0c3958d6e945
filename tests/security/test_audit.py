"""The hash-chained audit log: writing from asyncio, resuming, and catching each kind of tampering."""

from __future__ import annotations

import asyncio
import json
import stat
import threading

import pytest

from aiworks.core.errors import InvalidArgument, Unavailable
from aiworks.security.audit import GENESIS, AuditChainError, AuditLog, chain_hash, verify_audit_log


async def _write(path, n: int = 6, key: bytes | None = None) -> list[dict]:
    async with AuditLog(path, key=key, flush_interval_s=0.01) as audit:
        out = []
        for i in range(n):
            if i % 3 == 2:
                out.append(
                    audit.admin(actor="alice", action="traffic.set", model="digits", details={"weights": "1=90,2=10"})
                )
            else:
                out.append(
                    audit.inference(
                        tenant="acme", model="digits", version="1", status="OK", latency_ms=1.25 + i, request_id=f"r{i}"
                    )
                )
    return out


def _lines(path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def _save(path, lines) -> None:
    path.write_text("".join(lines))


async def test_written_log_verifies_and_chains(tmp_path):
    path = tmp_path / "audit.jsonl"
    records = await _write(path)
    result = verify_audit_log(path)
    assert result.ok, result.summary()
    assert (result.records, result.head_seq, result.head_hash) == (6, 6, records[-1]["hash"])
    lines = [json.loads(x) for x in _lines(path)]
    assert lines[0]["prev"] == GENESIS and lines[0]["seq"] == 1
    assert all(b["prev"] == a["hash"] for a, b in zip(lines, lines[1:]))
    assert lines[0]["kind"] == "inference" and lines[0]["tenant"] == "acme" and lines[0]["latency_ms"] == 1.25
    assert (
        lines[2]["kind"] == "admin" and lines[2]["actor"] == "alice" and lines[2]["details"] == {"weights": "1=90,2=10"}
    )
    assert stat.S_IMODE(path.stat().st_mode) & 0o007 == 0


async def test_edited_line_is_found(tmp_path):
    path = tmp_path / "audit.jsonl"
    await _write(path)
    lines = _lines(path)
    lines[3] = lines[3].replace('"status":"OK"', '"status":"ERROR"')
    _save(path, lines)
    result = verify_audit_log(path)
    assert not result.ok and result.bad_line == 4
    assert "edited" in result.reason


async def test_edited_line_with_a_recomputed_hash_is_found_at_the_next_line(tmp_path):
    path = tmp_path / "audit.jsonl"
    await _write(path)
    lines = _lines(path)
    record = json.loads(lines[1])
    record["tenant"] = "mallory"
    record["hash"] = chain_hash(record)
    lines[1] = json.dumps(record) + "\n"
    _save(path, lines)
    result = verify_audit_log(path)
    assert not result.ok and result.bad_line == 3
    assert "prev does not match" in result.reason


async def test_edited_line_with_a_recomputed_hash_is_caught_at_once_with_a_key(tmp_path):
    path = tmp_path / "audit.jsonl"
    key = b"k" * 32
    await _write(path, key=key)
    assert verify_audit_log(path, key=key).ok
    assert not verify_audit_log(path).ok  # an HMAC chain does not verify as a plain one
    lines = _lines(path)
    record = json.loads(lines[1])
    record["tenant"] = "mallory"
    record["hash"] = chain_hash(record)  # the forger lacks the key
    lines[1] = json.dumps(record) + "\n"
    _save(path, lines)
    result = verify_audit_log(path, key=key)
    assert not result.ok and result.bad_line == 2


async def test_removed_line_is_found(tmp_path):
    path = tmp_path / "audit.jsonl"
    await _write(path)
    lines = _lines(path)
    del lines[2]
    _save(path, lines)
    result = verify_audit_log(path)
    assert not result.ok and result.bad_line == 3
    assert "seq 4 where 3 was expected" in result.reason and "missing" in result.reason


async def test_inserted_line_is_found(tmp_path):
    path = tmp_path / "audit.jsonl"
    await _write(path)
    lines = _lines(path)
    lines.insert(4, lines[1])  # a genuine line, replayed
    _save(path, lines)
    result = verify_audit_log(path)
    assert not result.ok and result.bad_line == 5
    assert "inserted" in result.reason


async def test_forged_inserted_line_is_found_at_the_line_after_it(tmp_path):
    path = tmp_path / "audit.jsonl"
    await _write(path)
    lines = _lines(path)
    before = json.loads(lines[2])
    forged = {**json.loads(lines[0]), "seq": 4, "prev": before["hash"], "tenant": "mallory"}
    forged["hash"] = chain_hash(forged)
    lines.insert(3, json.dumps(forged) + "\n")
    _save(path, lines)
    result = verify_audit_log(path)
    assert not result.ok and result.bad_line == 5
    assert "seq 4 where 5 was expected" in result.reason


async def test_reordered_lines_are_found(tmp_path):
    path = tmp_path / "audit.jsonl"
    await _write(path)
    lines = _lines(path)
    lines[2], lines[3] = lines[3], lines[2]
    _save(path, lines)
    result = verify_audit_log(path)
    assert not result.ok and result.bad_line == 3
    assert "moved" in result.reason


async def test_garbage_and_truncated_lines_are_found(tmp_path):
    path = tmp_path / "audit.jsonl"
    await _write(path)
    lines = _lines(path)
    _save(path, [*lines[:2], "not json\n", *lines[3:]])
    assert verify_audit_log(path).bad_line == 3
    _save(path, [*lines[:-1], lines[-1][:20]])
    result = verify_audit_log(path)
    assert result.bad_line == 6 and "incomplete" in result.reason


async def test_truncated_tail_is_caught_against_a_recorded_head(tmp_path):
    path = tmp_path / "audit.jsonl"
    records = await _write(path)
    _save(path, _lines(path)[:-2])
    result = verify_audit_log(path)
    assert result.ok  # a shorter chain is still a chain ...
    assert result.head_hash != records[-1]["hash"]  # ... which the recorded head exposes


async def test_writer_resumes_the_chain_after_a_restart(tmp_path):
    path = tmp_path / "audit.jsonl"
    await _write(path, 3)
    async with AuditLog(path) as audit:
        assert audit.head[0] == 3
        nxt = audit.admin(actor="ops", action="model.load", model="iris")
    assert nxt["seq"] == 4
    result = verify_audit_log(path)
    assert result.ok and result.records == 4


async def test_writer_refuses_to_continue_a_broken_tail(tmp_path):
    path = tmp_path / "audit.jsonl"
    await _write(path, 3)
    lines = _lines(path)
    _save(path, [*lines[:-1], lines[-1].replace('"alice"', '"mallory"')])
    with pytest.raises(AuditChainError, match="does not match its hash"):
        await AuditLog(path).start()
    _save(path, [*lines[:-1], lines[-1][:15]])
    with pytest.raises(AuditChainError, match="incomplete line"):
        await AuditLog(path).start()


async def test_one_writer_per_file(tmp_path):
    path = tmp_path / "audit.jsonl"
    async with AuditLog(path):
        with pytest.raises(Unavailable, match="already open for writing"):
            await AuditLog(path).start()


async def test_concurrent_tasks_and_threads_keep_one_intact_chain(tmp_path):
    path = tmp_path / "audit.jsonl"

    async with AuditLog(path, flush_interval_s=0.005) as audit:

        async def task(t: int):
            for i in range(50):
                audit.inference(
                    tenant=f"t{t}", model="m", version="1", status="OK", latency_ms=0.1, request_id=f"{t}-{i}"
                )
                await asyncio.sleep(0)

        def thread_body(t: int):
            for i in range(50):
                audit.admin(actor=f"thread{t}", action="ping", details={"i": i})

        threads = [threading.Thread(target=thread_body, args=(t,)) for t in range(2)]
        for th in threads:
            th.start()
        await asyncio.gather(*(task(t) for t in range(8)))
        await asyncio.to_thread(lambda: [th.join() for th in threads])
    result = verify_audit_log(path)
    assert result.ok, result.summary()
    assert result.records == 8 * 50 + 2 * 50


async def test_record_buffers_and_lines_reach_the_disk_without_an_explicit_flush(tmp_path):
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(path, flush_interval_s=0.01)
    await audit.start()
    try:
        audit.admin(actor="ops", action="tenant.create", tenant="acme")
        assert path.read_bytes() == b""  # record() only buffers: the event loop never waits on the disk
        for _ in range(100):
            if path.read_bytes():
                break
            await asyncio.sleep(0.01)
        assert json.loads(path.read_text())["action"] == "tenant.create"
    finally:
        await audit.close()


async def test_payloads_are_refused(tmp_path):
    async with AuditLog(tmp_path / "audit.jsonl") as audit:
        with pytest.raises(InvalidArgument, match="payloads are never logged"):
            audit.admin(actor="a", action="x", details={"input": b"\x00\x01"})
        with pytest.raises(InvalidArgument, match="payloads are never logged"):
            audit.admin(actor="a", action="x", details={"prompt": "y" * 5000})
        with pytest.raises(InvalidArgument, match="payloads are never logged"):
            audit.admin(actor="a", action="x", details={"tensor": [1.0, 2.0]})
        with pytest.raises(InvalidArgument, match="kind"):
            audit.record("debug")
        assert audit.head[0] == 0  # nothing refused was chained


def test_blocking_use_without_an_event_loop(tmp_path):
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(path)
    audit.open()
    audit.admin(actor="cli", action="certs.issue", details={"services": "gateway,scheduler"})
    audit.flush_sync()
    audit.admin(actor="cli", action="model.encrypt", model="digits", version=2)
    audit.close_sync()
    result = verify_audit_log(path)
    assert result.ok and result.records == 2
    assert json.loads(path.read_text().splitlines()[1])["version"] == "2"
