"""The ``triton`` backend: serve a model through a Triton Inference Server over gRPC.

A model opts in with ``backend: "triton"`` in its ``config.pbtxt``; the rest
of that config is Triton's own and says what Triton runs:

- ``platform: "onnxruntime_onnx"`` or ``"tensorrt_plan"`` (``<v>/model.onnx``
  or ``<v>/model.plan``), with ``instance_group`` kinds KIND_GPU / KIND_CPU;
- or ``parameters { key: "triton_backend" value { string_value: "python" } }``
  for a Triton Python-backend model (``<v>/model.py``), such as the CPU
  stand-in the tests use.

The replica keeps a Triton model repository of its own: for each model it
writes Triton's ``config.pbtxt`` (the suite's config less the suite's own
keys, listing the versions this replica holds) and links the version folders
from the suite's repository, then loads and unloads through Triton's
repository API (tritonserver runs with ``--model-control-mode=explicit``).
Triton is either started and supervised by this replica
(:class:`~aiworks.runtime.tritonserver.TritonServer`) or reached at
``triton_url``. When Triton cannot be reached, or the supervised server has
died, every call raises :class:`Unavailable`, so the scheduler retries the
batch on another replica or answers UNAVAILABLE.

See docs/triton.md.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import logging
import queue
import shutil
import tempfile
import threading
import time
import urllib.request
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from aiworks.runtime.tritonserver import TritonDistribution, TritonServer, TritonServerError

from aiworks.core.errors import AIWorksError, DeadlineExceeded, Internal, InvalidArgument, Unavailable
from aiworks.core.model_config import ModelConfig, TensorSpec

if TYPE_CHECKING:
    from aiworks.runtime.settings import RuntimeSettings

log = logging.getLogger(__name__)

BACKEND_PARAMETER = "triton_backend"
"""Config parameter naming a Triton backend (``python``) for models without a platform."""

DEVICE_METRIC_PREFIXES = ("nv_gpu_", "nv_cpu_", "nv_energy_")

_GRPC_ERRORS = {
    "StatusCode.INVALID_ARGUMENT": InvalidArgument,
    "StatusCode.DEADLINE_EXCEEDED": DeadlineExceeded,
    # Triton answers UNAVAILABLE and NOT_FOUND for a model it has not (or no
    # longer) loaded: for the scheduler, this replica cannot serve it right now.
    "StatusCode.UNAVAILABLE": Unavailable,
    "StatusCode.NOT_FOUND": Unavailable,
    "StatusCode.CANCELLED": Unavailable,
}


def triton_config(config: ModelConfig, versions: Iterable[int], instance_kind: str | None = None) -> str:
    """Triton's ``config.pbtxt`` for a suite model config, serving ``versions``."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    doc = copy.deepcopy(config.document)
    doc.pop("backend", None)  # "triton" selects this backend; Triton must not see it
    params = doc.pop("parameters", {})
    triton_backend = params.pop(BACKEND_PARAMETER, {}).get("string_value", "")
    if params:
        doc["parameters"] = params
    if triton_backend:
        doc.pop("platform", None)
        doc["backend"] = triton_backend
    else:
        doc["platform"] = config.platform
    doc["version_policy"] = {"specific": {"versions": sorted(set(versions))}}
    # The suite's cache service answers repeated requests before they reach a replica.
    doc.pop("response_cache", None)
    if "dynamic_batching" in doc:
        # The scheduler forms the batches; Triton merges what arrives together but never waits.
        doc["dynamic_batching"] = {}
    if instance_kind:
        groups = doc.get("instance_group") or [{"count": 1}]
        doc["instance_group"] = [{**g, "kind": instance_kind} for g in groups]
    try:
        message = json_format.ParseDict(doc, model_config_pb2.ModelConfig())
    except json_format.ParseError as exc:
        raise InvalidArgument(f"model '{config.name}': cannot write Triton's config: {exc}") from None
    return text_format.MessageToString(message)


