"""The job store against a private redis-server: chunks recorded once, by the lease holder only; cancel states."""

from __future__ import annotations

import asyncio

import pytest

from aiworks.batch.jobs import Job, JobStore, part_name
from aiworks.batch.service import BatchService
from aiworks.core.errors import InvalidArgument, NotFound, ResourceExhausted


@pytest.fixture
async def store(redis_url):
    store = JobStore.from_url(redis_url)
    yield store
    await store.close()


async def _upload(service: BatchService, filename: str, data: bytes):
    """A file uploaded for tenant ``t`` as the gateway's route does it: started, written, ended."""
    file_id, sink = await service.start_upload("t", filename)
    sink.write(data)
    return await service.end_upload("t", file_id, filename, "batch", sink)


def _job(job_id: str = "batch_1", tenant: str = "t") -> Job:
    return Job(id=job_id, tenant=tenant, model="m", input_url="in", output_url="out", error_url="err")


async def test_a_chunk_counts_once_and_only_for_the_lease_holder(store):
    await store.create(_job(), credential="Bearer k")
    assert await store.credential("batch_1") == "Bearer k"
    assert await store.claim("batch_1", "r1", 5.0)
    assert not await store.claim("batch_1", "r2", 5.0)  # held
    assert await store.record_chunk("batch_1", "r1", 0, part_name(0, "r1", True, False), 1, 0) == 1
    assert await store.record_chunk("batch_1", "r1", 0, part_name(0, "r1", True, True), 1, 0) == 0  # in: not counted
    assert await store.record_chunk("batch_1", "r2", 1, part_name(1, "r2", True, False), 1, 0) == -1  # not the holder
    job = await store.get("batch_1")
    assert (job.completed, job.failed, job.chunks_done) == (1, 0, 1)
    assert await store.chunk_parts("batch_1") == {0: "00000000.r1.o"}  # the first record stands
    assert await store.done_chunks("batch_1") == {0}


async def test_an_expired_lease_passes_to_another_runner(store):
    await store.create(_job())
    assert await store.claim("batch_1", "r1", 0.2)
    await asyncio.sleep(0.3)
    assert await store.claim("batch_1", "r2", 5.0)
    assert await store.record_chunk("batch_1", "r1", 0, part_name(0, "r1", True, False), 1, 0) == -1  # the old holder is fenced off
    assert not await store.renew("batch_1", "r1", 5.0)


async def test_cancel_only_moves_a_job_that_can_still_stop(store):
    await store.create(_job())
    assert await store.request_cancel("batch_1") == "cancelling"
    assert await store.request_cancel("batch_1") == "cancelling"
    await store.finish("batch_1", "cancelled")
    assert await store.request_cancel("batch_1") == "cancelled"
    assert await store.active_ids() == [] and await store.credential("batch_1") is None


async def test_submission_refuses_a_missing_input_and_hides_other_tenants_jobs(store, tmp_path):
    service = BatchService(store, str(tmp_path / "files"))
    with pytest.raises(NotFound, match="input file does not exist"):
        await service.submit("t", "digits", str(tmp_path / "nope.jsonl"), "o", "e")
    with pytest.raises(InvalidArgument, match="unsupported location"):
        await service.submit("t", "digits", "ftp://host/x.jsonl", "o", "e")
    (tmp_path / "in.jsonl").write_text("{}\n")
    job = await service.submit("t", "digits", str(tmp_path / "in.jsonl"), "o", "e", chunk_size=7)
    assert (await service.get("t", job.id)).chunk_size == 7
    with pytest.raises(NotFound):
        await service.get("u", job.id)
    assert await service.list("u") == ([], False) and [j.id for j in (await service.list("t"))[0]] == [job.id]


