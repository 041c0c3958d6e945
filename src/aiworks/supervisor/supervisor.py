"""``aiworks up``: start the suite as local processes, wait until it is ready, stop it cleanly.

Each service is its own OS process whose command line names it
(``python -m aiworks runtime --replica-id runtime-0 ...``), writing its log to
a file of its own. Children run in their own sessions, so a terminal's Ctrl-C
reaches only the supervisor, which then stops them in order (the monitor
first, so it does not restart what is being stopped; then gateway to
scheduler). Children also get PR_SET_PDEATHSIG, so even a SIGKILLed
supervisor leaves no orphans.

The supervisor keeps a registry of its children (kind, pid, addresses,
metrics port, replica id) and serves it on a local control API
(:mod:`aiworks.supervisor.control`). It never restarts a child by itself:
deciding that is the monitor's job, which it does through that API (restart
one child, scale the runtimes); the supervisor carries it out and notices it.

PR_SET_PDEATHSIG fires when the *thread* that forked a child ends, not the
process. Children are therefore forked by one long-lived spawner thread, so a
child started on behalf of a control API request (served on a short-lived
thread) does not die with that thread.

Every internal service checks who calls it (:mod:`aiworks.security.callers`).
On start the supervisor makes the installation's secret, ``.aiworks/internal-token``
(mode 0600, next to the log folder; reused when it exists), and hands each
child its *path* as ``AIWORKS_<SVC>_INTERNAL_TOKEN_FILE``, never the secret:
over plaintext loopback each child proves its name with a token derived from
it, and the control API and the CLI tools (as ``admin``) use it too. Secrets
(the token, a Redis URL's password) reach children through files and the
environment only, never their command lines, which ``ps`` shows to everyone.

With ``tls`` the suite runs with mutual TLS inside and TLS on the gateway's
ports: the supervisor writes a CA and one certificate per service (and one
for itself and one for the operator's tools, ``admin``) with
:func:`~aiworks.security.certs.write_certificates`, hands each child its files
as ``AIWORKS_<SVC>_TLS_CERT/_KEY/_CA``, and runs its own health checks over
TLS with its certificate.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from aiworks import PROTOBUF_IMPLEMENTATION_AT_START
from aiworks.core.errors import AIWorksError, NotFound, Status
from aiworks.core.lifecycle import orphan_proof, terminate
from aiworks.core.logging import redact_url
from aiworks.core.rpc import blocking_channel
from aiworks.scheduler.client import BlockingSchedulerClient
from aiworks.security.callers import CallerAuth, ClientCaller, ensure_secret_file, is_loopback, read_secrets
from aiworks.security.cert_watch import certificate_watch
from aiworks.security.certs import CA_CERT, DEFAULT_HOSTNAMES, TLS_CERT, TLS_KEY, write_certificates, write_private_file
from aiworks.security.tls import TLSFiles, client_ssl_context
from aiworks.supervisor.control import DEFAULT_MAX_REPLICAS, ControlServer

PROTOBUF_ENV = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"
# In the state folder (.aiworks): the Redis URL of a suite started with the tiers (``aiworks status`` reads it).
TIERS_REDIS_URL_FILE = "tiers-redis-url"


def local_tiers_redis_url(folder: Path = Path(".aiworks")) -> str | None:
    """The tiers' Redis URL that ``aiworks up --tiers`` run from this folder left; None without one."""
    path = folder / TIERS_REDIS_URL_FILE
    return (path.read_text().strip() or None) if path.is_file() else None


log = logging.getLogger(__name__)

# glibc malloc settings for the processes that move tensors (docs/benchmarks.md, "System shared memory
# against binary HTTP"): blocks up to 32 MiB come from the heap, and freed memory stays with the process
# instead of going back to the kernel, so a tensor-sized buffer is not page-faulted in afresh on every
# request. The price: a process keeps its high-water mark of memory (up to 1 GiB of it free for reuse).
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_TOP_PAD_": str(64 << 20),
}

_GRPC_HOLD: grpc.Channel | None = None

STOP_TIMEOUT_S = 10.0

# Services that get a certificate of their own under SuiteConfig.tls; "supervisor" (its health checks) and
# "admin" (aiworks status, traffic, events) are clients only.
TLS_SERVICES = ("gateway", "scheduler", "runtime", "cache", "monitor")
TLS_CLIENTS = ("supervisor", "admin")


def _hold_grpc_initialized() -> None:
    """Keep one gRPC channel open for the rest of this process.

    Closing the last channel makes gRPC shut down on a thread of its own, and
    a fork during that shutdown (each child is forked) hangs forever in gRPC's
    pre-fork handler; it showed once the cache's readiness check was added
    right before the gateway's fork. With a channel always open, gRPC never
    shuts down. The channel is never used.
    """
    global _GRPC_HOLD
    if _GRPC_HOLD is None:
        _GRPC_HOLD = grpc.insecure_channel("127.0.0.1:9")


