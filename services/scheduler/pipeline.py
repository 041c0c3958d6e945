"""Pipeline models: a request runs through stage models, each batched and routed as a model of its own.

A pipeline is a model folder whose ``config.pbtxt`` has ``platform:
"ensemble"`` (Triton's name; ``"pipeline"`` is accepted too) and Triton's
``ensemble_scheduling`` block: a list of steps, each naming a model (and a
version, -1 for the latest) with an ``input_map`` (the step model's input ->
a pipeline tensor) and an ``output_map`` (the step model's output -> a
pipeline tensor). The pipeline's own ``input`` and ``output`` declare what
clients send and get. ``aiworks split --pipeline NAME`` writes one for the
stages it cuts.

The runtime does not load a pipeline: it reports the folder's config as a
spec with the steps in the ``ensemble_scheduling`` parameter (JSON). The
gateway's dispatcher runs it with this module:

- each step is a request to the stage model, routed like any other to a
  replica holding the stage (stage 1 on one replica, stage 2 possibly on
  another) and queued there with the stage requests of concurrent pipeline
  requests, so they batch together; a step starts as soon as the tensors it
  reads exist, so independent steps run at once;
- a request with more rows than the pipeline's ``micro_batch_rows``
  parameter is cut into micro-batches that flow through the stages one after
  another, with several in flight at once: micro-batch *k* + 1 enters a stage
  as soon as micro-batch *k* has left it, so stage 1 of *k* + 1 overlaps
  stage 2 of *k* (GPipe's schedule); the outputs are joined back in order;
- the request's options (priority, deadline, tenant) apply to every step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiworks.core.datatypes import Tensor, split_rows
from aiworks.core.errors import InvalidArgument
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import ModelSpec
from aiworks.core.options import RequestOptions

PIPELINE_PLATFORMS = ("ensemble", "pipeline")
STEPS_PARAMETER = "ensemble_scheduling"
MICRO_BATCH_PARAMETER = "micro_batch_rows"

# (model, version, inputs, outputs, options) -> the step model's outputs
StageRunner = Callable[[str, str, list[Tensor], list[str], RequestOptions], Awaitable[list[Tensor]]]


def is_pipeline(spec: ModelSpec) -> bool:
    return spec.platform in PIPELINE_PLATFORMS


@dataclass(frozen=True, slots=True)
class Step:
    """One step: which model, and how its tensors map to the pipeline's."""

    model: str
    version: str  # "" for the latest ready version
    input_map: dict[str, str]  # step model input -> pipeline tensor
    output_map: dict[str, str]  # step model output -> pipeline tensor


def parse_steps(spec: ModelSpec) -> tuple[Step, ...]:
    """The steps of a pipeline spec, checked so that every tensor a step reads is produced before it."""
    where = f"pipeline '{spec.name}'"
    text = spec.parameters.get(STEPS_PARAMETER)
    if not text:
        raise InvalidArgument(f"{where} has no ensemble_scheduling steps")
    try:
        raw_steps = json.loads(text).get("step", [])
    except (ValueError, AttributeError):
        raise InvalidArgument(f"{where}: its ensemble_scheduling is not valid JSON") from None
    if not raw_steps:
        raise InvalidArgument(f"{where} has no ensemble_scheduling steps")
    steps = []
    for i, s in enumerate(raw_steps, 1):
        model = s.get("model_name", "")
        if not model:
            raise InvalidArgument(f"{where}: step {i} names no model_name")
        if model == spec.name:
            raise InvalidArgument(f"{where}: step {i} names the pipeline itself")
        version = int(s.get("model_version", -1))
        if not s.get("input_map") or not s.get("output_map"):
            raise InvalidArgument(f"{where}: step {i} ({model}) needs an input_map and an output_map")
        steps.append(Step(model, "" if version < 0 else str(version), dict(s["input_map"]), dict(s["output_map"])))
    available = {t.name for t in spec.inputs}
    pending = list(steps)
    while pending:
        ready = [s for s in pending if set(s.input_map.values()) <= available]
        if not ready:
            missing = sorted({t for s in pending for t in s.input_map.values()} - available)
            raise InvalidArgument(f"{where}: no step produces {missing}, which a step reads")
        for s in ready:
            pending.remove(s)
            available |= set(s.output_map.values())
    unproduced = sorted({t.name for t in spec.outputs} - available)
    if unproduced:
        raise InvalidArgument(f"{where}: output(s) {unproduced} are produced by no step")
    return tuple(steps)


