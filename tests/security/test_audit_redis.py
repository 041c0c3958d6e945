"""The audit chain in a shared Redis Stream (audit_sink redis), against a private redis-server.

Several writers (gateway replicas) append to one stream, each its own chain; `aiworks audit verify
--redis-url` checks every chain and each writer's head, so removing records from the end is caught,
which a file alone cannot show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import redis
from cache.support import RedisServer

from aiworks.security.audit import AuditChainError, AuditLog
from aiworks.security.audit_redis import RedisStreamSink, heads_key, verify_audit_stream

STREAM = "aiworks:audit"


def writer(url: str, name: str, key: bytes | None = None) -> AuditLog:
    log = AuditLog(sink=RedisStreamSink(url, writer=name), key=key)
    log.open()
    return log


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiworks", "audit", "verify", "-o", "json", *args],
                          env={**os.environ, "AIWORKS_AUDIT_REDIS_URL": url}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_replicas_share_one_stream_each_with_its_own_chain(redis_url):
    a, b = writer(redis_url, "gateway-0"), writer(redis_url, "gateway-1")
    for i in range(30):
        (a if i % 3 else b).inference(tenant="t", model="m", version="1", status="ok", latency_ms=1.0,
                                      request_id=f"r{i}")  # fmt: skip
        if i % 7 == 0:
            a.flush_sync()
            b.flush_sync()
    a.close_sync()
    b.close_sync()
    result = verify_audit_stream(redis_url)
    assert result.ok, result.summary()
    assert {w: r.records for w, r in result.writers.items()} == {"gateway-0": 20, "gateway-1": 10}
    entries = redis.Redis.from_url(redis_url).xrange(STREAM)
    # Every record once; each writer's in its own order (batches of the writers interleave as they are flushed).
    records = [(f[b"w"].decode(), json.loads(f[b"line"])) for _, f in entries]
    assert sorted(r["request_id"] for _, r in records) == sorted(f"r{i}" for i in range(30))
    for name in ("gateway-0", "gateway-1"):
        seqs = [r["seq"] for w, r in records if w == name]
        assert seqs == list(range(1, len(seqs) + 1))
    done = cli(redis_url)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["writers"]["gateway-1"]["head_seq"] == 10


def test_a_restarted_writer_continues_its_chain(redis_url):
    first = writer(redis_url, "gateway-0", key=b"k")
    first.admin(actor="ops", action="model.load", model="m")
    first.close_sync()
    again = writer(redis_url, "gateway-0", key=b"k")
    assert again.head[0] == 1
    again.admin(actor="ops", action="model.unload", model="m")
    again.close_sync()
    assert verify_audit_stream(redis_url, key=b"k").writers["gateway-0"].head_seq == 2
    assert not verify_audit_stream(redis_url, key=b"other").ok  # an HMAC chain needs its key
    with pytest.raises(AuditChainError, match="another audit key"):
        writer(redis_url, "gateway-0", key=b"other")


def test_two_processes_under_one_name_fail_loudly_instead_of_forking_the_chain(redis_url):
    one, two = writer(redis_url, "gateway-0"), writer(redis_url, "gateway-0")
    one.admin(actor="a", action="x")
    one.flush_sync()
    two.admin(actor="b", action="y")
    with pytest.raises(AuditChainError, match="same name"):
        two.flush_sync()
    assert verify_audit_stream(redis_url).ok


@pytest.mark.parametrize("tamper", ["delete_middle", "delete_last", "forge", "delete_writer"])
def test_tampering_is_named(redis_url, tamper):
    log = writer(redis_url, "gateway-0")
    for i in range(5):
        log.inference(tenant="t", model="m", version="1", status="ok", latency_ms=1.0, request_id=f"r{i}")
    log.close_sync()
    client = redis.Redis.from_url(redis_url)
    ids = [entry_id for entry_id, _ in client.xrange(STREAM)]
    if tamper == "delete_middle":
        client.xdel(STREAM, ids[2])
        expected = "missing before it"
    elif tamper == "delete_last":
        client.xdel(STREAM, ids[-1])
        expected = "removed from the end"
    elif tamper == "forge":
        line = json.loads(client.xrange(STREAM, ids[1], ids[1])[0][1][b"line"])
        line["status"] = "permission_denied"
        client.xadd(STREAM, {"w": "gateway-0", "line": json.dumps(line)})
        expected = "hash does not match"
    else:
        client.delete(STREAM)
        expected = "no records left"
    result = verify_audit_stream(redis_url)
    assert not result.ok
    assert expected in result.summary()
    done = cli(redis_url)
    assert done.returncode == 1 and not json.loads(done.stdout)["ok"]


def test_the_writer_refuses_to_continue_a_broken_head(redis_url):
    log = writer(redis_url, "gateway-0")
    log.admin(actor="a", action="x")
    log.close_sync()
    client = redis.Redis.from_url(redis_url)
    client.delete(STREAM)
    with pytest.raises(AuditChainError, match="missing"):
        writer(redis_url, "gateway-0")
    assert client.hget(heads_key(STREAM), "gateway-0")


def test_an_unreachable_redis_keeps_the_lines_for_later(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    log = writer(server.url, "gateway-0")
    server.stop()
    log.admin(actor="a", action="x")
    with pytest.raises(OSError):
        log.flush_sync()
    server.start()
    try:
        log.flush_sync()  # the buffered line goes out once Redis is back (a fresh server: a new, empty stream)
        result = verify_audit_stream(server.url)
        assert result.ok and result.writers["gateway-0"].records == 1, result.summary()
    finally:
        log.close_sync()
        server.stop()


def test_cli_refuses_files_and_a_stream_together(redis_url, tmp_path):
    done = cli(redis_url, str(tmp_path / "audit.jsonl"))
    assert done.returncode == 2 and "not both" in done.stderr
