"""The scheduler's control plane and one gateway's routing, wired by the routing table, over fake replicas.

Shared by the unit tests of routing (tests/unit) and of the lifecycle rules (tests/lifecycle).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, Status, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import BatchingConfig, ModelSpec, TensorSpec
from aiworks.core.options import read_options
from aiworks.core.sequence_config import SequenceConfig
from aiworks.runtime.client import Answer
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.dispatch import Dispatcher
from aiworks.scheduler.mirror import RoutingMirror
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.settings import SchedulerSettings


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeReplica:
    """A runtime replica's client: echoes its input after ``delay_s``; can fail the next N requests or hang."""

    def __init__(self, name: str, delay_s: float = 0.0):
        self.name = name
        self.delay_s = delay_s
        self.batches = 0
        self.fail_next = 0
        self.fail_with: Exception = Unavailable(f"{name} is unreachable")
        self.seen_timeouts: list[float | None] = []
        self.answers = 3  # per streamed request
        self.fail_after: int | None = None
        self.sequences: set = set()  # live sequences, as a runtime's sequence batcher holds them

    async def infer(self, request, options, work=None):
        self.seen_timeouts.append(options.remaining_s())
        if self.fail_next:
            self.fail_next -= 1
            raise self.fail_with
        sequence = options.sequence
        if sequence is not None:
            if not sequence.start and sequence.id not in self.sequences:
                raise AIWorksError(f"sequence {sequence.id} unknown on {self.name}", Status.FAILED_PRECONDITION)
            self.sequences.add(sequence.id)
            if sequence.end:
                self.sequences.discard(sequence.id)
        await asyncio.sleep(self.delay_s)
        self.batches += 1
        return Answer([Tensor.from_numpy("y", request.inputs[0].to_numpy())], int(self.delay_s * 1e9))

    async def infer_stream(self, request, options, work=None):
        """A decoupled model's answers: ``answers`` echoes, failing after ``fail_after`` of them if set."""
        self.seen_timeouts.append(options.remaining_s())
        if self.fail_next:
            self.fail_next -= 1
            raise self.fail_with
        for i in range(self.answers):
            if self.fail_after is not None and i == self.fail_after:
                raise self.fail_with
            await asyncio.sleep(self.delay_s)
            yield Answer([Tensor.from_numpy("y", request.inputs[0].to_numpy())], final=i == self.answers - 1)
        self.batches += 1

    async def close(self):
        pass


def spec(version="1", batching=False, decoupled=False, sequence=False) -> ModelSpec:
    return ModelSpec(
        "m",
        version,
        max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", "FP32", (2,)),),
        batching=BatchingConfig(batching, 0, ()),
        decoupled=decoupled,
        sequence=SequenceConfig("oldest") if sequence else None,
    )


@dataclass
class Suite:
    """The scheduler's control plane and one gateway's routing, wired by the routing table."""

    scheduler: Scheduler
    registry: ReplicaRegistry
    mirror: RoutingMirror
    dispatcher: Dispatcher

    def sync(self) -> None:
        """Hand the gateway the scheduler's table now (the WatchRouting stream does this in the suite)."""
        table = self.scheduler.routing_table()
        self.mirror.apply(table)
        self.dispatcher.apply(table)

    def replica(self, name: str):
        return self.mirror.replicas[name]

    async def infer(self, version="", *, model="m", rows=1, **parameters):
        options = read_options(parameters, default=self.dispatcher.default_priority)
        return await self.dispatcher.infer(request(version, model=model, rows=rows), options)

    def status(self):
        """The scheduler's global view once this gateway reported."""
        self.scheduler.report(self.dispatcher.report("gateway-0"))
        return self.scheduler.status()


def make(replicas: dict, specs=None, *, devices=None, labels=None, clock=None, **settings):
    """A scheduler whose registry holds ``replicas`` (id = address), and a gateway's routing over them.

    Each fake serves both sides: inference for the gateway (``infer``) and, if
    it has them, ``load``/``unload`` for the scheduler.
    """
    kwargs = {"clock": clock} if clock else {}
    registry = ReplicaRegistry(lambda address: replicas[address], **kwargs)
    for rid in replicas:
        registry.register(rid, rid, (devices or {}).get(rid, "cpu"), (labels or {}).get(rid, {}), specs or [spec()])
    scheduler = Scheduler(SchedulerSettings(**settings), registry, **kwargs)
    mirror = RoutingMirror(lambda address: replicas[address])
    suite = Suite(scheduler, registry, mirror, Dispatcher(mirror, **kwargs))
    suite.sync()
    return suite


def request(version="", *, model="m", rows=1) -> InferRequest:
    x = np.ones((rows, 2), dtype=np.float32)
    return InferRequest(model, version, [Tensor.from_numpy("x", x)])


async def load(suite: Suite, clients: int, per_client: int, **parameters):
    async def client():
        for _ in range(per_client):
            await suite.infer(**parameters)

    await asyncio.gather(*(client() for _ in range(clients)))