def micro_batch_rows(spec: ModelSpec, default: int) -> int:
    text = spec.parameters.get(MICRO_BATCH_PARAMETER, "")
    try:
        rows = int(text) if text else default
    except ValueError:
        raise InvalidArgument(f"pipeline '{spec.name}': {MICRO_BATCH_PARAMETER} '{text}' is not an integer") from None
    return max(0, rows) if spec.max_batch_size > 0 else 0


class PipelineRunner:
    """Runs pipeline requests through their steps (see the module docstring)."""

    def __init__(self, *, micro_batch_rows: int = 0):
        self.default_micro_batch_rows = micro_batch_rows
        self._steps: dict[tuple[str, str, str], tuple[Step, ...]] = {}
        self.requests = 0
        self.micro_batches = 0

    def steps(self, spec: ModelSpec) -> tuple[Step, ...]:
        key = (spec.name, spec.version, spec.parameters.get(STEPS_PARAMETER, ""))
        steps = self._steps.get(key)
        if steps is None:
            steps = self._steps[key] = parse_steps(spec)
        return steps

    async def run(
        self, spec: ModelSpec, request: InferRequest, rows: int, options: RequestOptions, run_stage: StageRunner
    ) -> list[Tensor]:
        """Run ``request`` (``rows`` rows) through the pipeline's steps, each step through ``run_stage``."""
        steps = self.steps(spec)
        wanted = list(request.outputs) or [o.name for o in spec.outputs]
        size = micro_batch_rows(spec, self.default_micro_batch_rows)
        self.requests += 1
        if not size or rows <= size:
            self.micro_batches += 1
            pool = await self._chain(steps, request.inputs, options, run_stage)
            return [_renamed(pool[name], name) for name in wanted]
        counts = [size] * (rows // size) + ([rows % size] if rows % size else [])
        pieces = [split_rows(t.raw, t.datatype, t.shape, counts) for t in request.inputs]
        chunks = [
            [Tensor(t.name, t.datatype, (n, *t.shape[1:]), p[k]) for t, p in zip(request.inputs, pieces)]
            for k, n in enumerate(counts)
        ]
        self.micro_batches += len(chunks)
        # gates[k][i] is set once micro-batch k has left step i: micro-batch k + 1 may enter it.
        gates = [[asyncio.Event() for _ in steps] for _ in chunks]
        tasks = [
            asyncio.ensure_future(self._chain(steps, chunk, options, run_stage, gates, k))
            for k, chunk in enumerate(chunks)
        ]
        try:
            pools = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        out = []
        for name in wanted:
            parts = [pool[name] for pool in pools]
            first = parts[0]
            shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
            out.append(Tensor(name, first.datatype, shape, b"".join(p.raw for p in parts)))
        return out

    async def _chain(
        self,
        steps: tuple[Step, ...],
        inputs: list[Tensor],
        options: RequestOptions,
        run_stage: StageRunner,
        gates: list[list[asyncio.Event]] | None = None,
        k: int = 0,
    ) -> dict[str, Tensor]:
        """Run every step on one micro-batch; returns the pipeline tensors by name."""
        pool = {t.name: t for t in inputs}
        pending = list(range(len(steps)))
        try:
            while pending:
                ready = [i for i in pending if all(v in pool for v in steps[i].input_map.values())]
                for i in ready:
                    pending.remove(i)
                results = await asyncio.gather(
                    *(self._step(steps[i], i, pool, options, run_stage, gates, k) for i in ready)
                )
                for produced in results:
                    pool.update(produced)
        finally:
            if gates is not None:  # never hold the next micro-batch back, also on failure
                for gate in gates[k]:
                    gate.set()
        return pool

    async def _step(self, step: Step, i: int, pool, options, run_stage, gates, k) -> dict[str, Tensor]:
        if gates is not None and k > 0:
            await gates[k - 1][i].wait()
        try:
            inputs = [_renamed(pool[source], name) for name, source in step.input_map.items()]
            outputs = await run_stage(step.model, step.version, inputs, list(step.output_map), options)
        finally:
            if gates is not None:
                gates[k][i].set()
        produced = {}
        by_name = {t.name: t for t in outputs}
        for name, target in step.output_map.items():
            produced[target] = _renamed(by_name[name], target)
        return produced


def _renamed(t: Tensor, name: str) -> Tensor:
    return t if t.name == name else Tensor(name, t.datatype, t.shape, t.raw)
