"""The runtime's logic, free of transport: load models and execute batches.

Retiring a version never fails a batch of it (docs/scheduler.md, "Hot
update"): a version a reload no longer selects stops being reported, but
stays executable by its explicit version until no batch of it is running and
none arrived for ``retire_quiet_s`` (the scheduler drains its queue meanwhile;
at most ``drain_timeout_s``); an unload stops new executions at once and waits
for those in progress (at most ``drain_timeout_s``) before freeing the model.

Pipeline models (``platform: "ensemble"``, aiworks.scheduler.pipeline) are not
loaded here: their config is reported as a spec, with the steps in the
``ensemble_scheduling`` parameter, for the scheduler to run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from aiworks.core import metrics
from aiworks.core.datatypes import Tensor, decode, encode
from aiworks.core.errors import (
    AIWorksError,
    Internal,
    InvalidArgument,
    NotFound,
    Unavailable,
    no_available_version,
    unknown_version,
)
from aiworks.core.inference import InferRequest, ModelStatistics
from aiworks.core.load_overrides import LoadOverrides
from aiworks.core.model_config import ModelConfig, ModelSpec, ModelState, reshaped
from aiworks.core.names import check_model_name
from aiworks.core.options import RequestOptions
from aiworks.runtime.backends import BACKENDS
from aiworks.runtime.batcher import QueueLimits
from aiworks.runtime.classification import read_labels
from aiworks.runtime.queues import RequestQueues
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.residency import (
    ResidencyLRU,
    RuntimeModelStatistics,
    configured_warmup,
    estimate_bytes,
    response_cache_enabled,
    warmup_batches,
)

log = logging.getLogger(__name__)

NO_OVERRIDES = LoadOverrides()

# Run by the scheduler step by step (aiworks.scheduler.pipeline), never loaded here.
PIPELINE_PLATFORMS = ("ensemble", "pipeline")
PIPELINE_STEPS_PARAMETER = "ensemble_scheduling"


@dataclass
class LoadedVersion:
    spec: ModelSpec
    model: object  # None while evicted: the next request loads it again
    slots: asyncio.Semaphore
    stats: ModelStatistics
    # Moving average of one batch's compute time; None until measured, so a
    # new model runs in the worker pool until it is known to be cheap.
    recent_compute_ns: int | None = None
    # What reloading after an eviction needs, and the cold-start clock.
    config: ModelConfig | None = None
    path: Path | None = None
    size_bytes: int = 0
    load_requested_ns: int = 0
    first_request_pending: bool = True
    # Label children of this version's execution metrics, made on its first batch.
    observe: tuple | None = None
    # Executions that hold this version now (waiting for a slot or running), for unload and retirement.
    running: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    last_used_s: float = 0.0
    pipeline: bool = False
    # Inputs (dims -> reshape) and outputs (reshape -> dims) the config reshapes: made on first use.
    plans: tuple[dict, dict] | None = None
    # Class labels of the outputs with a label_filename, by output name (the classification extension).
    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self):
        self.idle.set()

    def enter(self) -> None:
        self.running += 1
        self.idle.clear()
        self.last_used_s = time.monotonic()

    def leave(self) -> None:
        self.running -= 1
        self.last_used_s = time.monotonic()
        if not self.running:
            self.idle.set()


class RuntimeDataPlane:
    """Holds the loaded model versions of one replica and runs batches on them.

    Backends run in a thread pool so the event loop keeps serving while ONNX
    Runtime (which releases the GIL) computes; ``instance_group.count`` bounds
    how many batches of one version run at once. A model whose batches take
    less than ``inline_below_us`` runs on the event loop instead: handing
    such a batch to a thread and back costs more than running it.

    Loaded versions stay resident within ``memory_budget_bytes`` (0: no
    bound), least recently used evicted first, and warm up before they are
    reported ready; see :mod:`aiworks.runtime.residency`.
    """

    def __init__(
        self,
        repository: ModelRepository,
        *,
        intra_op_threads: int = 1,
        max_workers: int = 8,
        inline_below_us: int = 100,
        memory_budget_bytes: int = 0,
        warmup: bool = True,
        debug_delay_ms: float = 0.0,
        replica_id: str = "",
        drain_timeout_s: float = 30.0,
        retire_quiet_s: float = 2.0,
        batching: bool = True,
        queue_limits: QueueLimits = QueueLimits(),
        max_load_file_bytes: int = 64 << 20,
        batch_lane_nice: int = 0,
    ):
        self.replica_id = replica_id
        self.max_load_file_bytes = max_load_file_bytes
        self.inline_below_ns = inline_below_us * 1000
        self.residency = ResidencyLRU(memory_budget_bytes)
        self.warmup = warmup
        self.repository = repository
        self.intra_op_threads = intra_op_threads
        self._models: dict[str, dict[str, LoadedVersion]] = {}
        self._failed: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Versions a reload retired, still executable by explicit version until idle (see the module docstring).
        self._retiring: dict[tuple[str, str], LoadedVersion] = {}
        self._retire_tasks: set[asyncio.Task] = set()
        # Objects a reload replaced (same version, new session) while batches still ran on them.
        self._superseded: dict[str, list[LoadedVersion]] = {}
        self.drain_timeout_s = drain_timeout_s
        self.retire_quiet_s = retire_quiet_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="backend")
        # The batch lane (aiworks.runtime.batcher): batch-class batches in threads at niceness batch_lane_nice.
        self._lane_pool = (
            ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="batch-lane",
                               initializer=_lower_thread_priority, initargs=(batch_lane_nice,))
            if batch_lane_nice > 0 else None
        )  # fmt: skip
        self.inflight_batches = 0
        self._inflight_gauge = metrics.RUNTIME_INFLIGHT.labels(replica_id)
        self._executions = metrics.Children(metrics.RUNTIME_EXECUTIONS)
        # TESTS ONLY (RuntimeSettings.debug_delay_ms): a replica made slow on purpose.
        self._debug_delay_s = debug_delay_ms / 1e3
        # Requests on their way to the models: queues, priorities, deadlines, dynamic batching.
        self.queues = RequestQueues(self, batching=batching, limits=queue_limits, drain_timeout_s=drain_timeout_s)
        # Awaited before a batch's error leaves when its backend just went unhealthy (a dead tritonserver):
        # the registrar tells the scheduler first, so gateways hold the model's requests, not fail them.
        self.on_backend_down = None

    # ---- lifecycle ---------------------------------------------------------------------------

    async def load(
        self, name: str, *, preloaded: bool = False, overrides: LoadOverrides = NO_OVERRIDES
    ) -> list[ModelSpec]:
        """(Re)load a model's versions per its version policy, warm them up; returns their specs.

        ``overrides`` (Triton's ``config`` and ``file:`` load parameters) are
        applied by the repository first: files written into the model's
        folder, the config used for this load instead of the folder's.
        """
        requested_ns = time.perf_counter_ns()
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            config_override = None
            if overrides:
                apply = functools.partial(self.repository.apply_overrides, name, overrides, self.max_load_file_bytes)
                try:  # file writes: off the event loop
                    config_override = await asyncio.get_running_loop().run_in_executor(self._pool, apply)
                except AIWorksError as exc:
                    exc.message = self.repository.relative(exc.message)
                    raise
                except OSError as exc:  # its text holds the server's path: only its kind leaves
                    log.warning("writing model %s's files failed: %s", name, exc)
                    raise InvalidArgument(f"model '{name}': its files could not be written ({exc.strerror})") from None
            entry = self.repository.entry(name, config_override)
            if entry.config is None:
                self._failed[name] = self.repository.relative(entry.error)
                raise InvalidArgument(f"cannot load model '{name}': {self._failed[name]}")
            config = entry.config
            if config.platform in PIPELINE_PLATFORMS:
                return self._load_pipeline(entry.versions, config, preloaded)
            backend = BACKENDS.get(config.backend)
            if backend is None:
                raise InvalidArgument(f"model '{name}': backend '{config.backend}' is not available on this replica")
            # The sequence batcher runs batches through run(); a remote tritonserver would keep sequences itself.
            if config.sequence is not None and (config.backend == "triton" or getattr(backend, "decoupled", False)):
                raise InvalidArgument(f"model '{name}': sequence_batching is not supported by backend '{config.backend}'")
            wanted = config.version_policy.select(list(entry.versions))
            if not wanted:
                raise NotFound(f"model '{name}' has no version folder that its version policy selects")
            loop = asyncio.get_running_loop()
            folder = self.repository.folder(name)
            try:  # the outputs' label files, for classification: off the event loop
                labels = await loop.run_in_executor(
                    self._pool, read_labels, folder, self.repository.root, name, config.outputs
                )
            except AIWorksError as exc:
                self._failed[name] = exc.message
                raise
            loaded: dict[str, LoadedVersion] = {}
            for version in wanted:
                path = self.repository.model_file(config, version)
                size = estimate_bytes(path.parent)
                # Room for this version and the ones this call loaded already (they join the LRU at the end).
                self._make_room((name, str(version)), size + sum(v.size_bytes for v in loaded.values()))
                started = time.perf_counter_ns()
                try:
                    model = await loop.run_in_executor(self._pool, backend, path, config, self.intra_op_threads)
                except AIWorksError as exc:
                    exc.message = self.repository.relative(exc.message)
                    raise
                except Exception as exc:  # the backend's words may hold paths: they leave this process relative
                    self._failed[name] = f"version {version}: {self.repository.relative(str(exc))}"
                    raise InvalidArgument(f"cannot load model '{name}' {self._failed[name]}") from None
                load_ns = time.perf_counter_ns() - started
                size = getattr(model, "device_bytes", 0) or size  # accelerator memory, when the backend knows it
                completed = self._complete(config, model)
                spec = completed.spec(str(version))
                if response_cache_enabled(config):  # the ModelSpec message has no field for it: a parameter
                    spec = replace(spec, parameters={**spec.parameters, "response_cache": "true"})
                stats = RuntimeModelStatistics(name, str(version), preloaded=preloaded, load_ns=load_ns, load_count=1)
                version_loaded = LoadedVersion(
                    spec,
                    model,
                    asyncio.Semaphore(spec.instance_count),
                    stats,
                    config=config,
                    path=path,
                    size_bytes=size,
                    load_requested_ns=requested_ns,
                    labels=labels,
                )
                await self._warm_up_or_fail(version_loaded, completed, str(version), requested_ns)
                stats.resident, stats.resident_bytes = True, size
                loaded[str(version)] = version_loaded
                log.info(
                    "loaded %s version %s in %.0f ms (warm-up %.0f ms, %.1f MiB)",
                    name,
                    version,
                    load_ns / 1e6,
                    stats.warmup_ns / 1e6,
                    size / 2**20,
                )
            self._install(name, loaded)
            return [v.spec for v in loaded.values()]

    def _install(self, name: str, loaded: dict[str, LoadedVersion]) -> None:
        """Serve ``loaded`` as the model's versions; versions it no longer has retire."""
        previous = self._models.get(name, {})
        self._models[name] = loaded
        self._failed.pop(name, None)
        for v in previous:
            self.residency.remove((name, v))
        superseded = [lv for lv in self._superseded.get(name, []) if lv.running]
        superseded += [lv for v, lv in previous.items() if v in loaded and lv.running]
        self._superseded[name] = superseded
        for v, version_loaded in loaded.items():
            if not version_loaded.pipeline:
                self.residency.add((name, v), version_loaded.size_bytes)
            self._retiring.pop((name, v), None)  # loaded again: served as usual
        for gone in sorted(set(previous) - set(loaded)):
            self._retire(name, gone, previous[gone])

    def _load_pipeline(self, on_disk: tuple[int, ...], config: ModelConfig, preloaded: bool) -> list[ModelSpec]:
        """A pipeline's spec for the scheduler; no session: the scheduler runs its steps on their own models."""
        name = config.name
        steps = config.document.get(PIPELINE_STEPS_PARAMETER, {}).get("step")
        if not steps:
            raise InvalidArgument(f"pipeline '{name}' has no ensemble_scheduling steps")
        if not config.inputs or not config.outputs:
            raise InvalidArgument(f"pipeline '{name}' must declare its input and output tensors")
        wanted = config.version_policy.select(list(on_disk)) if on_disk else [1]
        if not wanted:
            raise NotFound(f"model '{name}' has no version folder that its version policy selects")
        parameters = {PIPELINE_STEPS_PARAMETER: json.dumps(config.document[PIPELINE_STEPS_PARAMETER])}
        loaded = {}
        for version in wanted:
            spec = config.spec(str(version))
            spec = replace(spec, parameters={**spec.parameters, **parameters})
            stats = RuntimeModelStatistics(name, str(version), preloaded=preloaded, load_count=1)
            loaded[str(version)] = LoadedVersion(spec, None, asyncio.Semaphore(1), stats, config=config, pipeline=True)
        self._install(name, loaded)
        log.info("pipeline %s version(s) %s: %d step(s), run by the scheduler", name, list(loaded), len(steps))
        return [v.spec for v in loaded.values()]

    def _retire(self, name: str, version: str, loaded: LoadedVersion) -> None:
        """Keep a version the reload dropped executable until no batch of it comes any more."""
        if loaded.pipeline:
            log.info("retired pipeline %s version %s", name, version)
            return
        key = (name, version)
        self._retiring[key] = loaded
        loaded.last_used_s = time.monotonic()
        log.info("retiring %s version %s: it serves its remaining batches first", name, version)
        task = asyncio.get_running_loop().create_task(self._free_when_idle(key, loaded))
        self._retire_tasks.add(task)
        task.add_done_callback(self._retire_tasks.discard)

    async def _free_when_idle(self, key: tuple[str, str], loaded: LoadedVersion) -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(min(0.25, self.retire_quiet_s))
            now = time.monotonic()
            if loaded.running == 0 and now - loaded.last_used_s >= self.retire_quiet_s:
                break
            if now - started >= self.drain_timeout_s:
                log.warning("retired %s version %s freed with work left after %.0f s", *key, self.drain_timeout_s)
                break
        if self._retiring.get(key) is loaded:
            del self._retiring[key]
        self._drop(loaded)
        log.info("retired %s version %s (%.1f s after it was retired)", *key, time.monotonic() - started)

    async def _wait_idle(self, versions: list[LoadedVersion], what: str) -> None:
        busy = [v for v in versions if v.running]
        if not busy:
            return
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.drain_timeout_s):
                for v in busy:
                    await v.idle.wait()
        except TimeoutError:
            log.warning("%s: executions still running after %.0f s; freeing anyway", what, self.drain_timeout_s)
            return
        log.info("%s: waited %.0f ms for executions in progress", what, (time.monotonic() - started) * 1e3)

    async def unload(self, name: str) -> None:
        """Answer ``name``'s queued requests, stop new executions, free it once those in progress finished."""
        check_model_name(name)
        await self.queues.drain(name)
        async with self._locks.setdefault(name, asyncio.Lock()):
            versions = self._models.pop(name, None)
            retiring = [k for k in self._retiring if k[0] == name]
            if versions is None and not retiring:
                raise NotFound(f"model '{name}' is not loaded")
            held = list((versions or {}).values()) + [self._retiring.pop(k) for k in retiring]
            held += self._superseded.pop(name, [])
            for v in versions or {}:
                self.residency.remove((name, v))
            await self._wait_idle(held, f"unload of {name}")
            for v in held:
                self._drop(v)
            log.info("unloaded %s", name)

    def _drop(self, loaded: LoadedVersion) -> None:
        """Forget a version's model; close it (in the pool: it may block) once no batch of it runs."""
        model, loaded.model = loaded.model, None  # executions still running keep their own reference
        loaded.stats.resident = False
        close = getattr(model, "close", None)
        if close is not None and not loaded.running:
            future = asyncio.get_running_loop().run_in_executor(self._pool, close)
            future.add_done_callback(_log_close_failure)

    # ---- residency ---------------------------------------------------------------------------

    def _make_room(self, key: tuple[str, str], size: int) -> None:
        """Evict least recently used versions so ``size`` more bytes fit the memory budget."""
        for victim in self.residency.victims(size, keep=key):
            self.residency.remove(victim)
            held = self._models.get(victim[0], {}).get(victim[1])
            if held is None or held.model is None:
                continue
            held.model = None  # batches still running keep their own reference
            held.stats.resident = False
            held.stats.eviction_count += 1
            log.info(
                "evicted %s version %s (%.1f MiB) to stay within the memory budget of %.1f MiB",
                victim[0],
                victim[1],
                held.size_bytes / 2**20,
                self.residency.budget_bytes / 2**20,
            )

    async def _reside(self, name: str, version: str, requested_ns: int) -> tuple[LoadedVersion, object]:
        """Load an evicted version again for the request that needs it (a cold start)."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            loaded = self._version(name, version)  # a reload may have replaced it meanwhile
            if loaded.model is not None:
                return loaded, loaded.model
            key = (name, loaded.spec.version)
            self._make_room(key, loaded.size_bytes)
            started = time.perf_counter_ns()
            try:
                model = await asyncio.get_running_loop().run_in_executor(
                    self._pool, BACKENDS[loaded.config.backend], loaded.path, loaded.config, self.intra_op_threads
                )
            except Exception as exc:
                why = self.repository.relative(str(exc))
                raise Internal(f"model '{name}' version {loaded.spec.version} could not be loaded again: {why}") from None
            stats = loaded.stats
            stats.load_ns, stats.warmup_ns, stats.cold_start_ns = time.perf_counter_ns() - started, 0, 0
            stats.load_count += 1
            stats.resident, stats.resident_bytes = True, loaded.size_bytes
            loaded.model, loaded.load_requested_ns, loaded.first_request_pending = model, requested_ns, True
            self.residency.add(key, loaded.size_bytes)
            log.info("loaded %s version %s again on demand in %.0f ms", name, key[1], stats.load_ns / 1e6)
            return loaded, model

    async def _warm_up_or_fail(self, loaded: LoadedVersion, config: ModelConfig, version: str, requested_ns: int):
        """Warm a new version up before it is ready.

        The config's ``model_warmup`` runs as in Triton, whatever the ``warmup`` setting says, and its failure
        fails the load. Without it, the suite's own default (one row of zeros, when the setting is on; not for
        a decoupled or stateful model) is only a courtesy: its failure is logged and the version still loads.
        """
        name, stats = config.name, loaded.stats
        configured = configured_warmup(config)
        if not configured and (not self.warmup or config.decoupled or config.sequence):
            return
        try:
            stats.warmup_ns = await self._warm_up(loaded, config)
        except Exception as exc:
            why = self.repository.relative(str(exc))
            if not configured:
                log.warning("model %s version %s: default warm-up failed, loading it anyway: %s", name, version, why)
                return
            self._failed[name] = f"version {version}: {why}"
            raise InvalidArgument(f"failed to load '{name}' version {version}: {why}") from None
        stats.cold_start_ns = time.perf_counter_ns() - requested_ns  # the warm-up answered first

    async def _warm_up(self, loaded: LoadedVersion, config: ModelConfig) -> int:
        """Run the version's warm-up batches (not counted in its statistics); returns their time in ns."""
        batches = warmup_batches(config, self.repository.root / config.name)
        names = [o.name for o in loaded.spec.outputs]
        loop = asyncio.get_running_loop()
        plans = reshape_plans(loaded.spec, loaded.model)[0]
        started = time.perf_counter_ns()
        for sample, inputs in batches:
            try:
                if config.decoupled:
                    raise InvalidArgument("a decoupled model cannot run a warm-up batch")
                feeds = _feeds(inputs, plans, config.max_batch_size > 0)
                await loop.run_in_executor(self._pool, _timed_run, loaded.model, feeds, names)
            except Exception as exc:
                raise InvalidArgument(f"failed to run warmup sample '{sample}': {exc}") from None
        return time.perf_counter_ns() - started

    def _complete(self, config: ModelConfig, model) -> ModelConfig:
        """Fill what the config omits from the model itself: inputs/outputs (Triton's auto-complete), and
        the batch sizes it runs best (CUDA graphs) as the batcher's preferred sizes; no scheduler window
        for a backend that holds the window itself (Triton)."""
        sizes = getattr(model, "batch_sizes", ())
        if sizes and config.batching.enabled and not config.batching.preferred_batch_sizes:
            config = replace(config, batching=replace(config.batching, preferred_batch_sizes=tuple(sizes)))
        if getattr(model, "batch_window_in_backend", False) and config.batching.max_queue_delay_us:
            config = replace(config, batching=replace(config.batching, max_queue_delay_us=0))  # Triton waits
        if config.inputs and config.outputs:
            return config
        inputs, outputs = model.io_specs(config.max_batch_size > 0)
        if config.sequence is not None:  # controls and state are the sequence batcher's, not the client's
            hidden = config.sequence.hidden_inputs | {s.output_name for s in config.sequence.states}
            inputs = tuple(t for t in inputs if t.name not in hidden)
            outputs = tuple(t for t in outputs if t.name not in hidden)
        return replace(config, inputs=config.inputs or inputs, outputs=config.outputs or outputs)

    # ---- queries -----------------------------------------------------------------------------

    def ready_specs(self) -> list[ModelSpec]:
        return [s for s in self.advertised_specs() if s.ready]

    def advertised_specs(self) -> list[ModelSpec]:
        """What the registrar tells the scheduler: ready versions, and LOADING ones whose backend is recovering.

        A version whose backend is unhealthy and not recovering is left out. Backends answer without I/O.
        """
        out = []
        for versions in self._models.values():
            for v in versions.values():
                healthy = getattr(v.model, "healthy", None)
                if healthy is None or healthy():
                    out.append(v.spec)
                elif getattr(v.model, "recovering", lambda: False)():
                    out.append(v.spec.with_state(ModelState.LOADING, "its backend is recovering"))
        return out

    def kv_room(self) -> list[tuple[str, str, int, int, int, tuple[int, int, int]]]:
        """(model, version, free KV tokens, KV budget, waiting sequences, those by class: realtime, standard,
        batch) of each loaded generative version; no I/O."""
        out = []
        for versions in self._models.values():
            for v in versions.values():
                room = getattr(v.model, "kv_room", None)
                if room is not None:
                    out.append((v.spec.name, v.spec.version, *room()))
        return out

    def unhealthy_versions(self) -> list[tuple[str, str, bool]]:
        """(model, version, recovering) of each loaded version whose backend is unhealthy; no I/O."""
        return [
            (v.spec.name, v.spec.version, bool(getattr(v.model, "recovering", lambda: False)()))
            for versions in self._models.values()
            for v in versions.values()
            if not getattr(v.model, "healthy", lambda: True)()
        ]

    def index(self, ready_only: bool) -> list[ModelSpec]:
        """Every model in the repository with its state (Triton's repository index)."""
        specs = []
        for name in self.repository.names():
            if name in self._models:
                specs.extend(v.spec for v in self._models[name].values())
            elif not ready_only:
                reason = self._failed.get(name, "")
                specs.append(ModelSpec(name=name, version="", state=ModelState.UNAVAILABLE, reason=reason))
        return specs

    def _version(self, name: str, version: str) -> LoadedVersion:
        versions = self._models.get(name)
        if version and (not versions or version not in versions):
            retiring = self._retiring.get((name, version))
            if retiring is not None:  # retired by a reload; its last batches still run
                return retiring
        if not versions:
            raise no_available_version(name, "it is not loaded on this replica")
        if not version:
            return versions[max(versions, key=int)]
        found = versions.get(version)
        if found is None:
            raise unknown_version(name, version, "that version is not loaded")
        return found

    def version_for(self, name: str, version: str) -> LoadedVersion:
        """The loaded (or still retiring) version a request names; the latest when ``version`` is empty."""
        return self._version(name, version)

    def serves(self, name: str, version: str) -> bool:
        """Whether ``name``/``version`` is loaded here, or retiring and still executable."""
        return version in self._models.get(name, {}) or (name, version) in self._retiring

    def metadata(self, name: str, version: str) -> ModelSpec:
        return self._version(name, version).spec

    def statistics(self, name: str = "", version: str = "") -> list[ModelStatistics]:
        out = []
        for model_name, versions in self._models.items():
            if name and model_name != name:
                continue
            for v, loaded in versions.items():
                if version and v != version:
                    continue
                out.append(loaded.stats)
        return out

    # ---- the hot path ------------------------------------------------------------------------

    @property
    def batch_lane(self) -> bool:
        """Whether batch-class batches run in the niced lane beside the instances (RuntimeSettings.batch_lane_nice)."""
        return self._lane_pool is not None

    async def execute(self, name: str, version: str, inputs: list[Tensor], outputs: list[str], *, lane: bool = False
                      ) -> tuple[list[Tensor], int]:  # fmt: skip
        """Run one batch; returns the output tensors and the compute time in ns. ``lane``: a batch of the batch
        lane, run beside the version's instances in a niced thread where its backend computes on this host's
        CPU (elsewhere, in an instance slot as any batch)."""
        try:
            out, compute_ns, loaded, rows = await self._execute(name, version, inputs, outputs, lane)
        except BaseException as exc:
            known = self._models.get(name)
            # Only a loaded version becomes a label: callers cannot grow the series.
            if known and (not version or version in known):
                labels = (name, version or max(known, key=int))
            else:
                labels = ("", "")
            self._executions(*labels, metrics.status_label(exc)).inc()
            raise
        observe = loaded.observe
        if observe is None:
            key = (loaded.spec.name, loaded.spec.version)
            observe = loaded.observe = (
                metrics.RUNTIME_EXECUTIONS.labels(*key, "ok"),
                metrics.RUNTIME_INFERENCES.labels(*key),
                metrics.RUNTIME_COMPUTE_DURATION.labels(*key),
            )
        executions, inferences, compute = observe
        executions.inc()
        inferences.inc(rows)
        compute.observe(compute_ns / 1e9)
        return out, compute_ns

    async def stream(self, loaded: LoadedVersion, request: InferRequest, options: RequestOptions):
        """A decoupled version's answers to one request: its backend's ``stream`` (see backends.py)."""
        name, version = loaded.spec.name, loaded.spec.version
        model = loaded.model
        if model is None:
            loaded, model = await self._reside(name, version, time.perf_counter_ns())
        else:
            self.residency.touch((name, version))
        stream = getattr(model, "stream", None)
        if stream is None:
            raise Unavailable(f"model '{name}' version {version} is decoupled, but its backend cannot stream")
        loaded.enter()
        stats = loaded.stats
        started = time.perf_counter_ns()
        failed = True
        try:
            async for answer in stream(request, options):
                yield answer
            failed = False
        finally:
            loaded.leave()
            # Counted as Triton counts a decoupled model: one execution of one request, however many answers.
            stats.inference_count += 1
            stats.execution_count += 1
            stats.failure_count += failed
            stats.success_count += not failed
            stats.compute_ns += time.perf_counter_ns() - started
            stats.last_inference_ms = int(time.time() * 1000)

    async def _execute(self, name: str, version: str, inputs: list[Tensor], outputs: list[str], lane: bool = False):
        entered_ns = time.perf_counter_ns()
        loaded = self._version(name, version)
        if loaded.pipeline:
            raise InvalidArgument(f"model '{name}' is a pipeline: the scheduler runs its steps, not a runtime")
        model = loaded.model
        if model is None:
            loaded, model = await self._reside(name, version, entered_ns)
        else:
            self.residency.touch((name, loaded.spec.version))
        loaded.enter()
        try:
            return await self._run_loaded(name, loaded, model, inputs, outputs, entered_ns, lane)
        finally:
            loaded.leave()

    async def _run_loaded(self, name: str, loaded: LoadedVersion, model, inputs, outputs, entered_ns: int,
                          lane: bool = False):  # fmt: skip
        spec = loaded.spec
        batched = spec.max_batch_size > 0
        if loaded.plans is None:
            loaded.plans = reshape_plans(spec, model)
        in_plans, out_plans = loaded.plans
        feeds = _feeds(inputs, in_plans, batched)
        declared_out = {o.name: o.datatype for o in spec.outputs}  # output names were checked on arrival
        if spec.sequence is not None:  # implicit state leaves the model as outputs the client may not see
            declared_out.update((s.output_name, s.datatype) for s in spec.sequence.states)
        names = list(outputs) or [o.name for o in spec.outputs]
        rows = inputs[0].shape[0] if inputs and spec.max_batch_size > 0 else 1
        stats = loaded.stats
        # Backends that do I/O (a remote Triton) set inline_ok = False; those with run_async await it here.
        inline_ok = getattr(model, "inline_ok", True)
        run_async = getattr(model, "run_async", None)
        lane_pool = self._lane_pool if lane and inline_ok and run_async is None else None
        async with contextlib.nullcontext() if lane_pool is not None else loaded.slots:
            self.inflight_batches += 1
            self._inflight_gauge.inc()
            try:
                delayed_ns = 0
                if self._debug_delay_s:  # TESTS ONLY: see RuntimeSettings.debug_delay_ms
                    delayed_ns = time.perf_counter_ns()
                    await asyncio.sleep(self._debug_delay_s)
                    delayed_ns = time.perf_counter_ns() - delayed_ns
                recent = loaded.recent_compute_ns
                if lane_pool is not None:  # beside the instances, at a low CPU priority: never on the event loop
                    results, compute_ns = await asyncio.get_running_loop().run_in_executor(
                        lane_pool, _timed_run, model, feeds, names
                    )
                elif run_async is not None:
                    started = time.perf_counter_ns()
                    results = await run_async(feeds, names)
                    compute_ns = time.perf_counter_ns() - started
                elif inline_ok and recent is not None and recent < self.inline_below_ns:
                    results, compute_ns = _timed_run(model, feeds, names)
                else:
                    results, compute_ns = await asyncio.get_running_loop().run_in_executor(
                        self._pool, _timed_run, model, feeds, names
                    )
                compute_ns += delayed_ns  # a replica slowed on purpose is a slow backend, quota included
            except Exception:
                stats.failure_count += 1
                if self.on_backend_down is not None and not getattr(model, "healthy", lambda: True)():
                    await self.on_backend_down()
                raise
            finally:
                self.inflight_batches -= 1
                self._inflight_gauge.dec()
        loaded.recent_compute_ns = compute_ns if recent is None else (3 * recent + compute_ns) // 4
        stats.inference_count += rows
        stats.execution_count += 1
        stats.success_count += 1
        stats.compute_ns += compute_ns
        stats.last_inference_ms = int(time.time() * 1000)
        out = []
        for out_name, array in zip(names, results):
            datatype = declared_out[out_name]
            plan = out_plans.get(out_name)
            if plan is not None:  # the model's shape back to the config's dims, as clients see it
                array = np.asarray(array)
                try:
                    array = array.reshape(reshaped(array.shape, batched, *plan))
                except ValueError:
                    raise Internal(
                        f"model '{name}' output '{out_name}' has shape {list(array.shape)}, which does not fit "
                        f"its reshape to dims {list(plan[1])}"
                    ) from None
            out.append(Tensor(out_name, datatype, tuple(int(d) for d in array.shape), encode(np.asarray(array), datatype)))
        if loaded.first_request_pending:
            loaded.first_request_pending = False
            now_ns = time.perf_counter_ns()
            stats.first_request_ns = now_ns - entered_ns
            if not stats.cold_start_ns:
                stats.cold_start_ns = now_ns - loaded.load_requested_ns
        return out, compute_ns, loaded, rows

    async def close(self) -> None:
        await self.queues.close()
        for task in list(self._retire_tasks):
            task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._lane_pool is not None:
            self._lane_pool.shutdown(wait=False, cancel_futures=True)


