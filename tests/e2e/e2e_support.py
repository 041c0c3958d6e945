"""Starting the whole suite as real local processes on free ports, for the e2e tests and their fixtures.

A plain module beside the tests (importable as ``e2e_support``: pytest puts
this folder on sys.path), so test files import it instead of loading
``conftest.py`` by path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from aiworks.core.rpc import client_channel
from aiworks.security.callers import TOKEN_FILE_ENV
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


# ---- calling the internal services: every one checks who calls (docs/security.md) --------------


def internal_channel(supervisor: Supervisor, address: str, service: str, caller: str = "admin") -> grpc.Channel:
    """A blocking channel to the suite's ``service`` at ``address``, calling as ``caller`` (token or certificate)."""
    return supervisor.caller_channel(address, service, caller)


def internal_aio_channel(
    supervisor: Supervisor, address: str, service: str, caller: str = "gateway", max_message_bytes: int = 64 << 20
) -> grpc.aio.Channel:
    """The grpc.aio form of :func:`internal_channel` (the gateway's identity by default: it may call ``Infer``)."""
    return client_channel(
        address,
        max_message_bytes,
        supervisor.client_tls_for(caller),
        server_name=service,
        caller=supervisor.client_caller(caller),
    )


def tool_env(supervisor: Supervisor) -> dict[str, str]:
    """``os.environ`` plus what the CLI tools (``aiworks status``, ``traffic``, ``rollout``) need to act as admin."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_FILE_ENV, "AIWORKS_TLS_DIR")}
    env[TOKEN_FILE_ENV] = str(supervisor.token_file)
    if supervisor.tls_dir:
        env["AIWORKS_TLS_DIR"] = str(supervisor.tls_dir / "admin")
    return env


def bearer(supervisor: Supervisor, caller: str = "admin") -> dict[str, str]:
    """Headers for the supervisor's control API and the monitor's POST routes, as ``caller``."""
    return {"Authorization": supervisor.client_caller(caller).bearer(), "Content-Type": "application/json"}


def repeat_inputs(module, values, delay_ms=0, wait_ms=0):
    """The inputs of Triton's ``repeat_int32`` QA model, as ``module`` (tritonclient.grpc, .http or .grpc.aio)
    builds them: one response per element of ``values``, each ``delay_ms`` after the last."""
    n = len(values)
    tensors = [module.InferInput("IN", [n], "INT32"), module.InferInput("DELAY", [n], "UINT32"),
               module.InferInput("WAIT", [1], "UINT32")]  # fmt: skip
    tensors[0].set_data_from_numpy(np.array(values, dtype=np.int32))
    tensors[1].set_data_from_numpy(np.full(n, delay_ms, dtype=np.uint32))
    tensors[2].set_data_from_numpy(np.array([wait_ms], dtype=np.uint32))
    return tensors
