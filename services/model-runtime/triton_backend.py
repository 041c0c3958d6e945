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
import logging
import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from aiworks.core.errors import InvalidArgument, Unavailable
from aiworks.core.model_config import ModelConfig, TensorSpec
from aiworks.runtime.triton_connection import TritonConnection
from aiworks.runtime.triton_protocol import BACKEND_PARAMETER, parse_device_metrics, triton_config
from aiworks.runtime.tritonserver import TritonDistribution, TritonServer, TritonServerError

if TYPE_CHECKING:
    from aiworks.runtime.settings import RuntimeSettings

log = logging.getLogger(__name__)

__all__ = [
    "BACKEND_PARAMETER",
    "TritonModel",
    "configure",
    "connection",
    "device_metrics",
    "parse_device_metrics",
    "shutdown",
    "triton_config",
]


# ---- the replica's one connection ------------------------------------------------------------

_connection: TritonConnection | None = None
_connection_lock = threading.Lock()
_settings: RuntimeSettings | None = None


def use_settings(settings: RuntimeSettings) -> None:
    """Give the backend the runtime's settings; the connection still opens on first use."""
    global _settings
    _settings = settings


def connect(settings: RuntimeSettings) -> TritonConnection:
    """A connection to ``triton_url``, or to a tritonserver started and supervised here."""
    tuning = dict(
        instance_kind=settings.triton_instance_kind,
        request_timeout_s=settings.triton_request_timeout_s,
        start_timeout_s=settings.triton_start_timeout_s,
        restart_backoff_s=settings.triton_restart_backoff_s,
        restart_backoff_max_s=settings.triton_restart_backoff_max_s,
        recover_give_up_s=settings.triton_recover_give_up_s,
        health_interval_s=settings.triton_health_interval_s,
    )
    if settings.triton_url:
        if settings.triton_repository is None:
            raise InvalidArgument(
                "triton_url needs triton_repository: the --model-repository of that tritonserver, "
                "which this replica writes model configs into"
            )
        metrics_url = settings.triton_metrics_url
        if metrics_url is None and settings.triton_metrics_port:
            metrics_url = f"http://{settings.triton_url.rsplit(':', 1)[0]}:{settings.triton_metrics_port}/metrics"
        return TritonConnection(settings.triton_url, settings.triton_repository, metrics_url=metrics_url, **tuning)
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
    return TritonConnection(
        server.grpc_url,
        server.model_repository,
        metrics_url=settings.triton_metrics_url or server.metrics_url,
        server=server,
        workdir=workdir,
        **tuning,
    )


def configure(settings: RuntimeSettings) -> TritonConnection:
    """Open the replica's Triton connection from its settings (starting tritonserver if needed).

    The runtime calls it at start-up when a model uses Triton or ``triton_url``
    is set; otherwise the first Triton model opens it.
    """
    global _connection
    with _connection_lock:
        if _connection is None:
            _connection = connect(settings)
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

    # Every call is network I/O to tritonserver: never run it on the event loop's thread;
    # run_async awaits it on the loop instead.
    inline_ok = False
    # Triton waits max_queue_delay_microseconds itself, to the microsecond; the scheduler's window
    # (asyncio's timers round it up to whole milliseconds) would only add to it: docs/triton.md.
    batch_window_in_backend = True
    # tritonserver applies the config's reshape itself: it takes and answers tensors in the config's dims.
    reshapes_itself = True

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
        return [result[n] for n in names]

    async def run_async(self, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
        """:meth:`run` on the event loop: one ``grpc.aio`` call, no worker thread (the data plane prefers it)."""
        names = outputs or list(self._outputs)
        result = await self._conn.infer_async(self.name, self.version, feeds, names)
        return [result[n] for n in names]

    def healthy(self) -> bool:
        """Triton is ready with this replica's models (the connection's state: no I/O)."""
        return self._conn.healthy()

    def recovering(self) -> bool:
        """Triton is being restarted or waited for; the version comes back without a reload."""
        return self._conn.recovering()

    def gpu_metrics(self) -> dict[str, dict[str, float]]:
        return self._conn.gpu_metrics()

    def close(self) -> None:
        """Release this version in Triton now (the same happens when the object is dropped)."""
        if self._release.detach() is not None:
            self._conn.release(self.name, self.version)