_HANDED_OUT: set[int] = set()  # ports free_port gave this process: never twice
_PORT_DRAW = random.Random()


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' ports, and bind(0)'s)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a service started in a moment.

    Drawn below the kernel's ephemeral range: the kernel gives ports from that range to outgoing connections,
    so a port chosen there (as bind(0) chooses) can be taken by any connection the suite makes before the
    service binds it, and the service then fails to start ("Failed to bind"). Never one this process handed out
    before, so services started together do not draw the same one. The kernel's choice only when none is free.
    """
    top = _ephemeral_start()
    bottom = max(1024, top - 12000)
    for _ in range(100 if top > bottom else 0):
        port = _PORT_DRAW.randint(bottom, top - 1)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class SuiteConfig:
    """What ``aiworks up`` starts, and where."""

    model_repository: Path = Path("model-repository")
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    scheduler_port: int = 8010
    runtime_base_port: int = 8020
    replicas: int = 2
    batching: bool = True
    log_dir: Path = Path(".aiworks/logs")
    log_level: str = "INFO"
    ready_timeout_s: float = 120.0
    extra_env: dict[str, str] = field(default_factory=dict)
    # The result cache (docs/cache.md): started unless cache is False, with the
    # in-process store, or Redis when redis_url is given; cache_port 0 picks a free one.
    cache: bool = True
    redis_url: str | None = None
    cache_port: int = 0
    # Metrics endpoints: gateway base, scheduler base+1, cache base+2, runtime-i base+10+i;
    # 0 gives every child a free port. Supervisor.metrics_targets() lists them.
    metrics_base_port: int = 8100
    # The monitor (docs/monitor.md): restarts, autoscaling between replicas and
    # max_replicas, ejection; its events API and /metrics on monitor_port.
    monitor: bool = True
    monitor_port: int = 8040
    max_replicas: int = 4
    # The supervisor's control API on 127.0.0.1 (the monitor acts through it); 0 picks a free port.
    control_port: int = 8050
    # A local Prometheus scraping every metrics endpoint (needs the prometheus binary); 0 picks a free port.
    prometheus: bool = False
    prometheus_port: int = 9090
    # Mutual TLS between the services and TLS on the gateway's HTTP and gRPC ports (docs/security.md).
    # Certificates are written into tls_dir (default <log_dir>/../certs), reusing its CA; a tls_dir given
    # that already holds a certificate for every service is used as it is.
    tls: bool = False
    tls_dir: Path | None = None
    # How often every process checks its certificate files for a renewal (`aiworks certs` run again over
    # tls_dir): new connections take the new certificates without a restart (0: read at start only).
    tls_reload_s: float = 10.0
    # The installation's secret (docs/security.md): created when missing; default <log_dir>/../internal-token.
    token_file: Path | None = None
    # How often the supervisor and every service it starts read the token file again: `aiworks certs
    # --internal-token FILE --rotate-internal-token STEP` is taken without a restart (0: no periodic re-read).
    token_reload_s: float = 10.0
    # Where the scheduler keeps its traffic policies (version weights) across restarts when there is no
    # Redis (with redis_url they live in Redis); default <log_dir>/../scheduler-traffic.json.
    scheduler_state_file: Path | None = None
    # Scheduler replicas (high availability, docs/deployment.md): every runtime registers with all of them,
    # the gateway and the monitor fail over between them. More than one needs redis_url (shared policies).
    schedulers: int = 1
    # Most runtime replicas the control API starts on request (POST /v1/runtime/scale).
    max_scale_replicas: int = DEFAULT_MAX_REPLICAS
    # The nearline and offline tiers (docs/tiers.md): the gateway's Batch API (files under
    # <log_dir>/../batch-files), asynchronous requests and result streams, one batch runner and one
    # nearline worker. Needs redis_url: the jobs, the queue and the streams live there.
    tiers: bool = False

    @classmethod
    def on_free_ports(cls, **fields) -> SuiteConfig:
        """A config whose every port is free on this machine (tests, benchmarks, side-by-side suites).

        No monitor unless asked for (``monitor=True``): a test or benchmark
        wants the suite it set up, not one the monitor rescales under it.
        """
        fields.setdefault("monitor", False)
        return cls(
            http_port=free_port(), grpc_port=free_port(), scheduler_port=0, runtime_base_port=0,
            metrics_base_port=0, monitor_port=0, control_port=0, prometheus_port=0, **fields,
        )  # fmt: skip


# Offsets of each kind's metrics port from SuiteConfig.metrics_base_port.
_METRICS_OFFSET = {"gateway": 0, "scheduler": 1, "cache": 2, "batch": 5, "nearline": 6, "runtime": 10}
_METRICS_ENV = {
    "gateway": "AIWORKS_GATEWAY_METRICS_PORT",
    "scheduler": "AIWORKS_SCHEDULER_METRICS_PORT",
    "cache": "AIWORKS_CACHE_METRICS_PORT",
    "runtime": "AIWORKS_RUNTIME_METRICS_PORT",
    "batch": "AIWORKS_BATCH_METRICS_PORT",
    "nearline": "AIWORKS_NEARLINE_METRICS_PORT",
}


@dataclass
class Child:
    """One supervised process and what the registry knows about it."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    kind: str = ""
    env: dict[str, str] = field(default_factory=dict)
    grpc_address: str | None = None
    metrics_port: int | None = None
    replica_id: str | None = None
    restarts: int = 0
    seq: int = 0  # start order, for "newest first" on scale-in

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def describe(self, host: str) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "pid": self.process.pid if self.process else None,
            "alive": self.alive,
            "exit_code": self.process.returncode if self.process else None,
            "grpc_address": self.grpc_address,
            "metrics_address": f"{host}:{self.metrics_port}" if self.metrics_port else None,
            "replica_id": self.replica_id,
            "restarts": self.restarts,
            "log_path": str(self.log_path),
        }