def test_the_runner_collector_reports_progress_and_active_jobs():
    from aiworks.batch.metrics import BatchCollector

    running = _job("batch_a", "t")
    running.status, running.total, running.completed, running.failed = "in_progress", 200, 90, 10
    queued = _job("batch_b", "u")
    families = {f.name: f for f in BatchCollector(lambda: [running, queued]).collect()}
    progress = families["aiworks_batch_job_progress_ratio"].samples
    assert [(s.labels, s.value) for s in progress] == [({"job": "batch_a", "tenant": "t"}, 0.5)]
    active = {s.labels["status"]: s.value for s in families["aiworks_batch_jobs_active"].samples}
    assert active == {"in_progress": 1, "validating": 1}


async def test_a_tenant_over_its_active_job_cap_is_refused_at_submission(store, tmp_path):
    from aiworks.core.errors import ResourceExhausted

    (tmp_path / "in.jsonl").write_text("{}\n")
    service = BatchService(store, None, max_active_jobs=2)
    first = await service.submit("t", "digits", str(tmp_path / "in.jsonl"), "o", "e")
    await service.submit("t", "digits", str(tmp_path / "in.jsonl"), "o", "e")
    with pytest.raises(ResourceExhausted, match="already has 2 batch jobs not yet ended") as refused:
        await service.submit("t", "digits", str(tmp_path / "in.jsonl"), "o", "e")
    assert refused.value.status.http == 429
    await service.submit("u", "digits", str(tmp_path / "in.jsonl"), "o", "e")  # another tenant's cap is its own
    await store.finish(first.id, "completed")
    await service.submit("t", "digits", str(tmp_path / "in.jsonl"), "o", "e")  # an ended job frees its place


async def test_a_job_whose_chunks_were_recorded_inline_before_parts_still_finishes_whole(store, tmp_path):
    """A job in flight across the upgrade to parts: its chunks' lines in Redis become parts, then its files."""
    from aiworks.batch.runner import BatchRunner
    from aiworks.batch.settings import BatchSettings

    (tmp_path / "in.jsonl").write_bytes(b'{"inputs": [{}]}\n' * 3)
    job = await BatchService(store, None).submit("t", "digits", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                                                 str(tmp_path / "err.jsonl"), chunk_size=2)  # fmt: skip
    await store.update(job.id, status="in_progress", total=3, chunks_total=2, completed=2, failed=1, chunks_done=2)
    await store.redis.hset(store._k("chunks", job.id), mapping={"o:0": '{"line": 1}\n{"line": 2}\n', "e:0": "",
                                                                "o:1": "", "e:1": '{"line": 3}\n'})  # fmt: skip
    runner = BatchRunner(store, BatchSettings(redis_url="redis://unused", gateway_url="http://127.0.0.1:9"))
    try:
        assert await runner.run_once()  # every chunk is in: nothing is sent
    finally:
        await runner.close()
    ended = await store.get(job.id)
    assert ended.status == "completed" and (ended.completed, ended.failed) == (2, 1)
    assert (tmp_path / "out.jsonl").read_bytes() == b'{"line": 1}\n{"line": 2}\n'
    assert (tmp_path / "err.jsonl").read_bytes() == b'{"line": 3}\n'
    assert not (tmp_path / "out.jsonl.parts").exists()


async def test_parts_left_by_a_runner_that_died_after_ending_its_job_are_swept_by_an_idle_runner(store, tmp_path):
    """The job ended (its files written, its status final) and its runner died before removing the parts: the job
    is on the sweep list from the moment it ended, and the next idle poll of any runner removes them."""
    from aiworks.batch.runner import BatchRunner
    from aiworks.batch.settings import BatchSettings

    (tmp_path / "in.jsonl").write_bytes(b'{"inputs": [{}]}\n')
    job = await BatchService(store, None).submit("t", "digits", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                                                 str(tmp_path / "err.jsonl"))  # fmt: skip
    parts = tmp_path / "out.jsonl.parts"
    parts.mkdir()
    (parts / "00000000.dead-runner.out").write_bytes(b'{"line": 1}\n')
    await store.finish(job.id, "completed")  # ... and the runner was killed here
    assert parts.exists()
    runner = BatchRunner(store, BatchSettings(redis_url="redis://unused", gateway_url="http://127.0.0.1:9"))
    try:
        # The same output resubmitted: while that job runs, the folder holds its parts, and is left to it.
        again = await BatchService(store, None).submit("t", "digits", str(tmp_path / "in.jsonl"),
                                                       str(tmp_path / "out.jsonl"), str(tmp_path / "err.jsonl"))  # fmt: skip
        await store.claim(again.id, "someone-else", 30.0)  # held by a runner elsewhere: not this one's to run
        assert not await runner.run_once()
        assert parts.exists()
        await store.finish(again.id, "cancelled")
        assert not await runner.run_once()  # no job to run: it sweeps one ended job instead
        assert not await runner.run_once()
        assert not parts.exists()
        assert await store.to_sweep() is None  # swept once: off the list
        assert not await runner.run_once()
    finally:
        await runner.close()


