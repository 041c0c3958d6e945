"""`helm test`'s check: the gateway is ready, and every pool's model is ready through the scheduler.

A runtime that loaded nothing never registers a ready model, so its pool's
model stays not ready here and the test fails, naming it.
"""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path


def gateway_ready(url: str, ca_file: Path | None) -> str | None:
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file and url.startswith("https") else None
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v2/health/ready", timeout=3, context=context) as reply:
            return None if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def models_not_ready(scheduler: str, models: Sequence[str], tls_dir: Path | None) -> dict[str, str]:
    import grpc

    from aiworks.scheduler.client import BlockingSchedulerClient
    from aiworks.security.tls import TLSFiles

    tls = TLSFiles.from_dir(tls_dir) if tls_dir else None
    problems = {}
    with BlockingSchedulerClient(scheduler, tls, timeout_s=3) as client:
        for model in models:
            try:
                if not client.model_ready(model):
                    problems[model] = "not ready (no runtime replica has it loaded)"
            except grpc.RpcError as exc:
                problems[model] = f"{exc.code().name}: {exc.details()}"
    return problems


def check(
    gateway: str,
    scheduler: str,
    models: Sequence[str],
    *,
    tls_dir: Path | None = None,
    timeout_s: float = 120.0,
    interval_s: float = 2.0,
    log: Callable[[str], None] = print,
) -> bool:
    """Poll until everything is ready or ``timeout_s`` passes; True when ready."""
    deadline = time.monotonic() + timeout_s
    ca = tls_dir / "ca.crt" if tls_dir else None
    while True:
        # Both, every round: a test that fails names every part that is not ready.
        problems = models_not_ready(scheduler, models, tls_dir)
        if (why := gateway_ready(gateway, ca)) is not None:
            problems["gateway"] = why
        if not problems:
            log(f"ready: gateway {gateway}, models {', '.join(models)}")
            return True
        if time.monotonic() >= deadline:
            for what, why in problems.items():
                log(f"NOT READY: {what}: {why}")
            return False
        log("waiting: " + "; ".join(f"{k}: {v}" for k, v in problems.items()))
        time.sleep(interval_s)