class Supervisor:
    """Starts, registers, watches and stops the suite's processes."""

    def __init__(self, config: SuiteConfig):
        _hold_grpc_initialized()
        self.config = config
        self.children: list[Child] = []
        self._retiring: list[Child] = []  # runtimes scaled in, draining after SIGTERM
        self._lock = threading.RLock()
        self._seq = 0
        self._stopping = False
        self._stopped = False
        self._stop_requested = threading.Event()
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiworks-spawner")
        # Addresses others dial: a wildcard bind is reached on loopback.
        self.reach_host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
        if config.scheduler_port == 0:
            config.scheduler_port = free_port(config.host)
        self.scheduler_address = f"{self.reach_host}:{config.scheduler_port}"
        if config.schedulers < 1:
            raise ValueError("schedulers must be 1 or more")
        if config.schedulers > 1 and not config.redis_url:
            raise ValueError("more than one scheduler needs redis_url: they share their traffic policies there")
        # Every scheduler; the first is the one the supervisor asks. Runtimes, gateway and monitor get them all.
        self.scheduler_addresses = [self.scheduler_address] + [
            f"{self.reach_host}:{free_port(config.host)}" for _ in range(config.schedulers - 1)
        ]
        self.scheduler_targets = ",".join(self.scheduler_addresses)
        self.cache_address: str | None = None
        if config.cache:
            if config.cache_port == 0:
                config.cache_port = free_port(config.host)
            self.cache_address = f"{self.reach_host}:{config.cache_port}"
        if config.monitor and config.monitor_port == 0:
            config.monitor_port = free_port(config.host)
        self.control: ControlServer | None = None
        self.prometheus = None  # aiworks.supervisor.prometheus.PrometheusProcess when config.prometheus
        # Where the certificates live with config.tls, and the supervisor's own (set by start()).
        self.tls_dir: Path | None = None
        if config.tls:
            self.tls_dir = Path(config.tls_dir or config.log_dir.parent / "certs").resolve()
        self.client_tls: TLSFiles | None = None
        self._http_context: ssl.SSLContext | None = None
        self.token_file = Path(config.token_file or config.log_dir.parent / "internal-token").resolve()
        self._secret: list[bytes] | None = None  # the token file's ring, read by start()
        self._token_watch_stop = threading.Event()
        # With the tiers: the key the gateway seals callers' credentials under, which the runner and worker read.
        self.credential_key_file = (config.log_dir.parent / "credential-key").resolve()
        self.caller: ClientCaller | None = None  # the supervisor's own identity on plaintext channels

    # ---- registry --------------------------------------------------------------------------

    @property
    def http_url(self) -> str:
        """The gateway's HTTP base URL (https with TLS)."""
        return f"{'https' if self.tls_dir else 'http'}://{self.reach_host}:{self.config.http_port}"

    @property
    def monitor_url(self) -> str | None:
        return f"http://{self.reach_host}:{self.config.monitor_port}" if self.config.monitor else None

    @property
    def control_url(self) -> str | None:
        return self.control.url if self.control else None

    def child(self, name: str) -> Child:
        with self._lock:
            for c in self.children:
                if c.name == name:
                    return c
        raise NotFound(f"no service named {name!r}; see GET /v1/services")

    def runtimes(self) -> list[Child]:
        with self._lock:
            return [c for c in self.children if c.kind == "runtime"]

    def describe(self) -> dict[str, Any]:
        """The registry, as the control API's ``GET /v1/services`` returns it."""
        with self._lock:
            return {
                "services": [c.describe(self.reach_host) for c in self.children],
                "runtime_replicas": len(self.runtimes()),
                "scheduler_address": self.scheduler_address,
                "caller_auth": self.caller_auth,
                "stopping": self._stopping,
            }

    @property
    def caller_auth(self) -> str:
        """How the internal services check their callers, in words (the banner, ``GET /v1/services``)."""
        insecure = [k for k, v in self.config.extra_env.items() if k.endswith("_INSECURE") and v.lower() == "true"]
        if insecure:
            return f"INSECURE ({', '.join(sorted(insecure))}): callers unchecked"
        return "mutual TLS (certificates)" if self.tls_dir else f"token ({self.token_file})"

    # ---- identities for code that calls the services it started (tests, benchmarks, tools) --------

    def client_caller(self, name: str = "admin") -> ClientCaller:
        """``name``'s token-mode identity (its token from the installation's secret); after :meth:`start`."""
        if self._secret is None:
            raise RuntimeError("the supervisor has not started: no secret yet")
        return ClientCaller.from_file(name, self.token_file)  # the file as it is now: a rotation may have moved it

    def client_tls_for(self, name: str = "admin") -> TLSFiles | None:
        """``name``'s certificate folder under ``tls`` (``None`` without TLS)."""
        return TLSFiles.from_dir(self.tls_dir / name, self.config.tls_reload_s) if self.tls_dir else None

    def caller_channel(self, address: str, service: str, caller: str = "admin") -> grpc.Channel:
        """A blocking channel to one of the suite's internal services, calling as ``caller``."""
        return blocking_channel(
            address, self.client_tls_for(caller), server_name=service, caller=self.client_caller(caller)
        )

    def caller_env(self, kind: str) -> dict[str, str]:
        """The environment a service of ``kind`` started by hand needs to join the suite (token file, TLS)."""
        prefix = f"AIWORKS_{kind.upper()}_"
        return {f"{prefix}INTERNAL_TOKEN_FILE": str(self.token_file),
                f"{prefix}INTERNAL_TOKEN_RELOAD_S": str(self.config.token_reload_s), **self._tls_env(kind)}  # fmt: skip

    def metrics_targets(self) -> dict[str, list[str]]:
        """Service kind -> ``host:port`` of each child's metrics endpoint (the monitor's is its HTTP port)."""
        targets: dict[str, list[str]] = {}
        with self._lock:
            for c in self.children:
                if c.metrics_port:
                    targets.setdefault(c.kind, []).append(f"{self.reach_host}:{c.metrics_port}")
        return targets

    def _targets_changed(self) -> None:
        """Tell a running local Prometheus about replicas started or stopped after it."""
        if self.prometheus is None:
            return
        try:
            self.prometheus.set_targets(self.metrics_targets())
        except Exception as exc:  # dashboards miss a replica; the suite itself is fine
            log.warning("could not update Prometheus' targets: %s", exc)

    # ---- start -----------------------------------------------------------------------------

    def _metrics_port(self, kind: str, index: int = 0) -> int:
        base = self.config.metrics_base_port
        return base + _METRICS_OFFSET[kind] + index if base else free_port(self.config.host)

    def _prepare_certificates(self) -> None:
        """Write the CA and certificates into tls_dir (or take the ones a given tls_dir holds)."""
        folder = self.tls_dir
        assert folder is not None
        given = self.config.tls_dir is not None and all(
            (folder / svc / name).is_file() for svc in TLS_SERVICES for name in (TLS_CERT, TLS_KEY, CA_CERT)
        )
        if not given:
            hosts = [*DEFAULT_HOSTNAMES, self.reach_host]
            if self.config.host not in ("0.0.0.0", "::", ""):
                hosts.append(self.config.host)
            try:
                write_certificates(folder, list(dict.fromkeys(hosts)), (*TLS_SERVICES, *TLS_CLIENTS))
            except AIWorksError as exc:  # a CA certificate without its key, say
                raise RuntimeError(f"cannot write TLS certificates into {folder}: {exc}") from None
            log.info("certificates for mutual TLS in %s (CA %s)", folder, folder / CA_CERT)
        # A folder from `aiworks certs --services ...` alone has no supervisor/: use its top-level certificate.
        own = folder / "supervisor"
        self.client_tls = TLSFiles.from_dir(own if (own / TLS_CERT).is_file() else folder, self.config.tls_reload_s)
        self._http_context = client_ssl_context(self.client_tls)
        self._http_context_of = certificate_watch(self.client_tls).generation

    def _tls_env(self, kind: str) -> dict[str, str]:
        if self.tls_dir is None or kind not in TLS_SERVICES:
            return {}
        folder, prefix = self.tls_dir / kind, f"AIWORKS_{kind.upper()}_TLS_"
        return {
            f"{prefix}CERT": str(folder / TLS_CERT),
            f"{prefix}KEY": str(folder / TLS_KEY),
            f"{prefix}CA": str(folder / CA_CERT),
            f"{prefix}RELOAD_S": str(self.config.tls_reload_s),
        }

    def _launch(self, child: Child) -> None:
        """Fork ``child`` (on the spawner thread: see the module docstring)."""
        env = {**os.environ, **self.config.extra_env, **child.env, "PYTHONUNBUFFERED": "1"}
        if not {PROTOBUF_ENV} & {*self.config.extra_env, *child.env}:  # not what an import of ours left behind
            env.pop(PROTOBUF_ENV, None)
            if PROTOBUF_IMPLEMENTATION_AT_START is not None:
                env[PROTOBUF_ENV] = PROTOBUF_IMPLEMENTATION_AT_START
        with open(child.log_path, "ab") as logfile:
            child.process = subprocess.Popen(
                orphan_proof(child.argv),
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        log.info("started %s (pid %d), log %s", child.name, child.process.pid, child.log_path)

    def _spawn(self, name: str, kind: str, args: list[str], env: dict[str, str] | None = None, **registry) -> Child:
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**self.caller_env(kind), **(env or {})}
        if kind in ("gateway", "runtime"):  # the ones that move tensors; the operator's own values win
            env.update({k: v for k, v in MALLOC_ENV.items() if k not in os.environ and k not in self.config.extra_env})
        metrics_port = registry.pop("metrics_port", None)
        index = registry.pop("metrics_index", 0)
        if kind in _METRICS_ENV:  # the monitor serves its metrics on its own HTTP port
            if metrics_port is None:
                metrics_port = self._metrics_port(kind, index)
            env[_METRICS_ENV[kind]] = str(metrics_port)
        with self._lock:
            self._seq += 1
            child = Child(
                name, [sys.executable, "-m", "aiworks", *args], self.config.log_dir / f"{name}.log",
                kind=kind, env=env, metrics_port=metrics_port, seq=self._seq, **registry,
            )  # fmt: skip
            self._spawner.submit(self._launch, child).result()
            self.children.append(child)
        self._targets_changed()
        return child

    def _runtime_index(self) -> int:
        taken = {c.name for c in self.children} | {c.name for c in self._retiring}
        i = 0
        while f"runtime-{i}" in taken:
            i += 1
        return i

    def start_runtime(
        self,
        replica_id: str | None = None,
        *,
        model_repository: Path | None = None,
        models: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Child:
        """Start one more runtime replica (the next free ``runtime-<i>`` unless named); does not wait.

        The same arguments as the replicas ``start`` began with, unless a
        model repository or model list of its own is given.
        """
        c = self.config
        with self._lock:
            index = self._runtime_index()
            name = replica_id or f"runtime-{index}"
            if any(other.name == name for other in (*self.children, *self._retiring)):
                raise AIWorksError(f"a service named {name!r} exists already", Status.ALREADY_EXISTS)
            port = c.runtime_base_port + index if c.runtime_base_port and replica_id is None else 0
            args = [
                "runtime",
                "--replica-id", name,
                "--host", c.host,
                "--port", str(port),
                "--scheduler-address", self.scheduler_targets,
                "--model-repository", str(model_repository or c.model_repository),
                "--log-level", c.log_level,
            ]  # fmt: skip
            if models:
                args += ["--models", *models]
            if not c.batching:
                args.append("--no-batching")
            # runtime-<i> gets its fixed metrics port; a replica named by the caller a free one, so it
            # never takes the port of a runtime-<i> started later.
            metrics = {"metrics_index": index} if replica_id is None else {"metrics_port": free_port(c.host)}
            return self._spawn(
                name, "runtime", args, env,
                grpc_address=f"{self.reach_host}:{port}" if port else None, replica_id=name, **metrics,
            )  # fmt: skip

    def start(self) -> None:
        c = self.config
        level = ["--log-level", c.log_level]
        if not is_loopback(c.host) and self.tls_dir is None:
            raise RuntimeError(
                f"the internal services refuse plaintext on {c.host}, beyond loopback, where anyone on the network "
                "could call them: add --tls (mutual TLS between them), or bind 127.0.0.1"
            )
        if c.tiers and not c.redis_url:
            raise RuntimeError("the tiers keep their jobs, queue and streams in Redis: give --redis-url with --tiers")
        if self.tls_dir is not None:
            self._prepare_certificates()
        try:
            ensure_secret_file(self.token_file)
            self._secret = read_secrets(self.token_file)
        except (AIWorksError, OSError) as exc:
            raise RuntimeError(f"cannot make the internal token file {self.token_file}: {exc}") from None
        if c.tiers:
            try:
                ensure_secret_file(self.credential_key_file)
            except (AIWorksError, OSError) as exc:
                raise RuntimeError(f"cannot make the credential key file {self.credential_key_file}: {exc}") from None
        self._note_tiers_redis_url(c.redis_url if c.tiers else None)
        self.caller = self.client_caller("supervisor")
        auth = CallerAuth(secret=self._secret)
        self.control = ControlServer(self, "127.0.0.1", c.control_port, auth=auth, max_replicas=c.max_scale_replicas)
        self.control.start()
        self._watch_token(auth)
        # Traffic policies outlive a scheduler restart: in Redis when there is one, else in a state file.
        state_file = Path(c.scheduler_state_file or c.log_dir.parent / "scheduler-traffic.json").resolve()
        scheduler_env = {"AIWORKS_SCHEDULER_STATE_FILE": str(state_file)}
        if c.redis_url:
            scheduler_env["AIWORKS_SCHEDULER_REDIS_URL"] = c.redis_url
        for i, address in enumerate(self.scheduler_addresses):
            port = address.rsplit(":", 1)[1]
            scheduler = ["scheduler", "--host", c.host, "--port", port, *level]
            extra = {} if i == 0 else {"metrics_port": free_port(c.host)}
            self._spawn("scheduler" if i == 0 else f"scheduler-{i}", "scheduler", scheduler, env=scheduler_env,
                        grpc_address=address, **extra)  # fmt: skip
        if self.cache_address:  # starts alongside the scheduler; the gateway needs it
            cache = ["cache", "--host", c.host, "--port", str(c.cache_port), *level]
            # The URL may hold a password: the environment, never argv (ps shows argv to every user).
            secret_env = {"AIWORKS_CACHE_REDIS_URL": c.redis_url} if c.redis_url else {}
            self._spawn("cache", "cache", cache, env=secret_env, grpc_address=self.cache_address)
            if c.redis_url:
                log.info("cache store: Redis at %s", redact_url(c.redis_url))
        for address in self.scheduler_addresses:
            self._wait(lambda a=address: self._grpc_serving(a, "scheduler"), f"scheduler {address}")
        for _ in range(c.replicas):
            self.start_runtime()
        self._wait(lambda: self._live_replicas() >= c.replicas, f"{c.replicas} runtime replica(s)")
        gateway_env = {}
        if self.cache_address:
            self._wait(lambda: self._grpc_serving(self.cache_address, "cache"), "cache")
            gateway_env["AIWORKS_GATEWAY_CACHE_ADDRESS"] = self.cache_address
        if c.tiers:
            gateway_env.update({
                "AIWORKS_GATEWAY_REDIS_URL": c.redis_url,  # the environment, never argv: it may hold a password
                "AIWORKS_GATEWAY_BATCH_FILES_URL": str(self.batch_files),
                "AIWORKS_GATEWAY_ASYNC_REQUESTS": "true",
                "AIWORKS_GATEWAY_RESULT_STREAMS": "true",
                "AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE": str(self.credential_key_file),
            })  # fmt: skip
        self._spawn(
            "gateway", "gateway",
            [
                "gateway",
                "--host", c.host,
                "--http-port", str(c.http_port),
                "--grpc-port", str(c.grpc_port),
                "--scheduler-address", self.scheduler_targets,
                *level,
            ],
            env=gateway_env,
            grpc_address=f"{self.reach_host}:{c.grpc_port}",
        )  # fmt: skip
        if c.monitor:
            self._start_monitor()
        self._wait(lambda: self._http_ready(), "gateway")
        if c.monitor:
            self._wait(lambda: self._http_ok(f"{self.monitor_url}/healthz"), "monitor")
        if c.tiers:
            self._start_tiers()
        if c.prometheus:
            self._start_prometheus()

    def _note_tiers_redis_url(self, url: str | None) -> None:
        """Leave the tiers' Redis URL where ``aiworks status`` run from this folder finds it (mode 0600: it may hold
        a password), as the tools find the internal token; a suite without the tiers removes an older one."""
        path = self.config.log_dir.parent / TIERS_REDIS_URL_FILE
        if url is None:
            path.unlink(missing_ok=True)
            return
        write_private_file(path, url.encode() + b"\n")

    @property
    def batch_files(self) -> Path:
        """Where the Batch API keeps uploaded and output files (``tiers``)."""
        return (self.config.log_dir.parent / "batch-files").resolve()

    def _start_tiers(self) -> None:
        """One batch runner and one nearline worker, clients of the gateway's public HTTP API like any caller."""
        c = self.config
        key = str(self.credential_key_file)
        runner_env = {"AIWORKS_BATCH_REDIS_URL": c.redis_url, "AIWORKS_BATCH_GATEWAY_URL": self.http_url,
                      "AIWORKS_BATCH_CREDENTIAL_KEY_FILE": key}  # fmt: skip
        worker_env = {"AIWORKS_NEARLINE_REDIS_URL": c.redis_url, "AIWORKS_NEARLINE_GATEWAY_URL": self.http_url,
                      "AIWORKS_NEARLINE_CREDENTIAL_KEY_FILE": key}  # fmt: skip
        if self.tls_dir is not None:  # the gateway serves HTTPS: they check it against the suite's CA
            runner_env["AIWORKS_BATCH_CA_FILE"] = worker_env["AIWORKS_NEARLINE_CA_FILE"] = str(
                self.tls_dir / "gateway" / CA_CERT
            )
        self._spawn("batch-runner", "batch", ["batch", "runner"], env=runner_env)
        self._spawn("nearline-worker", "nearline", ["nearline", "worker"], env=worker_env)

    def _start_monitor(self) -> None:
        c = self.config
        defaults = {
            "AIWORKS_MONITOR_PLATFORM": "local",
            "AIWORKS_MONITOR_SUPERVISOR_URL": self.control.url,
            "AIWORKS_MONITOR_SCHEDULER_ADDRESS": self.scheduler_address,  # the first: docs/deployment.md
            "AIWORKS_MONITOR_MIN_REPLICAS": str(c.replicas),
            "AIWORKS_MONITOR_MAX_REPLICAS": str(max(c.replicas, c.max_replicas)),
            "AIWORKS_MONITOR_EVENTS_FILE": str(c.log_dir / "monitor-events.jsonl"),
        }
        # The caller's extra_env wins over these defaults (tests shorten cool-downs, for one).
        env = {k: v for k, v in defaults.items() if k not in c.extra_env}
        self._spawn(
            "monitor", "monitor", ["monitor", "--host", c.host, "--port", str(c.monitor_port), "--log-level", c.log_level],
            env=env, metrics_port=c.monitor_port,
        )  # fmt: skip

    def _start_prometheus(self) -> None:
        from aiworks.supervisor.prometheus import PrometheusProcess

        c = self.config
        port = c.prometheus_port or free_port(c.host)
        self.prometheus = PrometheusProcess(
            self.metrics_targets(),
            port,
            data_dir=c.log_dir.parent / "prometheus",
            log_path=c.log_dir / "prometheus.log",
        )
        # Forked on the spawner thread too, so it lives as long as the suite.
        self._spawner.submit(self.prometheus.start).result()

    def _wait(self, check, what: str) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while time.monotonic() < deadline:
            for child in list(self.children):
                if child.process.poll() is not None:
                    tail = child.log_path.read_text(errors="replace").splitlines()[-15:]
                    raise RuntimeError(
                        f"{child.name} exited with code {child.process.returncode} while waiting for {what}; "
                        f"last lines of {child.log_path}:\n" + "\n".join(tail)
                    )
            try:
                if check():
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"timed out after {self.config.ready_timeout_s:.0f} s waiting for {what}")

    def _grpc_serving(self, address: str, service: str) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with blocking_channel(address, self.client_tls, server_name=service, caller=self.caller) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _live_replicas(self) -> int:
        with BlockingSchedulerClient(self.scheduler_address, self.client_tls, self.caller) as scheduler:
            return sum(1 for r in scheduler.status(timeout_s=1).replicas if r.live and r.models)

    def _http_ready(self) -> bool:
        if self.client_tls is not None:
            generation = certificate_watch(self.client_tls).generation
            if generation != self._http_context_of:  # its certificate was renewed: present the new one
                self._http_context, self._http_context_of = client_ssl_context(self.client_tls), generation
        return self._http_ok(f"{self.http_url}/v2/health/ready", self._http_context)

    @staticmethod
    def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
        with urllib.request.urlopen(url, timeout=1, context=context) as resp:
            return resp.status == 200

    # ---- actions (the control API) ---------------------------------------------------------

    def _refuse_while_stopping(self) -> None:
        if self._stopping:
            raise AIWorksError("the suite is stopping", Status.FAILED_PRECONDITION)

    def restart(self, name: str) -> dict[str, Any]:
        """Restart one child with its original command line (stopping it first if it still runs)."""
        self._refuse_while_stopping()
        child = self.child(name)
        old = child.process
        if old is not None and old.poll() is None:
            terminate(old, name, STOP_TIMEOUT_S)  # outside the lock: the registry stays readable while it drains
        with self._lock:
            self._refuse_while_stopping()
            if child.process is not old and child.alive:
                return child.describe(self.reach_host)  # restarted meanwhile by another request
            child.restarts += 1
            self._spawner.submit(self._launch, child).result()
            log.info("restarted %s on request (restart %d, pid %d)", name, child.restarts, child.process.pid)
            return child.describe(self.reach_host)

    def scale_runtimes(self, replicas: int) -> dict[str, Any]:
        """Start or stop runtime replicas until ``replicas`` run; scale-in SIGTERMs the newest (they drain)."""
        self._refuse_while_stopping()
        started, stopped = [], []
        with self._lock:
            self._refuse_while_stopping()
            current = sorted(self.runtimes(), key=lambda c: c.seq)
            for _ in range(replicas - len(current)):
                started.append(self.start_runtime().name)
            for child in reversed(current[replicas:]):
                self.children.remove(child)
                self._retiring.append(child)
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
                stopped.append(child.name)
        if stopped:
            self._targets_changed()
        if started or stopped:
            log.info("runtime replicas scaled to %d (started %s, stopping %s)", replicas, started, stopped)
        return {"replicas": replicas, "started": started, "stopped": stopped}

    def request_stop(self) -> None:
        """Ask :meth:`watch` to return, so the caller stops the suite (``POST /v1/stop``)."""
        self._stop_requested.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    # ---- run and stop ----------------------------------------------------------------------

    def _reap_retiring(self) -> None:
        with self._lock:
            for child in list(self._retiring):
                if child.process.poll() is not None:
                    self._retiring.remove(child)
                    log.info("%s stopped after scale-in (code %s)", child.name, child.process.returncode)

    def watch(self, stop_requested) -> None:
        """Block until ``stop_requested()`` or ``POST /v1/stop``; report exits and restarts of children."""
        seen_pid: dict[str, int] = {}
        reported: set[int] = set()
        while not (stop_requested() or self._stop_requested.is_set()):
            with self._lock:
                children = list(self.children)
            for child in children:
                pid = child.process.pid
                before = seen_pid.get(child.name)
                if before is not None and before != pid:
                    log.info("%s was restarted (pid %d -> %d, restart %d)", child.name, before, pid, child.restarts)
                seen_pid[child.name] = pid
                code = child.process.poll()
                if code is not None and pid not in reported:
                    reported.add(pid)
                    if child.kind == "monitor":
                        watcher = ""
                    elif self.config.monitor:
                        watcher = " (the monitor restarts it)"
                    else:
                        watcher = " (nothing restarts it: the suite runs without the monitor)"
                    if code == 0:  # it was told to stop (a signal from outside) and stopped cleanly: not a crash
                        log.warning("%s stopped (exit code 0), not asked by this supervisor%s; see %s",
                                    child.name, watcher, child.log_path)  # fmt: skip
                    else:
                        log.error("%s exited with code %s%s; see %s", child.name, code, watcher, child.log_path)
            self._reap_retiring()
            time.sleep(0.2)

    def _watch_token(self, auth: CallerAuth) -> None:
        """Keep the control API's accepted tokens and the supervisor's own in step with the token file, on a
        thread of its own (every ``token_reload_s``), as each service it starts does on its event loop."""
        from aiworks.security.keyring import INTERNAL_TOKEN_FILE, KeyFileWatch

        watch = KeyFileWatch(self.token_file, [auth, self.caller], INTERNAL_TOKEN_FILE)
        interval = self.config.token_reload_s
        if interval <= 0:
            return

        def run() -> None:
            while not self._token_watch_stop.wait(interval):
                watch.check()

        threading.Thread(target=run, name="internal-token-watch", daemon=True).start()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the monitor, then the other children in reverse start order (SIGTERM, then SIGKILL)."""
        self._token_watch_stop.set()
        with self._lock:
            if self._stopped:
                return
            self._stopping = self._stopped = True
            children = list(self.children)
            retiring = list(self._retiring)
        order = [c for c in children if c.kind == "monitor"] + [c for c in reversed(children) if c.kind != "monitor"]
        for child in order:
            if child.process and child.process.poll() is None:
                terminate(child.process, child.name, timeout_s)
                log.info("stopped %s", child.name)
        for child in retiring:
            terminate(child.process, child.name, timeout_s)
        self._retiring.clear()
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.control is not None:
            self.control.stop()
        self._spawner.shutdown(wait=True)
