"""A decoupled model's requests through the gateway's routing (Dispatcher.infer_stream) over fake replicas."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from routing_support import FakeReplica, make, request, spec

from aiworks.core.errors import AIWorksError, InvalidArgument, Status, Unavailable
from aiworks.core.options import RequestOptions


async def streamed(suite, options=None):
    got = []
    stream = suite.dispatcher.infer_stream(request(), options or RequestOptions())
    async with contextlib.aclosing(stream) as answers:
        async for answer in answers:
            got.append(answer)
    return got


def test_answers_come_through_and_the_replica_is_free_after():
    async def main():
        a = FakeReplica("a")
        suite = make({"a": a}, [spec(decoupled=True)])
        answers = await streamed(suite)
        assert [x.final for x in answers] == [False, False, True]
        assert suite.replica("a").outstanding == 0

    asyncio.run(main())


def test_unavailable_before_the_first_answer_is_tried_on_another_replica():
    async def main():
        a, b = FakeReplica("a"), FakeReplica("b")
        a.fail_next = 1  # unreachable for the first request
        suite = make({"a": a, "b": b}, [spec(decoupled=True)])
        suite.replica("b").health.latency_s[("m", "1")] = 1.0  # the router tries "a" first
        answers = await streamed(suite)
        assert len(answers) == 3 and (a.batches, b.batches) == (0, 1)
        assert suite.dispatcher.retries == {("m", "1"): 1}
        assert suite.replica("a").outstanding == suite.replica("b").outstanding == 0

    asyncio.run(main())


def test_a_failure_after_an_answer_is_not_retried():
    async def main():
        a, b = FakeReplica("a"), FakeReplica("b")
        a.fail_after = b.fail_after = 1
        suite = make({"a": a, "b": b}, [spec(decoupled=True)])
        got = []
        with pytest.raises(Unavailable):
            async for answer in suite.dispatcher.infer_stream(request(), RequestOptions()):
                got.append(answer)
        assert len(got) == 1 and suite.dispatcher.retries == {}

    asyncio.run(main())


def test_a_model_error_is_final():
    async def main():
        a, b = FakeReplica("a"), FakeReplica("b")
        a.fail_next = b.fail_next = 1
        a.fail_with = b.fail_with = InvalidArgument("bad input")
        suite = make({"a": a, "b": b}, [spec(decoupled=True)])
        with pytest.raises(AIWorksError) as failed:
            await streamed(suite)
        assert failed.value.status is Status.INVALID_ARGUMENT and suite.dispatcher.retries == {}

    asyncio.run(main())


def test_a_decoupled_model_is_refused_on_the_one_answer_api():
    async def main():
        suite = make({"a": FakeReplica("a")}, [spec(decoupled=True)])
        with pytest.raises(AIWorksError) as refused:
            await suite.infer()
        assert refused.value.status is Status.UNIMPLEMENTED and "decoupled transaction policy" in refused.value.message

    asyncio.run(main())


def test_a_model_that_is_not_decoupled_answers_once_on_the_stream_api():
    async def main():
        a = FakeReplica("a")
        suite = make({"a": a}, [spec()])
        answers = await streamed(suite)
        assert len(answers) == 1 and answers[0].final and a.batches == 1

    asyncio.run(main())


def test_leaving_early_frees_the_replica():
    async def main():
        a = FakeReplica("a", delay_s=0.01)
        a.answers = 50
        suite = make({"a": a}, [spec(decoupled=True)])
        async with contextlib.aclosing(suite.dispatcher.infer_stream(request(), RequestOptions())) as answers:
            async for _ in answers:
                break
        assert suite.replica("a").outstanding == 0

    asyncio.run(main())
