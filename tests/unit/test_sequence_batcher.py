"""Stateful models on one runtime replica: the sequence batcher with real ONNX Runtime on the QA models."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, Status
from aiworks.core.inference import InferRequest
from aiworks.core.options import RequestOptions, SequenceRef
from aiworks.demo.qa_streaming import accumulator_config, accumulator_onnx, build_qa_streaming_models
from aiworks.runtime.batcher import QueueLimits
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    build_qa_streaming_models(root, ("simple_sequence", "simple_dyna_sequence", "accumulator"))
    tiny = root / "tiny" / "1"
    tiny.mkdir(parents=True)
    (tiny / "accumulator.onnx").write_bytes(accumulator_onnx())
    (root / "tiny" / "config.pbtxt").write_text(accumulator_config("tiny", candidates=1, idle_us=150_000))
    # One slot and a long idle timeout: for the tests of the slot and the backlog, where a loaded machine must not
    # release the first sequence as idle between two of its requests (150 ms went by under CI's load).
    one = root / "one_slot" / "1"
    one.mkdir(parents=True)
    (one / "accumulator.onnx").write_bytes(accumulator_onnx())
    (root / "one_slot" / "config.pbtxt").write_text(accumulator_config("one_slot", candidates=1, idle_us=60_000_000))
    return root


async def plane(repo: Path, *models: str, backlog: int = 64) -> RuntimeDataPlane:
    dp = RuntimeDataPlane(ModelRepository(repo), queue_limits=QueueLimits(max_sequence_backlog=backlog))
    for model in models:
        await dp.load(model)
    return dp


async def send(dp, model: str, value: int, sid, *, start=False, end=False, rows=1) -> int:
    request = InferRequest(model, "1", [Tensor.from_numpy("INPUT", np.full((rows, 1), value, dtype=np.int32))])
    answer = await dp.queues.infer(request, RequestOptions(sequence=SequenceRef(sid, start, end)))
    return int(np.frombuffer(answer.outputs[0].raw, dtype=np.int32)[0])


async def test_interleaved_sequences_each_keep_their_own_running_sum(repo):
    dp = await plane(repo, "accumulator")
    try:
        ids = [11, 2**64 - 1, "twin-a", "twin-b"]
        steps = [[3, 5, 7, 11], [100, -1, -2, -3], [1, 1, 1, 1], [0, 10, 0, 10]]

        async def run(sid, values):
            out = []
            for i, v in enumerate(values):
                out.append(await send(dp, "accumulator", v, sid, start=i == 0, end=i == len(values) - 1))
            return out

        results = await asyncio.gather(*(run(sid, values) for sid, values in zip(ids, steps)))
        assert results == [list(np.cumsum(v)) for v in steps]
        queue = dp.queues._queues[("accumulator", "1")]
        assert queue.batches < 16  # sequences shared batches
        assert queue.table.count == 0  # every sequence ended and freed its slot
        [row] = [q for q in dp.queues.stats() if q.model == "accumulator"]  # the heartbeat reports it as a queue
        assert row.batches == queue.batches and row.rows == 16 and row.queued_requests == 0
    finally:
        await dp.close()


async def test_a_start_on_a_live_sequence_restarts_it(repo):
    dp = await plane(repo, "accumulator")
    try:
        assert await send(dp, "accumulator", 5, 7, start=True) == 5
        assert await send(dp, "accumulator", 5, 7) == 10
        assert await send(dp, "accumulator", 1, 7, start=True) == 1
    finally:
        await dp.close()


async def test_direct_strategy_fills_start_and_ready_controls(repo):
    dp = await plane(repo, "simple_sequence")
    try:
        # Triton's simple_sequence: READY ? INPUT + START : 0 (its client examples expect 1, then the values).
        assert await send(dp, "simple_sequence", 0, 1000, start=True) == 1
        assert await send(dp, "simple_sequence", 100, 1001, start=True) == 101
        got = await asyncio.gather(send(dp, "simple_sequence", 7, 1000), send(dp, "simple_sequence", -7, 1001))
        assert got == [7, -7]
        table = dp.queues._queues[("simple_sequence", "1")].table
        assert sorted(s.slot for s in table.live.values()) == [0, 1]
    finally:
        await dp.close()


async def test_corrid_control_and_end_flag(repo):
    dp = await plane(repo, "simple_dyna_sequence")
    try:
        assert await send(dp, "simple_dyna_sequence", 0, 1000, start=True) == 1
        assert await send(dp, "simple_dyna_sequence", 5, 1000) == 5
        assert await send(dp, "simple_dyna_sequence", 1, 1000, end=True) == 1 + 1000  # CORRID added at the end
        with pytest.raises(AIWorksError) as refused:
            await send(dp, "simple_dyna_sequence", 1, "text-id", start=True)
        assert refused.value.status is Status.INVALID_ARGUMENT and "integer correlation ID" in refused.value.message
    finally:
        await dp.close()


async def test_requests_outside_a_live_sequence_are_refused_with_tritons_words(repo):
    dp = await plane(repo, "accumulator")
    try:
        with pytest.raises(AIWorksError) as unknown:
            await send(dp, "accumulator", 1, 99)
        assert unknown.value.status is Status.FAILED_PRECONDITION
        assert "must specify the START flag on the first request of the sequence" in unknown.value.message
        with pytest.raises(AIWorksError) as no_id:
            request = InferRequest("accumulator", "1", [Tensor.from_numpy("INPUT", np.ones((1, 1), np.int32))])
            await dp.queues.infer(request, RequestOptions())
        assert "must specify a non-zero or non-empty correlation ID" in no_id.value.message
        with pytest.raises(AIWorksError) as batch:
            await send(dp, "accumulator", 1, 5, start=True, rows=2)
        assert batch.value.status is Status.INVALID_ARGUMENT and "batch-size 1" in batch.value.message
        # An ended sequence's id is free: without a start it is unknown again.
        await send(dp, "accumulator", 1, 6, start=True, end=True)
        with pytest.raises(AIWorksError, match="START flag"):
            await send(dp, "accumulator", 1, 6)
    finally:
        await dp.close()


async def test_more_sequences_than_slots_and_backlog_is_429(repo):
    dp = await plane(repo, "one_slot", backlog=0)
    try:
        await send(dp, "one_slot", 1, "a", start=True)
        with pytest.raises(AIWorksError) as full:
            await send(dp, "one_slot", 1, "b", start=True)
        assert full.value.status is Status.RESOURCE_EXHAUSTED and "as many sequences as it allows" in full.value.message
        await send(dp, "one_slot", 1, "a", end=True)
        assert await send(dp, "one_slot", 4, "b", start=True) == 4  # the slot is free again
    finally:
        await dp.close()


async def test_a_backlogged_sequence_runs_once_a_slot_frees(repo):
    dp = await plane(repo, "one_slot", backlog=1)
    try:
        await send(dp, "one_slot", 1, "a", start=True)
        waiting = asyncio.create_task(send(dp, "one_slot", 9, "b", start=True))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # "b" waits in the backlog
        await send(dp, "one_slot", 1, "a", end=True)
        assert await asyncio.wait_for(waiting, 2) == 9
    finally:
        await dp.close()


async def test_an_idle_sequence_is_released(repo):
    dp = await plane(repo, "tiny", backlog=0)
    try:
        await send(dp, "tiny", 2, "idle", start=True)
        await asyncio.sleep(0.5)  # idle for longer than its 150 ms
        with pytest.raises(AIWorksError, match="START flag"):
            await send(dp, "tiny", 2, "idle")
        assert await send(dp, "tiny", 3, "fresh", start=True) == 3  # its slot went back
    finally:
        await dp.close()


async def test_a_cancelled_request_leaves_its_sequence_queue(repo):
    dp = await plane(repo, "one_slot", backlog=1)
    try:
        await send(dp, "one_slot", 1, "a", start=True)
        queued = asyncio.create_task(send(dp, "one_slot", 1, "b", start=True))  # in the backlog
        await asyncio.sleep(0.02)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert dp.queues._queues[("one_slot", "1")].queued == 0
    finally:
        await dp.close()
