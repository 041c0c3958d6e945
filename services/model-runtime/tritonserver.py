"""Starts and supervises one local ``tritonserver`` for the runtime's triton backend.

By default the binary is the one bundled in the ``nvidia-pytriton`` wheel
(requirements-triton.txt): a real Triton Inference Server build with the
Python backend, which runs on a machine without a GPU. A full Triton install
(``/opt/tritonserver/bin/tritonserver`` next to ``backends/``) works the same
way through ``triton_server_path``.

The server always runs in explicit model-control mode: the triton backend
loads and unloads models through Triton's repository API.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiworks.core.lifecycle import orphan_proof, terminate

log = logging.getLogger(__name__)


class TritonServerError(RuntimeError):
    """tritonserver cannot be found, or it did not start."""


@dataclass(frozen=True)
class TritonDistribution:
    """Where one tritonserver build keeps its binary, shared libraries and backends."""

    binary: Path
    backends: Path
    libs: Path | None = None  # bundled shared libraries (the wheel's nvidia_pytriton.libs)
    python_stubs: Path | None = None  # python_backend_stubs/<X.Y>/ (the wheel ships one per Python)

    @classmethod
    def find(cls, binary: Path | None = None) -> TritonDistribution:
        """The build at ``binary`` (Triton's own layout), else the one inside nvidia-pytriton."""
        if binary is not None:
            binary = Path(binary)
            if not binary.is_file():
                raise TritonServerError(f"tritonserver binary {binary} does not exist")
            root = binary.resolve().parent.parent
            stubs = root / "python_backend_stubs"
            return cls(binary, root / "backends", None, stubs if stubs.is_dir() else None)
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise TritonServerError(
                "no tritonserver: install requirements-triton.txt (nvidia-pytriton bundles one), "
                "set triton_server_path, or point triton_url at a running server"
            )
        package = Path(next(iter(spec.submodule_search_locations)))
        root = package / "tritonserver"
        if not (root / "bin" / "tritonserver").is_file():
            raise TritonServerError(f"the nvidia-pytriton install at {package} has no tritonserver binary")
        return cls(root / "bin" / "tritonserver", root / "backends", package.parent / "nvidia_pytriton.libs",
                   root / "python_backend_stubs")  # fmt: skip

    def backend_directory(self, workdir: Path) -> Path:
        """A ``--backend-directory`` whose python backend has the stub built for this Python.

        The wheel ships one stub per Python version beside the backends instead
        of inside them, so link the backends into ``workdir`` and put ours in.
        """
        if self.python_stubs is None:
            return self.backends
        stub = self.python_stubs / f"{sys.version_info.major}.{sys.version_info.minor}" / "triton_python_backend_stub"
        if not stub.is_file():
            raise TritonServerError(f"this tritonserver build has no Python backend stub for Python {sys.version[:4]}")
        target = workdir / "backends"
        for backend in self.backends.iterdir():
            if not backend.is_dir():
                continue
            folder = target / backend.name
            folder.mkdir(parents=True, exist_ok=True)
            for item in backend.iterdir():
                if item.is_file():
                    _link(folder / item.name, item)
        _link(target / "python" / "triton_python_backend_stub", stub)
        return target

    def environment(self) -> dict[str, str]:
        """The environment tritonserver and its Python-backend stubs need."""
        env = dict(os.environ)
        # The stub embeds libpython: it must load this interpreter's, not another
        # libpython3.X on the default search path, or model init fails.
        paths = [sysconfig.get_config_var("LIBDIR")]
        if self.libs is not None:
            paths.append(str(self.libs))
        if env.get("LD_LIBRARY_PATH"):
            paths.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
        # The embedded interpreter finds its prefix (and so this virtual
        # environment's site-packages) by looking up "python3" on PATH.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env


def _link(path: Path, target: Path) -> None:
    if path.is_symlink() or path.exists():
        if path.resolve() == target.resolve():
            return
        path.unlink()
    path.symlink_to(target)


class TritonServer:
    """One ``tritonserver`` process: start, wait until ready, notice its death, stop.

    The process is started from a watcher thread that lives exactly as long as
    the process: the thread waits on it, so a death is noticed at once
    (:attr:`exit_code`), and because the kernel's parent-death signal is tied
    to the thread that forked, the server also goes when this process dies.
    """

    def __init__(
        self,
        distribution: TritonDistribution,
        model_repository: Path,
        workdir: Path,
        *,
        host: str = "127.0.0.1",
        grpc_port: int = 0,
        metrics_port: int = 0,
        extra_args: tuple[str, ...] = (),
    ):
        from aiworks.supervisor.supervisor import free_port

        self.distribution = distribution
        self.model_repository = Path(model_repository)
        self.workdir = Path(workdir)
        self.host = host
        self.grpc_port = grpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.extra_args = tuple(extra_args)
        self.log_path = self.workdir / "tritonserver.log"
        # Python-backend stubs talk to the server through /dev/shm regions named
        # with this prefix. A killed server leaves them behind; the watcher removes them.
        self.shm_prefix = f"aiworks_triton_{uuid.uuid4().hex[:12]}_"
        self._process: subprocess.Popen | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = False
        self.exit_code: int | None = None
        # Set once a start's process has exited and on_exit has run (so waiters see the state it set).
        self.exited = threading.Event()
        self.on_exit: Callable[[int], None] | None = None
        """Called from the watcher thread with the exit code when the server dies (not when stopped)."""
        self.starts = 0

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def running(self) -> bool:
        return self._process is not None and self.exit_code is None

    def argv(self) -> list[str]:
        return [
            str(self.distribution.binary),
            f"--model-repository={self.model_repository}",
            "--model-control-mode=explicit",
            f"--backend-directory={self.distribution.backend_directory(self.workdir)}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--allow-http=false",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=true",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--exit-timeout-secs=5",
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the server and return once it is live and ready; raise with its log if not."""
        if self._process is not None:
            raise TritonServerError("this TritonServer was started already")
        self.starts += 1
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_repository.mkdir(parents=True, exist_ok=True)
        argv, env = self.argv(), self.distribution.environment()
        started = threading.Event()
        failure: list[BaseException] = []

        def watch() -> None:
            try:
                with open(self.log_path, "ab") as logfile:
                    # Its own process group, so its Python-backend stubs can be ended with it.
                    self._process = subprocess.Popen(
                        orphan_proof(argv), stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
                        env=env, start_new_session=True,
                    )  # fmt: skip
            except OSError as exc:
                failure.append(exc)
                return
            finally:
                started.set()
            process = self._process
            code = process.wait()
            self._clean_up_after(process.pid)
            self.exit_code = code
            try:
                if not self._stopping:
                    log.error("tritonserver (pid %d) exited with code %d; see %s", process.pid, code, self.log_path)
                    if self.on_exit is not None:
                        self.on_exit(code)
            finally:
                self.exited.set()

        self._watcher = threading.Thread(target=watch, name="tritonserver-watcher", daemon=True)
        self._watcher.start()
        started.wait()
        if failure:
            raise TritonServerError(f"cannot start {argv[0]}: {failure[0]}")
        log.info("started tritonserver (pid %d) on %s, log %s", self.pid, self.grpc_url, self.log_path)
        try:
            self.wait_ready(timeout_s)
        except TritonServerError:
            self.stop()
            raise

    def _clean_up_after(self, pid: int) -> None:
        """End what a killed server leaves: its Python-backend stubs and their shared memory."""
        try:
            os.killpg(pid, signal.SIGKILL)  # the server led its own process group
        except (ProcessLookupError, PermissionError):
            pass
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)

    def wait_ready(self, timeout_s: float) -> None:
        import tritonclient.grpc as grpcclient

        deadline = time.monotonic() + timeout_s
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            while time.monotonic() < deadline:
                if self.exit_code is not None:
                    raise TritonServerError(f"tritonserver exited with code {self.exit_code}:\n{self.log_tail()}")
                try:
                    if client.is_server_live(client_timeout=1) and client.is_server_ready(client_timeout=1):
                        return
                except Exception:
                    pass
                time.sleep(0.1)
        finally:
            client.close()
        raise TritonServerError(f"tritonserver was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def restart(self, timeout_s: float = 60.0) -> None:
        """Start a new server on the same ports and repository after this one died (or stop it first)."""
        self.stop()
        self._process, self._watcher, self.exit_code, self._stopping = None, None, None, False
        self.exited.clear()
        self.start(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server (Triton unloads its models and exits), SIGKILL it if it lingers."""
        self._stopping = True
        process = self._process
        if process is None or process.poll() is not None:
            return
        terminate(process, "tritonserver", timeout_s)
        if self._watcher is not None:
            self._watcher.join(timeout_s)
        log.info("stopped tritonserver (pid %d)", process.pid)
