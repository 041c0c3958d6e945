"""This replica's link to one Triton: clients, the managed model repository, health, and restarts.

**Health.** The connection is ``ready``, ``recovering`` or ``down``, read
without I/O (the data plane asks on every heartbeat):

- A tritonserver this replica supervises that dies makes it ``recovering``
  at once (the supervisor's watcher calls back). It is restarted on the same
  ports after a backoff (``restart_backoff_s``, doubling while it keeps
  dying, at most ``restart_backoff_max_s``), every model the replica holds is
  loaded again, and the connection is ``ready`` again.
- A Triton at ``triton_url`` is polled every ``health_interval_s``; when it
  stops answering ready it is ``recovering`` (its pod restarts it), and when
  it answers again the models it lost are loaded again.
- ``recovering`` for longer than ``recover_give_up_s`` becomes ``down``: the
  replica stops advertising its Triton models, so the scheduler fails their
  requests instead of queueing them. Restarts go on at the longest backoff.

While not ready, every call raises :class:`Unavailable` at once, naming why.
New gRPC channels are made after a recovery: a channel that saw the server
die may sit in gRPC's reconnect backoff for seconds.

**Inference** goes through ``infer_async`` on the runtime's event loop, a
``grpc.aio`` call with the protocol's own stubs (tritonclient's
``service_pb2``): no worker thread, no client-side wrappers. ``infer`` is the
blocking twin for tools and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import shutil
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from aiworks.core.datatypes import datatype_of
from aiworks.core.errors import AIWorksError, Unavailable
from aiworks.core.model_config import ModelConfig
from aiworks.runtime.triton_protocol import (
    TRANSPORT_CODES,
    as_error,
    infer_request,
    link,
    parse_device_metrics,
    remove,
    response_arrays,
    triton_config,
)
from aiworks.runtime.tritonserver import TritonServer

log = logging.getLogger(__name__)

READY, RECOVERING, DOWN = "ready", "recovering", "down"
__all__ = ["TritonConnection", "parse_device_metrics"]


class TritonConnection:
    """This replica's link to one Triton: the clients, the managed repository, the server if we started it.

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
        start_timeout_s: float = 60.0,
        restart_backoff_s: float = 0.5,
        restart_backoff_max_s: float = 10.0,
        recover_give_up_s: float = 60.0,
        health_interval_s: float = 1.0,
    ):
        import tritonclient.grpc as grpcclient

        self.url = url
        self.repository = Path(repository)
        self.repository.mkdir(parents=True, exist_ok=True)
        self.metrics_url = metrics_url
        self.server = server
        self.instance_kind = instance_kind
        self.request_timeout_s = request_timeout_s
        self.start_timeout_s = start_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.restart_backoff_max_s = restart_backoff_max_s
        self.recover_give_up_s = recover_give_up_s
        self.health_interval_s = health_interval_s
        self._workdir = workdir  # removed on close when this connection made it
        self._grpcclient = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self._lock = threading.RLock()
        self._held: dict[str, dict[int, int]] = {}  # model -> version -> backend objects holding it
        self._served: dict[str, set[int]] = {}  # model -> versions in Triton's config
        self._configs: dict[str, ModelConfig] = {}
        self._pending: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="triton-release")
        self._state, self._why, self._since = READY, "", time.monotonic()
        self._generation = 0  # bumped after a recovery: channels made before it are replaced
        self._aio: tuple | None = None  # (loop, channel, stub, generation)
        self._closed = threading.Event()
        self._last_restart_s = 0.0
        self._next_delay_s = restart_backoff_s
        self.restarts = 0
        if server is not None:
            server.on_exit = self._server_died
        else:
            threading.Thread(target=self._watch_remote, name="triton-health", daemon=True).start()

    # ---- health ------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state

    def healthy(self) -> bool:
        """Triton is up and has every held model loaded (no I/O: the state the watchers keep)."""
        return self._state == READY

    def recovering(self) -> bool:
        """Triton is being restarted, or waited for, and is expected back."""
        return self._state == RECOVERING

    def _set_state(self, state: str, why: str = "") -> None:
        with self._lock:
            if state == self._state:
                self._why = why or self._why
                return
            before, self._state, self._why, self._since = self._state, state, why, time.monotonic()
        if state == READY:
            log.info("Triton is ready again (was %s)", before)
        else:
            log.warning("Triton is %s (was %s): %s", state, before, why)

    def check(self) -> None:
        """Raise :class:`Unavailable` at once unless Triton is ready."""
        if self._state != READY:
            raise Unavailable(
                f"{self._why or 'Triton is not ready'}; this replica serves its Triton models again once it is back"
            )

    def _give_up_if_long(self) -> None:
        if self._state == RECOVERING and time.monotonic() - self._since > self.recover_give_up_s:
            self._set_state(DOWN, f"{self._why} (not back after {self.recover_give_up_s:.0f} s)")

    def noticed_failure(self) -> None:
        """A call failed in transport: learn now whether the server is gone (blocking, at most ~1 s)."""
        if self.server is not None:
            if self.server.exit_code is not None or self.server.exited.wait(0.5):
                self.server.exited.wait(0.5)  # on_exit has set the state by the time it is set
            return
        if self._state == READY and not self._probe():
            self._set_state(RECOVERING, f"Triton at {self.url} is not ready")

    def _probe(self) -> bool:
        # Liveness, not readiness: Triton's strict readiness is false while any model loads, ours too.
        # The models this replica holds are checked, and loaded again, when Triton comes back.
        try:
            return bool(self.client.is_server_live(client_timeout=1))
        except Exception:
            return False

    # ---- a supervised server: restart with backoff --------------------------------------------

    def _server_died(self, code: int) -> None:
        """The supervisor's watcher: the server exited by itself. Restart it from a thread of our own."""
        # The reason reaches clients: no pid, no path (the replica's own log names the server's log).
        self._set_state(RECOVERING, f"tritonserver exited with code {code}; restarting it")
        if self._closed.is_set():
            return
        # Dying again soon after a restart doubles the wait; a server that stayed up a minute starts afresh.
        if time.monotonic() - self._last_restart_s > 60:
            self._next_delay_s = self.restart_backoff_s
        threading.Thread(target=self._restart, name="tritonserver-restart", daemon=True).start()

    def _restart(self) -> None:
        server = self.server
        server.exited.wait(5)
        delay = self._next_delay_s
        while not self._closed.wait(delay):
            started = time.monotonic()
            try:
                server.restart(self.start_timeout_s)
                if self._closed.is_set():  # closed while it started: do not leave it running
                    server.stop()
                    return
                self._generation += 1
                self._renew_client()
                loaded = self._load_all_again()
            except Exception as exc:
                log.warning("tritonserver did not come back (%s); next try in %.1f s", exc, delay)
                delay = min(delay * 2, self.restart_backoff_max_s)
                self._give_up_if_long()
                continue
            self._last_restart_s = time.monotonic()
            self._next_delay_s = min(delay * 2, self.restart_backoff_max_s)
            self.restarts += 1
            log.info(
                "tritonserver restarted (pid %d, start %d) with %d model(s) loaded again in %.1f s",
                server.pid, server.starts, loaded, time.monotonic() - started,
            )  # fmt: skip
            self._set_state(READY)
            return

    # ---- a server at triton_url: poll its readiness -------------------------------------------

    def _watch_remote(self) -> None:
        while not self._closed.wait(self.health_interval_s):
            ready = self._probe()
            if ready and self._state != READY:
                try:
                    self._generation += 1
                    self._renew_client()
                    self._load_all_again(only_missing=True)
                except Exception as exc:
                    log.warning("Triton at %s answers again but cannot load the models back yet: %s", self.url, exc)
                    continue
                self._set_state(READY)
            elif not ready and self._state == READY:
                self._set_state(RECOVERING, f"Triton at {self.url} is not ready")
            self._give_up_if_long()

    def _renew_client(self) -> None:
        old, self.client = self.client, self._grpcclient.InferenceServerClient(self.url)
        with contextlib.suppress(Exception):
            old.close()

    def _load_all_again(self, only_missing: bool = False) -> int:
        """Load every model this replica holds into a (restarted) Triton; returns how many were loaded."""
        with self._lock:
            names = sorted(n for n, held in self._held.items() if held)
            count = 0
            for name in names:
                versions = self._served.get(name) or set(self._held[name])
                if only_missing and all(self._model_ready(name, v) for v in versions):
                    continue
                self._load(name, None, versions)
                count += 1
            return count

    def _model_ready(self, name: str, version: int) -> bool:
        try:
            return bool(self.client.is_model_ready(name, str(version), client_timeout=2))
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
                error = as_error(exc, f"Triton cannot load model '{name}' version {version}")
                error.message = self._without_paths(error.message)
                if error.status is Unavailable.status:
                    self.noticed_failure()
                raise error from None

    def _without_paths(self, text: str) -> str:
        """Triton's words with this replica's folders taken out: the message can leave the process."""
        folders = [self.repository, self._workdir, self.server.workdir if self.server is not None else None]
        for folder in folders:
            if folder is not None:
                for form in {str(Path(folder).resolve()), str(folder)}:
                    text = text.replace(form, "<triton>")
        return text

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
        if self._closed.is_set():  # closed: a started server went with it, a remote one forgets on its own
            return
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
                        shutil.rmtree(self.repository / name, ignore_errors=True)
                        self.client.unload_model(name)
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
                remove(entry)
        if model_dir is not None:
            for version in versions:
                link(folder / str(version), Path(model_dir) / str(version))
        (folder / "config.pbtxt").write_text(triton_config(self._configs[name], versions, self.instance_kind))
        self._served[name] = set(versions)
        self.client.load_model(name)
        log.info("Triton serves %s versions %s", name, sorted(versions))

    # ---- inference ---------------------------------------------------------------------------

    def _stub(self):
        """The ``grpc.aio`` stub for the running loop, made again after a recovery."""
        from tritonclient.grpc import service_pb2_grpc

        loop = asyncio.get_running_loop()
        current = self._aio
        if current is None or current[0] is not loop or current[3] != self._generation:
            options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
            channel = grpc.aio.insecure_channel(self.url, options=options)
            self._aio = (loop, channel, service_pb2_grpc.GRPCInferenceServiceStub(channel), self._generation)
            if current is not None and current[0] is loop:
                loop.create_task(current[1].close())
            current = self._aio
        return current[2]

    async def infer_async(self, name: str, version: int, feeds: dict[str, np.ndarray], outputs: list[str]):
        """Run one batch on Triton from the event loop; returns ``{output name: array}``."""
        self.check()
        request = infer_request(name, version, feeds, outputs)
        try:
            response = await self._stub().ModelInfer(request, timeout=self.request_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code().name in TRANSPORT_CODES:
                await asyncio.to_thread(self.noticed_failure)
            self.check()  # a dead server explains the failure best
            raise self._failed(exc, name, version) from None
        return response_arrays(response)

    def infer(self, name: str, version: int, feeds: dict[str, np.ndarray], outputs: list[str]):
        """:meth:`infer_async`'s blocking twin (tools, tests), through tritonclient: ``{output name: array}``."""
        grpcclient = self._grpcclient
        self.check()
        inputs = []
        for input_name, array in feeds.items():
            tensor = grpcclient.InferInput(input_name, list(array.shape), datatype_of(array))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        requested = [grpcclient.InferRequestedOutput(o) for o in outputs]
        try:
            result = self.client.infer(
                name, inputs, model_version=str(version), outputs=requested, client_timeout=self.request_timeout_s
            )
        except Exception as exc:
            if str(getattr(exc, "status", lambda: "")()).removeprefix("StatusCode.") in TRANSPORT_CODES:
                self.noticed_failure()
            self.check()  # a dead server explains the failure best
            raise self._failed(exc, name, version) from None
        return {o: result.as_numpy(o) for o in outputs}

    def _failed(self, exc: Exception, name: str, version: int) -> AIWorksError:
        error = as_error(exc, f"model '{name}' version {version} on Triton at {self.url}")
        if "unknown model" in error.message:
            # Triton lost a model we hold (a restarted server): load it again for the next batches.
            # It says so with NOT_FOUND, or UNAVAILABLE for a version it knows but has not loaded.
            with contextlib.suppress(RuntimeError):  # closed
                self._releaser.submit(self._restore, name)
        return error

    def metadata(self, name: str, version: int) -> dict:
        try:
            return self.client.get_model_metadata(name, str(version), as_json=True)
        except Exception as exc:
            raise as_error(exc, f"metadata of model '{name}' on Triton") from None

    def close(self) -> None:
        """Stop the tritonserver we started (Triton unloads everything) and forget the rest."""
        self._closed.set()
        self._releaser.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        aio, self._aio = self._aio, None
        if aio is not None and not aio[0].is_closed():
            with contextlib.suppress(RuntimeError):
                aio[0].call_soon_threadsafe(lambda: aio[0].create_task(aio[1].close()))
        if self.server is not None:
            crashed = self.server.exit_code not in (None, 0)
            self.server.stop()
            if self._workdir is not None and not crashed:  # keep a crashed server's log
                shutil.rmtree(self._workdir, ignore_errors=True)
