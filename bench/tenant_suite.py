"""A suite with one tenant and a private redis-server, for the benchmarks of the tiers (bench/tiers.py, bench/streams.py).

:func:`tenant_suite` starts a redis-server on a free port (no persistence,
its files in a temporary folder), writes a tenants file with the tenant
``bench`` allowed ``digits`` and a fresh API key, and starts the suite
(gateway, scheduler, runtime replicas; no cache) with the gateway on that
Redis and the extra environment given. Everything is stopped on the way out,
and the temporary folder removed (kept, and its logs named, after a failure).
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from aiworks.demo.models import build_demo_repository
from aiworks.gateway.auth import generate_api_key
from aiworks.security.callers import ensure_secret_file
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

TENANT = "bench"
CREDENTIAL_KEY = "credential-key"


@dataclass
class TenantSuite:
    work: Path  # the temporary folder: repository, logs, tenants file, redis files
    redis_url: str
    key: str  # the tenant's API key (a bearer token)
    tenants_file: Path
    base: str  # the gateway's HTTP address
    supervisor: Supervisor
    others: dict[str, str] = field(default_factory=dict)  # more tenants (``others=``): id -> API key

    @property
    def credential_key(self) -> Path:
        """The credential key file the gateway seals with: a batch runner or nearline worker needs it too."""
        return self.work / CREDENTIAL_KEY

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def pid(self, name: str) -> int:
        """The process id of one of the suite's services (``gateway``, ``runtime-0`` ...)."""
        return self.supervisor.child(name).process.pid


@contextlib.contextmanager
def tenant_suite(prefix: str, env: dict[str, str] | Callable[[Path], dict[str, str]] | None = None, *, replicas: int = 1,
                 repository: str | None = None, tenant: dict | None = None,
                 others: tuple[str, ...] = ()) -> Iterator[TenantSuite]:  # fmt: skip
    """The running suite.

    ``env``: more environment for the suite's services, or a function of the
    work folder that gives it (for paths in it); ``tenant``: more fields of
    the tenant's entry in the tenants file; ``others``: more tenants (the same
    models, a key each, in :attr:`TenantSuite.others`).
    """
    work = Path(tempfile.mkdtemp(prefix=prefix))
    models = Path(repository) if repository else work / "repository"
    if not repository:
        build_demo_repository(models, progress=lambda m: None)
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(work)], stdout=subprocess.DEVNULL)  # fmt: skip
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    key, digest = generate_api_key()
    tenants = work / "tenants.yaml"
    entry = {"id": TENANT, "models": ["digits"], "api_keys": [digest], **(tenant or {})}
    other_keys = {name: generate_api_key() for name in others}
    more = [{"id": name, "models": ["digits"], "api_keys": [d]} for name, (_, d) in other_keys.items()]
    tenants.write_text(yaml.safe_dump({"tenants": [entry, *more]}))
    ensure_secret_file(work / CREDENTIAL_KEY)  # the tiers' sealed credentials (gateway, runners, workers)
    suite_env = {"AIWORKS_GATEWAY_TENANTS_FILE": str(tenants), "AIWORKS_GATEWAY_REDIS_URL": redis_url,
                 "AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE": str(work / CREDENTIAL_KEY),
                 "AIWORKS_GATEWAY_LIMITS_TIMEOUT_S": "0.5", **((env(work) if callable(env) else env) or {})}  # fmt: skip
    config = SuiteConfig.on_free_ports(model_repository=models, log_dir=work / "logs", replicas=replicas, cache=False,
                                       extra_env=suite_env)  # fmt: skip
    supervisor = Supervisor(config)
    failed = True
    try:
        supervisor.start()
        yield TenantSuite(work, redis_url, key, tenants, f"http://127.0.0.1:{config.http_port}", supervisor,
                          {name: k for name, (k, _) in other_keys.items()})  # fmt: skip
        failed = False
    finally:
        supervisor.stop()
        redis.terminate()
        redis.wait(10)
        if failed:
            print(f"the suite's logs: {work / 'logs'}", file=sys.stderr)
        else:  # a job's input and files can be hundreds of MB
            shutil.rmtree(work, ignore_errors=True)


def quiet_collector() -> None:
    """Keep this process's garbage collector out of the latencies it measures.

    The open loop's latency runs from each request's scheduled arrival, so a
    pause of the load generator counts as the suite's. With the default
    thresholds this process ran a full collection every few seconds, each of
    40-90 ms over the objects of the setup (pyarrow, numpy, the suite's
    handles): the online p99 at half capacity read ~100 ms where the suite's
    was ~15 ms. The objects alive now are frozen out of collection and full
    collections made rare; memory is not a concern for a run of minutes.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 1_000)