def _feeds(inputs: list[Tensor], reshapes: dict[str, tuple] | None = None, batched: bool = False):
    """The backend's inputs; those whose config has a ``reshape`` take its shape (a view: no copy)."""
    feeds = {}
    for t in inputs:
        array = decode(t.raw, t.datatype, t.shape, name=t.name)
        if t.datatype == "BYTES":  # ONNX Runtime's string tensors want str
            array = np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[object])(array)
        plan = reshapes.get(t.name) if reshapes else None
        if plan is not None:
            array = array.reshape(reshaped(array.shape, batched, *plan))
        feeds[t.name] = array
    return feeds


def reshape_plans(spec: ModelSpec, model) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """Per input (dims -> reshape) and per output (reshape -> dims), for the tensors whose config reshapes
    them; none for a backend that applies the config's reshape itself (a remote tritonserver)."""
    if getattr(model, "reshapes_itself", False):
        return {}, {}
    ins = {t.name: (t.dims, t.reshape) for t in spec.inputs if t.reshape is not None}
    outs = {t.name: (t.reshape, t.dims) for t in spec.outputs if t.reshape is not None}
    return ins, outs


def _log_close_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("closing a dropped model version failed: %s", future.exception())


def _lower_thread_priority(nice: int) -> None:
    """A batch-lane thread's start: raise its own niceness (Linux: per thread) so online work gets the CPU first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError as exc:  # never fatal: the lane still runs beside the instances, at the process's priority
        log.warning("batch lane thread keeps its priority (%s)", exc)


def _timed_run(model, feeds, names):
    started = time.perf_counter_ns()
    results = model.run(feeds, names)
    return results, time.perf_counter_ns() - started