def parse_device_metrics(text: str) -> dict[str, dict[str, float]]:
    """Triton's device metrics from its Prometheus text: ``{name: {gpu_uuid or "": value}}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(DEVICE_METRIC_PREFIXES):
            continue
        for sample in family.samples:
            # Keep Triton's names: the parser calls a counter's sample <name>_total.
            if sample.name in (family.name, f"{family.name}_total"):
                out.setdefault(family.name, {})[sample.labels.get("gpu_uuid", "")] = float(sample.value)
    return out


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _link(link: Path, target: Path) -> None:
    target = target.resolve()
    if link.is_symlink() and link.resolve() == target:
        return
    _remove(link)
    link.symlink_to(target, target_is_directory=True)


def _as_error(exc: Exception, what: str) -> AIWorksError:
    from tritonclient.utils import InferenceServerException

    if isinstance(exc, AIWorksError):
        return exc
    if isinstance(exc, InferenceServerException):
        kind = _GRPC_ERRORS.get(str(exc.status()), Internal)
        return kind(f"{what}: Triton says: {exc.message()}")
    return Internal(f"{what}: {exc}")


class TritonConnection:
    """This replica's link to one Triton: the client, the managed repository, the server if we started it.

    Thread-safe. Model versions are reference-counted: the Triton model lists
    every version some backend object holds, and is unloaded when none does.
    """

    def __init__(
        self,
        url: str,
        repository: Path,
        *,
        metrics_url: str | None = None,
        server: TritonServer | None = None,
        instance_kind: str | None = None,
        request_timeout_s: float = 30.0,
        workdir: Path | None = None,
    ):
        import tritonclient.grpc as grpcclient

        self.url = url
        self.repository = Path(repository)
        self.repository.mkdir(parents=True, exist_ok=True)
        self.metrics_url = metrics_url
        self.server = server
        self.instance_kind = instance_kind
        self.request_timeout_s = request_timeout_s
        self._workdir = workdir  # removed on close when this connection made it
        self.client = grpcclient.InferenceServerClient(url)
        self._lock = threading.Lock()
        self._held: dict[str, dict[int, int]] = {}  # model -> version -> backend objects holding it
        self._served: dict[str, set[int]] = {}  # model -> versions in Triton's config
        self._configs: dict[str, ModelConfig] = {}
        self._pending: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="triton-release")

    @classmethod
    def from_settings(cls, settings: RuntimeSettings) -> TritonConnection:
        """Connect to ``triton_url``, or start and supervise a tritonserver of our own."""
        if settings.triton_url:
            if settings.triton_repository is None:
                raise InvalidArgument(
                    "triton_url needs triton_repository: the --model-repository of that tritonserver, "
                    "which this replica writes model configs into"
                )
            return cls(
                settings.triton_url,
                settings.triton_repository,
                metrics_url=settings.triton_metrics_url,
                instance_kind=settings.triton_instance_kind,
                request_timeout_s=settings.triton_request_timeout_s,
            )
        workdir = Path(tempfile.mkdtemp(prefix="aiworks-triton-"))
        try:
            server = TritonServer(
                TritonDistribution.find(settings.triton_server_path),
                settings.triton_repository or workdir / "models",
                workdir,
                grpc_port=settings.triton_grpc_port,
                metrics_port=settings.triton_metrics_port,
            )
            server.start(settings.triton_start_timeout_s)
        except TritonServerError as exc:
            shutil.rmtree(workdir, ignore_errors=True)  # the message carries the end of its log
            raise Unavailable(f"cannot start tritonserver: {exc}") from None
        return cls(
            server.grpc_url,
            server.model_repository,
            metrics_url=settings.triton_metrics_url or server.metrics_url,
            server=server,
            instance_kind=settings.triton_instance_kind,
            request_timeout_s=settings.triton_request_timeout_s,
            workdir=workdir,
        )

    # ---- health ------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`Unavailable` at once if the tritonserver we supervise has died."""
        server = self.server
        if server is not None and server.exit_code is not None:
            # The message reaches clients; the log's path is in this replica's own log (tritonserver.py).
            raise Unavailable(
                f"tritonserver exited with code {server.exit_code}; "
                "this replica cannot serve Triton models until it is restarted (see its log)"
            )

    def healthy(self) -> bool:
        """Triton is live and ready (Triton's health, for the replica's)."""
        try:
            self.check()
            return bool(self.client.is_server_live(client_timeout=2) and self.client.is_server_ready(client_timeout=2))
        except Exception:
            return False

    def gpu_metrics(self) -> dict[str, dict[str, float]]:
        """Triton's ``nv_gpu_*`` (utilisation, memory, power), ``nv_energy_*`` and ``nv_cpu_*`` gauges."""
        if not self.metrics_url:
            return {}
        self.check()
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as resp:
                text = resp.read().decode()
        except OSError as exc:
            raise Unavailable(f"cannot read Triton's metrics at {self.metrics_url}: {exc}") from None
        return parse_device_metrics(text)

    # ---- the managed model repository --------------------------------------------------------

    def acquire(self, config: ModelConfig, version: int, version_dir: Path) -> None:
        """Serve ``version`` of ``config.name`` from ``version_dir``, (re)loading the model in Triton.

        The first version asked for brings every version the config's policy
        selects on disk: Triton then loads them in one go, and the next
        acquire finds its version served already. Asking again for a version
        held already is a reload, and Triton reloads.
        """
        name = config.name
        with self._lock:
            self.check()
            held = self._held.setdefault(name, {})
            reload = version in held or self._configs.get(name) != config
            held[version] = held.get(version, 0) + 1
            try:
                self._configs[name] = config
                if reload or version not in self._served.get(name, set()):
                    model_dir = Path(version_dir).parent
                    on_disk = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
                    self._load(name, model_dir, set(held) | set(config.version_policy.select(on_disk)))
            except Exception as exc:
                held[version] -= 1
                if not held[version]:
                    del held[version]
                if not held:
                    del self._held[name]
                    self._configs.pop(name, None)
                raise _as_error(exc, f"Triton cannot load model '{name}' version {version}") from None

    def release(self, name: str, version: int) -> None:
        """Drop one hold on a version; Triton reloads without it, or unloads the model."""
        self._release_all([(name, version)])

    def release_soon(self, name: str, version: int) -> None:
        """:meth:`release` off the caller's thread, taking no lock (finalizers run anywhere)."""
        self._pending.put((name, version))
        try:
            self._releaser.submit(self._drain)
        except RuntimeError:  # closed
            pass

    def held_versions(self, name: str) -> list[int]:
        with self._lock:
            return sorted(self._held.get(name, {}))

    def _drain(self) -> None:
        # The data plane drops all versions of a model at once: let the rest arrive.
        time.sleep(0.05)
        items = []
        while not self._pending.empty():
            items.append(self._pending.get_nowait())
        self._release_all(items)

    def _release_all(self, items: list[tuple[str, int]]) -> None:
        # Versions dropped together (an unload) cost Triton one change per model, not one each.
        with self._lock:
            touched = set()
            for name, version in items:
                held = self._held.get(name, {})
                if version in held:
                    held[version] -= 1
                    if not held[version]:
                        del held[version]
                        touched.add(name)
            for name in sorted(touched):
                held = self._held.get(name, {})
                try:
                    if held and set(held) != self._served.get(name):
                        self._load(name, None, set(held))
                    elif not held:
                        self._held.pop(name, None)
                        self._configs.pop(name, None)
                        self._served.pop(name, None)
                        self.client.unload_model(name)
                        shutil.rmtree(self.repository / name, ignore_errors=True)
                        log.info("unloaded %s from Triton", name)
                except Exception as exc:  # Triton may be gone; the holds are dropped all the same
                    log.warning("Triton could not drop versions of model %s: %s", name, exc)

    def _restore(self, name: str) -> None:
        with self._lock:
            if self._held.get(name):
                try:
                    self._load(name, None, set(self._served.get(name) or self._held[name]))
                except Exception as exc:
                    log.warning("Triton could not load model %s again: %s", name, exc)

    def _load(self, name: str, model_dir: Path | None, versions: set[int]) -> None:
        """Point Triton's copy of the model at ``versions`` (linked from ``model_dir``) and load it."""
        folder = self.repository / name
        folder.mkdir(parents=True, exist_ok=True)
        for entry in folder.iterdir():
            if entry.name.isdigit() and int(entry.name) not in versions:
                _remove(entry)
        if model_dir is not None:
            for version in versions:
                _link(folder / str(version), Path(model_dir) / str(version))
        (folder / "config.pbtxt").write_text(triton_config(self._configs[name], versions, self.instance_kind))
        self._served[name] = set(versions)
        self.client.load_model(name)
        log.info("Triton serves %s versions %s", name, sorted(versions))

    # ---- inference ---------------------------------------------------------------------------

    def infer(self, name: str, version: int, feeds: dict[str, np.ndarray], outputs: list[str]):
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        self.check()
        inputs = []
        for input_name, array in feeds.items():
            datatype = "BYTES" if array.dtype == object else np_to_triton_dtype(array.dtype)
            tensor = grpcclient.InferInput(input_name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            return self.client.infer(
                name,
                inputs,
                model_version=str(version),
                outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                client_timeout=self.request_timeout_s,
            )
        except Exception as exc:
            self.check()  # a dead server explains the failure best
            error = _as_error(exc, f"model '{name}' version {version} on Triton at {self.url}")
            if isinstance(exc, InferenceServerException) and "unknown model" in (exc.message() or ""):
                # Triton lost a model we hold (a restarted server): load it again for the next batches.
                # It says so with NOT_FOUND, or UNAVAILABLE for a version it knows but has not loaded.
                with contextlib.suppress(RuntimeError):  # closed
                    self._releaser.submit(self._restore, name)
            raise error from None

    def metadata(self, name: str, version: int) -> dict:
        try:
            return self.client.get_model_metadata(name, str(version), as_json=True)
        except Exception as exc:
            raise _as_error(exc, f"metadata of model '{name}' on Triton") from None

    def close(self) -> None:
        """Stop the tritonserver we started (Triton unloads everything) and forget the rest."""
        self._releaser.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        if self.server is not None:
            crashed = self.server.exit_code not in (None, 0)
            self.server.stop()
            if self._workdir is not None and not crashed:  # keep a crashed server's log
                shutil.rmtree(self._workdir, ignore_errors=True)


# ---- the replica's one connection ------------------------------------------------------------

_connection: TritonConnection | None = None
_connection_lock = threading.Lock()
_settings: RuntimeSettings | None = None


def use_settings(settings: RuntimeSettings) -> None:
    """Give the backend the runtime's settings; the connection still opens on first use."""
    global _settings
    _settings = settings


def configure(settings: RuntimeSettings) -> TritonConnection:
    """Open the replica's Triton connection from its settings (starting tritonserver if needed)."""
    global _connection
    with _connection_lock:
        if _connection is None:
            _connection = TritonConnection.from_settings(settings)
            atexit.register(shutdown)
        return _connection


def connection() -> TritonConnection:
    """The replica's Triton connection, opened on first use."""
    if _connection is not None:
        return _connection
    if _settings is not None:
        return configure(_settings)
    from aiworks.runtime.settings import RuntimeSettings

    # Used outside a runtime process (tests, tools): read the same
    # AIWORKS_RUNTIME_TRITON_* variables the runtime reads.
    return configure(RuntimeSettings(scheduler_address=""))


def device_metrics() -> dict[str, dict[str, float]] | None:
    """Triton's device metrics while this replica has a connection open; None otherwise (never opens one)."""
    conn = _connection
    return conn.gpu_metrics() if conn is not None else None


def shutdown() -> None:
    """Close the replica's Triton connection, stopping a tritonserver it started."""
    global _connection
    with _connection_lock:
        conn, _connection = _connection, None
    if conn is not None:
        conn.close()


class TritonModel:
    """One model version served by Triton; built as ``TritonModel(path, config, threads)``.

    ``path`` is the version's model file in the suite's repository; its whole
    version folder is what Triton loads. Dropping the object (or :meth:`close`)
    releases the version in Triton.
    """

    # Every call is network I/O to tritonserver: never run it on the event loop.
    inline_ok = False

    def __init__(self, path: Path, config: ModelConfig, default_intra_op_threads: int = 1):
        self.name = config.name
        self.version = int(Path(path).parent.name)
        self.batched = config.max_batch_size > 0
        self._outputs = {o.name: o for o in config.outputs}
        self._conn = connection()
        self._conn.acquire(config, self.version, Path(path).parent)
        # Released when the data plane drops this version, even if nobody calls close().
        self._release = weakref.finalize(self, self._conn.release_soon, self.name, self.version)
        self._release.atexit = False

    def io_specs(self, batched: bool) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """Inputs and outputs as Triton reports them (its auto-complete, for configs that omit them)."""
        meta = self._conn.metadata(self.name, self.version)

        def spec(t: dict) -> TensorSpec:
            dims = [int(d) for d in t["shape"]]
            return TensorSpec(t["name"], t["datatype"], tuple(dims[1:] if batched and dims else dims))

        return tuple(spec(t) for t in meta["inputs"]), tuple(spec(t) for t in meta["outputs"])

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
        names = outputs or list(self._outputs)
        result = self._conn.infer(self.name, self.version, feeds, names)
        return [self._shaped(n, result.as_numpy(n)) for n in names]

    def _shaped(self, name: str, array: np.ndarray) -> np.ndarray:
        # Triton answers in the config's dims; the suite declares a reshaped
        # output by its reshape shape, as its own backends produce it.
        spec = self._outputs.get(name)
        if spec is None or not self.batched or array.ndim == len(spec.dims) + 1 or spec.dims.count(-1) > 1:
            return array
        return array.reshape((array.shape[0], *spec.dims))

    def healthy(self) -> bool:
        return self._conn.healthy()

    def gpu_metrics(self) -> dict[str, dict[str, float]]:
        return self._conn.gpu_metrics()

    def close(self) -> None:
        """Release this version in Triton now (the same happens when the object is dropped)."""
        if self._release.detach() is not None:
            self._conn.release(self.name, self.version)