async def test_a_job_past_its_completion_window_expires_with_every_line_in_the_error_file(store, tmp_path):
    """The window ended before the runner got to it: no request is sent, each line is reported as expired."""
    import time

    import orjson

    from aiworks.batch.runner import BatchRunner
    from aiworks.batch.service import batch_object
    from aiworks.batch.settings import BatchSettings

    (tmp_path / "in.jsonl").write_bytes(b'{"custom_id": "a", "inputs": [{}]}\nnot json\n{"inputs": [{}]}\n')
    service = BatchService(store, None)
    job = await service.submit("t", "digits", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                               str(tmp_path / "err.jsonl"), chunk_size=2, completion_window="1h")  # fmt: skip
    await store.update(job.id, created_at=time.time() - 3601)
    # A gateway that is never called: nothing may be sent for an expired job.
    runner = BatchRunner(store, BatchSettings(redis_url="redis://unused", gateway_url="http://127.0.0.1:9"))
    try:
        assert await runner.run_once()
    finally:
        await runner.close()
    ended = await store.get(job.id)
    assert ended.status == "expired" and ended.expired_at > 0 and (ended.completed, ended.failed) == (0, 0)
    assert batch_object(ended)["expired_at"] is not None
    assert (tmp_path / "out.jsonl").read_bytes() == b""
    errors = [orjson.loads(line) for line in (tmp_path / "err.jsonl").read_bytes().splitlines()]
    assert [(e["line"], e["custom_id"], e["error"]["code"]) for e in errors] == [
        (1, "a", "batch_expired"), (2, None, "batch_expired"), (3, None, "batch_expired")
    ]


async def test_a_job_over_the_tenants_request_rate_for_its_window_is_refused_at_submission(store, tmp_path, monkeypatch):
    """Counted from the upload's lines as they arrived: the file is not read back (on S3, a second full GET)."""
    import aiworks.batch.service as service_module

    def read_back(*args):
        raise AssertionError("the upload was read back to count its lines")

    monkeypatch.setattr(service_module, "_count_lines", read_back)
    service = BatchService(store, str(tmp_path / "files"))
    line = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}\n'
    body = {"endpoint": "/v2/models/digits/versions/1/infer", "completion_window": "1h"}
    rate = {"requests_per_second": 0.001, "burst": 1}  # 1 + 0.001 x 3600 s = 4 requests in the window
    five = await _upload(service, "five.jsonl", line * 5)
    with pytest.raises(ResourceExhausted, match=r"5 lines.*requests_per_second 0.001 x 3600 s \+ burst 1 = 4") as err:
        await service.create_batch("t", {**body, "input_file_id": five.id}, None, **rate)
    assert err.value.status.http == 429
    assert await store.active_ids() == []  # nothing queued
    four = await _upload(service, "four.jsonl", line * 3 + line[:-1])  # no final newline: still 4
    assert (five.lines, four.lines) == (5, 4) and (await store.get_file(four.id)).lines == 4
    job = await service.create_batch("t", {**body, "input_file_id": four.id}, None, **rate)
    assert job.status == "validating"
    unlimited = await service.create_batch("t", {**body, "input_file_id": five.id}, None)  # no rate: no bound
    assert unlimited.status == "validating"


