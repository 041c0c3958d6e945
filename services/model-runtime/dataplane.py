"""The runtime's logic, free of transport: load models and execute batches."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from aiworks.core.datatypes import Tensor, decode, encode
from aiworks.core.inference import ModelStatistics
from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound
from aiworks.core.model_config import ModelConfig, ModelSpec, ModelState
from aiworks.runtime.backends import BACKENDS
from aiworks.runtime.repository import ModelRepository

log = logging.getLogger(__name__)


@dataclass
class LoadedVersion:
    spec: ModelSpec
    model: object
    slots: asyncio.Semaphore
    stats: ModelStatistics
    # Moving average of one batch's compute time; None until measured, so a
    # new model runs in the worker pool until it is known to be cheap.
    recent_compute_ns: int | None = None


class RuntimeDataPlane:
    """Holds the loaded model versions of one replica and runs batches on them.

    Backends run in a thread pool so the event loop keeps serving while ONNX
    Runtime (which releases the GIL) computes; ``instance_group.count`` bounds
    how many batches of one version run at once. A model whose batches take
    less than ``inline_below_us`` runs on the event loop instead: handing
    such a batch to a thread and back costs more than running it.
    """

    def __init__(
        self,
        repository: ModelRepository,
        *,
        intra_op_threads: int = 1,
        max_workers: int = 8,
        inline_below_us: int = 100,
    ):
        self.inline_below_ns = inline_below_us * 1000
        self.repository = repository
        self.intra_op_threads = intra_op_threads
        self._models: dict[str, dict[str, LoadedVersion]] = {}
        self._failed: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="backend")
        self.inflight_batches = 0

    # ---- lifecycle ---------------------------------------------------------------------------

    async def load(self, name: str) -> list[ModelSpec]:
        """(Re)load a model's versions per its version policy; returns their specs."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            entry = self.repository.entry(name)
            if entry.config is None:
                self._failed[name] = entry.error
                raise InvalidArgument(f"cannot load model '{name}': {entry.error}")
            config = entry.config
            backend = BACKENDS.get(config.backend)
            if backend is None:
                raise InvalidArgument(f"model '{name}': backend '{config.backend}' is not available on this replica")
            wanted = config.version_policy.select(list(entry.versions))
            if not wanted:
                raise NotFound(f"model '{name}' has no version folder that its version policy selects")
            loop = asyncio.get_running_loop()
            loaded: dict[str, LoadedVersion] = {}
            for version in wanted:
                path = self.repository.model_file(config, version)
                started = time.perf_counter()
                try:
                    model = await loop.run_in_executor(self._pool, backend, path, config, self.intra_op_threads)
                except AIWorksError:
                    raise
                except Exception as exc:
                    self._failed[name] = f"version {version}: {exc}"
                    raise InvalidArgument(f"cannot load model '{name}' version {version}: {exc}") from None
                spec = self._complete(config, model).spec(str(version))
                loaded[str(version)] = LoadedVersion(
                    spec, model, asyncio.Semaphore(spec.instance_count), ModelStatistics(name, str(version))
                )
                log.info("loaded %s version %s in %.0f ms", name, version, (time.perf_counter() - started) * 1e3)
            previous = self._models.get(name, {})
            self._models[name] = loaded
            self._failed.pop(name, None)
            for gone in sorted(set(previous) - set(loaded)):
                log.info("retired %s version %s", name, gone)
            return [v.spec for v in loaded.values()]

    async def unload(self, name: str) -> None:
        async with self._locks.setdefault(name, asyncio.Lock()):
            if self._models.pop(name, None) is None:
                raise NotFound(f"model '{name}' is not loaded")
            log.info("unloaded %s", name)

    def _complete(self, config: ModelConfig, model) -> ModelConfig:
        """Fill inputs/outputs the config omits from the model itself (Triton's auto-complete)."""
        if config.inputs and config.outputs:
            return config
        inputs, outputs = model.io_specs(config.max_batch_size > 0)
        return replace(config, inputs=config.inputs or inputs, outputs=config.outputs or outputs)

    # ---- queries -----------------------------------------------------------------------------

    def ready_specs(self) -> list[ModelSpec]:
        return [v.spec for versions in self._models.values() for v in versions.values()]

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
        if not versions:
            raise NotFound(f"model '{name}' is not loaded on this replica")
        if not version:
            return versions[max(versions, key=int)]
        found = versions.get(version)
        if found is None:
            raise NotFound(f"model '{name}' has no loaded version '{version}'")
        return found

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

    async def execute(self, name: str, version: str, inputs: list[Tensor], outputs: list[str]) -> tuple[list[Tensor], int]:
        """Run one batch; returns the output tensors and the compute time in ns."""
        loaded = self._version(name, version)
        spec = loaded.spec
        feeds = {}
        for t in inputs:
            array = decode(t.raw, t.datatype, t.shape, name=t.name)
            if t.datatype == "BYTES":  # ONNX Runtime's string tensors want str
                array = np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[object])(array)
            feeds[t.name] = array
        declared_out = {o.name: o for o in spec.outputs}
        for o in outputs:
            if o not in declared_out:
                raise InvalidArgument(f"model '{name}' has no output '{o}'; it has {sorted(declared_out)}")
        names = list(outputs) or [o.name for o in spec.outputs]
        rows = inputs[0].shape[0] if inputs and spec.max_batch_size > 0 else 1
        stats = loaded.stats
        async with loaded.slots:
            self.inflight_batches += 1
            try:
                recent = loaded.recent_compute_ns
                if recent is not None and recent < self.inline_below_ns:
                    results, compute_ns = _timed_run(loaded.model, feeds, names)
                else:
                    results, compute_ns = await asyncio.get_running_loop().run_in_executor(
                        self._pool, _timed_run, loaded.model, feeds, names
                    )
            except Exception:
                stats.failure_count += 1
                raise
            finally:
                self.inflight_batches -= 1
        loaded.recent_compute_ns = compute_ns if recent is None else (3 * recent + compute_ns) // 4
        stats.inference_count += rows
        stats.execution_count += 1
        stats.success_count += 1
        stats.compute_ns += compute_ns
        stats.last_inference_ms = int(time.time() * 1000)
        out = []
        for out_name, array in zip(names, results):
            datatype = declared_out[out_name].datatype
            out.append(Tensor(out_name, datatype, tuple(int(d) for d in array.shape), encode(np.asarray(array), datatype)))
        return out, compute_ns

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _timed_run(model, feeds, names):
    started = time.perf_counter_ns()
    results = model.run(feeds, names)
    return results, time.perf_counter_ns() - started
