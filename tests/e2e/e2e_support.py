"""Starting the whole suite as real local processes on free ports, for the e2e tests and their fixtures.

A plain module beside the tests (importable as ``e2e_support``: pytest puts
this folder on sys.path), so test files import it instead of loading
``conftest.py`` by path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aiworks.supervisor.supervisor import SuiteConfig, Supervisor


@dataclass
class Suite:
    supervisor: Supervisor
    http_url: str  # host:port, as tritonclient.http wants it
    grpc_url: str
    model_repository: Path

    @property
    def base(self) -> str:
        return f"http://{self.http_url}"


def start_suite(model_repository: Path, log_dir: Path, **overrides) -> Suite:
    config = SuiteConfig.on_free_ports(
        model_repository=model_repository,
        log_dir=log_dir,
        **overrides,
    )
    supervisor = Supervisor(config)
    try:
        supervisor.start()
    except Exception:
        supervisor.stop()
        raise
    return Suite(supervisor, f"127.0.0.1:{config.http_port}", f"127.0.0.1:{config.grpc_port}", model_repository)