async def test_a_parquet_job_expires_row_by_row_and_an_unreadable_one_fails(store, tmp_path):
    """Parquet input: the job keeps its format and mapping in Redis; expiry and a broken file end it as JSONL's do."""
    import time

    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq

    from aiworks.batch.runner import BatchRunner
    from aiworks.batch.settings import BatchSettings

    table = pa.table({"custom_id": ["a", None, "c"], "x": pa.array([[1.0], None, [3.0]], pa.list_(pa.float32()))})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=2)
    service = BatchService(store, None)
    job = await service.submit("t", "m", str(tmp_path / "in.parquet"), str(tmp_path / "out.parquet"),
                               str(tmp_path / "err.jsonl"), chunk_size=2, completion_window="1h",
                               input_columns={"input": "x"})  # fmt: skip
    stored = await store.get(job.id)
    assert (stored.format, stored.input_columns) == ("parquet", {"input": ["x"]})
    await store.update(job.id, created_at=time.time() - 3601)
    rate = {"requests_per_second": 0.0001, "burst": 0}  # 0.36 rows in a 1 h window: 3 rows are too many
    upload = await _upload(BatchService(store, str(tmp_path / "files")), "in.parquet", (tmp_path / "in.parquet").read_bytes())
    with pytest.raises(ResourceExhausted, match="the job has 3 lines"):
        await BatchService(store, str(tmp_path / "files")).create_batch(
            "t", {"endpoint": "/v2/models/m/infer", "completion_window": "1h", "input_file_id": upload.id}, None, **rate
        )  # fmt: skip
    runner = BatchRunner(store, BatchSettings(redis_url="redis://unused", gateway_url="http://127.0.0.1:9"))
    try:
        assert await runner.run_once()
        ended = await store.get(job.id)
        assert ended.status == "expired" and ended.total == 3
        assert pq.read_table(tmp_path / "out.parquet").num_rows == 0
        errors = [orjson.loads(line) for line in (tmp_path / "err.jsonl").read_bytes().splitlines()]
        assert [(e["line"], e["custom_id"], e["error"]["code"]) for e in errors] == [
            (1, "a", "batch_expired"), (2, None, "batch_expired"), (3, "c", "batch_expired")
        ]  # fmt: skip
        broken = await service.submit("t", "m", str(tmp_path / "in.parquet"), str(tmp_path / "o2.parquet"),
                                      str(tmp_path / "e2.jsonl"))  # fmt: skip
        (tmp_path / "in.parquet").write_bytes(b"PAR1 not any more")  # replaced after the submission
        assert await runner.run_once()
        failed = await store.get(broken.id)
        assert failed.status == "failed" and "not a readable Parquet file" in failed.error
    finally:
        await runner.close()


async def test_a_job_whose_store_is_down_pauses_and_resumes_and_fails_only_after_its_window(store, tmp_path,
                                                                                            monkeypatch):  # fmt: skip
    """An S3 endpoint that cannot be reached (here: nothing listens) is an outage, not a bad file: the job is
    paused, its lease released, tried again later, and fails only once its completion window has ended."""
    import time

    from aiworks.batch.runner import BatchRunner
    from aiworks.batch.settings import BatchSettings
    from aiworks.supervisor.supervisor import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    job = await store.create(Job(id="batch_s3down", tenant="t", model="digits", input_url="s3://jobs/in.jsonl",
                                 output_url=str(tmp_path / "out.jsonl"), error_url=str(tmp_path / "err.jsonl"),
                                 completion_window="1h", created_at=time.time()), None)  # fmt: skip
    from prometheus_client import REGISTRY

    def pauses() -> float:
        return REGISTRY.get_sample_value("aiworks_batch_job_pauses_total") or 0.0

    before = pauses()
    runner = BatchRunner(store, BatchSettings(redis_url="redis://unused", gateway_url="http://127.0.0.1:9"))
    try:
        assert not await runner.run_once()  # paused: nothing done, so the runner waits a poll
        paused = await store.get(job.id)
        assert paused.status == "validating" and not paused.error
        assert job.id in await store.active_ids()
        assert await store.claim(job.id, "another-runner", 30)  # its lease was released: any runner may resume it
        await store.release(job.id, "another-runner")
        until, wait = runner.paused[job.id]
        assert wait == 2.0 and until > time.monotonic()
        assert not await runner.run_once() and runner.paused[job.id] == (until, wait)  # not tried again yet
        runner.paused[job.id] = (0.0, wait)
        assert not await runner.run_once() and runner.paused[job.id][1] == 4.0  # still down: it waits longer
        assert pauses() - before == 2  # aiworks_batch_job_pauses_total, on the Tiers dashboard
        # The window ends while the store is still down: the job fails, saying why.
        await store.update(job.id, created_at=time.time() - 3601)
        runner.paused.clear()
        assert await runner.run_once()
        failed = await store.get(job.id)
        assert failed.status == "failed" and "cannot read the input file" in failed.error, failed.error
        assert "unreachable" in failed.error
    finally:
        await runner.close()


async def test_a_401_that_goes_away_on_a_new_connection_costs_no_line(store, tmp_path):
    """A rolling upgrade: one gateway replica (from before work tokens) refuses the token, the others accept it.
    The runner tries a 401 again on a new connection, so the line lands elsewhere; nothing fails, nothing stops."""
    from aiohttp import web

    from aiworks.batch.runner import BatchRunner
    from aiworks.batch.settings import BatchSettings

    from .conftest import serve_infer

    peers, refusals = [], [3]

    async def infer(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])
        if refusals[0]:
            refusals[0] -= 1
            return web.json_response({"error": "API key is not recognised"}, status=401)
        answer = {"model_name": "digits", "outputs": [{"name": "y", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
        return web.json_response(answer)

    runner_app, url = await serve_infer(infer)
    (tmp_path / "in.jsonl").write_bytes(b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}\n' * 3)
    job = await BatchService(store, None).submit("t", "digits", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                                                 str(tmp_path / "err.jsonl"), chunk_size=3)  # fmt: skip
    settings = BatchSettings(redis_url="redis://unused", gateway_url=url, concurrency=1, adaptive=False)
    runner = BatchRunner(store, settings)
    try:
        assert await runner.run_once()
    finally:
        await runner.close()
        await runner_app.cleanup()
    done = await store.get(job.id)
    assert (done.status, done.completed, done.failed) == ("completed", 3, 0), done
    # Each line's first try on the pooled connection (refused), its second on a new one of its own (answered).
    assert len(peers) == 6 and len(set(peers[3:])) == 3 and not set(peers[:3]) & set(peers[3:]), peers
    assert (tmp_path / "err.jsonl").read_bytes() == b""


async def test_ended_jobs_are_listed_for_the_gateways_until_their_tokens_expire(store, monkeypatch):
    """What the gateways read to refuse an ended job's work token: each ended job, when it ended and when its
    token (its completion window and a quarter hour from its creation) expires; pruned after that."""
    import time

    from aiworks.batch import jobs

    started = time.time()
    await store.create(_job("batch_x"))
    await store.create(Job(id="batch_y", tenant="t", model="m", input_url="in", output_url="out", error_url="err",
                           completion_window="1h"))  # fmt: skip
    assert await store.ended_since(0) == []
    await store.finish("batch_x", "cancelled")
    await store.finish("batch_y", "completed")
    ended = await store.ended_since(started - 1)
    assert [job_id for job_id, _, _ in ended] == ["batch_x", "batch_y"]
    (_, at_x, until_x), (_, at_y, until_y) = ended
    assert started <= at_x <= at_y <= time.time()
    assert until_x - until_y == pytest.approx(23 * 3600, abs=5)
    assert until_y >= started + 3600 + jobs.TOKEN_GRACE_S
    assert await store.ended_since(at_y + 1) == []
    # Past batch_y's token expiry, the next job that ends prunes it; batch_x's 24-h token still lives.
    monkeypatch.setattr(jobs.time, "time", lambda: until_y + 1)
    await store.create(_job("batch_z"))
    await store.finish("batch_z", "failed")
    assert [job_id for job_id, _, _ in await store.ended_since(0)] == ["batch_x", "batch_z"]
