"""What the box checks, each a function of an installed ``Box`` returning figures and findings as JSON.

Clients are the real ones (tritonclient over HTTP and gRPC, with the
release's CA), pointed at the Services' virtual IPs or at pod IPs, as a
client inside the cluster would be. To add one: write ``def name(box, ctx)``
and list it in ``SCENARIOS``; ``ctx`` holds the rendered values and timings.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np

from .cluster import Box

RELEASE = "aiworks"


class Gateway:
    """How a client inside the cluster reaches the gateway: scheme, CA, credentials."""

    def __init__(self, box: Box, values: dict):
        self.box = box
        self.tls = box.api.secret_data(box.namespace, f"{RELEASE}-gateway-tls")
        self.ca_path = None
        if self.tls:
            self.ca_path = box.workdir / "gateway-ca.crt"
            self.ca_path.write_bytes(self.tls["ca.crt"])
        keys = box.api.secret_data(box.namespace, f"{RELEASE}-api-keys")
        self.api_key = keys["api-key"].decode() if keys and "api-key" in keys else None
        self.token = None
        if values.get("auth", {}).get("mode") == "jwt" and values.get("_jwt_secret"):
            import jwt

            jwt_values = values["auth"]["jwt"]
            claims = {"iss": jwt_values["issuer"], "aud": jwt_values["audience"], "exp": int(time.time()) + 3600,
                      jwt_values["tenantClaim"]: values["config"]["tenants"][0]["name"], "sub": "box-client"}  # fmt: skip
            self.token = jwt.encode(claims, bytes.fromhex(values["_jwt_secret"]), algorithm=jwt_values["algorithms"][0])
        self.address = box.service_address(f"{RELEASE}-gateway")

    @property
    def headers(self) -> dict[str, str]:
        """A fresh dict each time: tritonclient.http adds its own headers to the one it is given."""
        if self.token:
            return {"authorization": f"Bearer {self.token}"}
        return {"x-api-key": self.api_key} if self.api_key else {}

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.ca_path:
            return None
        context = ssl.create_default_context(cafile=str(self.ca_path))
        # Dialled by virtual IP, which the certificate does not name; the chain is still verified.
        context.check_hostname = False
        return context

    def http(self, host: str | None = None):
        import tritonclient.http as httpclient

        url = f"{host or self.address}:8000"
        if not self.ca_path:
            return httpclient.InferenceServerClient(url, network_timeout=30)
        # insecure=True skips only tritonclient's host-name match (the VIP is not in the certificate);
        # the context still verifies the chain against the release's CA.
        return httpclient.InferenceServerClient(url, ssl=True, ssl_context_factory=self.ssl_context, insecure=True,
                                                network_timeout=30)

    def grpc_aio(self, host: str | None = None):
        import tritonclient.grpc.aio as grpcclient

        url = f"{host or self.address}:8001"
        if not self.ca_path:
            return grpcclient.InferenceServerClient(url)
        return grpcclient.InferenceServerClient(
            url, ssl=True, root_certificates=str(self.ca_path),
            channel_args=[("grpc.ssl_target_name_override", f"{RELEASE}-gateway")],
        )  # fmt: skip

    def get_json(self, path: str, host: str | None = None) -> tuple[int, Any]:
        scheme = "https" if self.ca_path else "http"
        request = urllib.request.Request(f"{scheme}://{host or self.address}:8000{path}", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=10, context=self.ssl_context()) as reply:
                return reply.status, json.load(reply)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


def _inputs(model: str):
    import tritonclient.http as httpclient

    features = 64 if model == "digits" else 4
    data = np.random.default_rng(0).random((3, features), dtype=np.float32)
    tensor = httpclient.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return [tensor]


def infer_once(gateway: Gateway, model: str) -> dict:
    client = gateway.http()
    try:
        result = client.infer(model, _inputs(model), headers=gateway.headers)
        return {"label": result.as_numpy("label").tolist(), "probabilities": result.as_numpy("probabilities").shape}
    finally:
        client.close()


def wait_for_inference(gateway: Gateway, model: str, timeout_s: float) -> float:
    """Seconds until ``model`` answers an inference through the gateway's Service."""
    started = time.monotonic()
    last = None
    while time.monotonic() - started < timeout_s:
        try:
            infer_once(gateway, model)
            return time.monotonic() - started
        except Exception as exc:  # not yet: no endpoint, not ready, 503
            last = exc
            time.sleep(0.25)
    raise TimeoutError(f"{model} never answered: {last}\n{gateway.box.describe()}")


# ---- scenarios ----------------------------------------------------------------------------------


def default_install_serves(box: Box, ctx: dict) -> dict:
    """The demo models answer through the gateway with the generated key; `helm test` passes."""
    gateway = Gateway(box, ctx["values"])
    out: dict[str, Any] = {"api_key_generated": bool(gateway.api_key), "tls": bool(gateway.ca_path)}
    out["first_inference_s"] = round(ctx["install_s"] + wait_for_inference(gateway, "iris", 240), 2)
    out["digits_after_s"] = round(time.monotonic() - ctx["t0"] + wait_for_inference(gateway, "digits", 300), 2)
    out["iris"] = infer_once(gateway, "iris")
    # No key: refused, so the default install is closed.
    client = gateway.http()
    try:
        client.infer("iris", _inputs("iris"))
        out["anonymous"] = "admitted"
    except Exception as exc:
        out["anonymous"] = str(exc)[:200]
    finally:
        client.close()
    box.wait_ready(120)
    ok, logs = box.helm_test(200)
    out["helm_test"] = {"passed": ok, "log": logs[-1500:]}
    return out


def shared_limits(box: Box, ctx: dict) -> dict:
    """Two gateway pods, one tenant: together they admit the tenant's rate, not twice it; usage sums both."""
    gateway = Gateway(box, ctx["values"])
    box.wait_ready(300)
    wait_for_inference(gateway, "iris", 120)
    pods = box.pods_of("gateway")
    tenant = next(t for t in ctx["values"]["config"]["tenants"] if t["name"] == "default")
    rate = float(tenant["requestsPerSecond"])
    burst = tenant.get("burst") or int(np.ceil(rate))
    time.sleep(2.5)  # usage reaches Redis once a second: let the inferences so far land first
    status, before = gateway.get_json("/v2/usage", pods[0].ip)
    duration_s = ctx.get("limits_duration_s", 4.0)

    async def hammer() -> tuple[int, int, int, float]:
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.utils import InferenceServerException

        clients = [gateway.grpc_aio(p.ip) for p in pods]
        data = np.zeros((1, 4), dtype=np.float32)
        tensor = grpcclient.InferInput("input", [1, 4], "FP32")
        tensor.set_data_from_numpy(data)
        counts = {"ok": 0, "limited": 0, "other": 0}
        # Concurrency stays under the tenant's maxConcurrentRequests, so only the rate limit refuses;
        # attempts come at three times the rate, so the bucket is never idle.
        per_gateway = max(1, min(8, int(tenant.get("maxConcurrentRequests", 64)) // (2 * len(clients))))
        attempts_per_s = 3 * rate
        first = last = None
        stop_at = time.monotonic() + duration_s

        workers = len(clients) * per_gateway
        pause_s = workers / (attempts_per_s)

        async def worker(client) -> None:
            nonlocal first, last
            while time.monotonic() < stop_at:
                await asyncio.sleep(pause_s * (0.5 + np.random.random()))
                sent = time.monotonic()
                first = first or sent
                try:
                    await client.infer("iris", [tensor], headers=gateway.headers)
                    counts["ok"] += 1
                    last = sent
                except InferenceServerException as exc:
                    counts["limited" if "RESOURCE_EXHAUSTED" in str(exc.status()) or "429" in str(exc) else "other"] += 1
                    if counts["other"] == 1:
                        counts["first_other"] = str(exc)[:300]

        await asyncio.gather(*(worker(c) for c in clients for _ in range(per_gateway)))
        for client in clients:
            await client.close()
        return counts, first, last

    logs_before = {p.name: p.containers[0].log.stat().st_size for p in pods}
    counts, first, last = asyncio.run(hammer())
    # Redis slower than the limits timeout sends a gateway to its local 1/N share for a while (by design);
    # the result says whether that happened, since it changes what "exact" means.
    fallbacks = sum(p.containers[0].log.read_bytes()[logs_before[p.name]:].count(b"enforcing 1/") for p in pods)
    span = last - first
    expected = burst + rate * span
    time.sleep(3)  # usage flushes to Redis every second
    usage = [gateway.get_json("/v2/usage", p.ip) for p in pods]
    return {
        "gateways": len(pods), "rate": rate, "burst": burst, "span_s": round(span, 3), "admitted": counts["ok"],
        "limited": counts["limited"], "other_errors": counts["other"], "first_other": counts.get("first_other"),
        "expected": round(expected, 1), "error_pct": round(100 * (counts["ok"] - expected) / expected, 2),
        "redis_fallbacks": fallbacks, "usage_before": before if status == 200 else None, "usage": [u[1] for u in usage],
    }  # fmt: skip


def helm_test_fails_without_model(box: Box, ctx: dict) -> dict:
    """A runtime whose model did not load is alive but not ready, and `helm test` fails naming the model."""
    box.wait_ready(180, owners=[o for o in box.workloads if "runtime" not in o])
    runtimes = box.pods_of("runtime")
    deadline = time.monotonic() + 60
    while not all(c.started for p in runtimes for c in p.containers):
        assert time.monotonic() < deadline, box.describe()
        time.sleep(0.5)
    time.sleep(12)  # a readiness period or more
    ok, logs = box.helm_test(120)
    return {
        "runtime_running": [p.phase == "Running" and all(c.process.poll() is None for c in p.containers) for p in runtimes],
        "runtime_ready": [p.ready for p in runtimes],
        "helm_test_passed": ok,
        "helm_test_log": logs[-2000:],
        "runtime_log": runtimes[0].logs()[-1500:],
    }


def values_install_serves(box: Box, ctx: dict) -> dict:
    """Any values file: every pool's model answers with the values' credentials; anonymous calls are refused;
    `helm test` passes."""
    values = {**ctx["values"], "_jwt_secret": ctx.get("jwt_secret")}
    box.wait_ready(300)
    gateway = Gateway(box, values)
    out: dict[str, Any] = {"credentials": "jwt" if gateway.token else ("api key" if gateway.api_key else "none")}
    for model in sorted(values["runtime"]["pools"]):
        out[f"{model}_after_s"] = round(time.monotonic() - ctx["t0"] + wait_for_inference(gateway, model, 240), 2)
    client = gateway.http()
    try:
        client.infer(sorted(values["runtime"]["pools"])[0], _inputs("iris"))
        out["anonymous"] = "admitted"
    except Exception as exc:
        out["anonymous"] = str(exc)[:200]
    finally:
        client.close()
    ok, logs = box.helm_test(200)
    out["helm_test"] = {"passed": ok, "log": logs[-1500:]}
    return out


SCENARIOS: dict[str, Callable[[Box, dict], dict]] = {
    "values_install_serves": values_install_serves,
    "default_install_serves": default_install_serves,
    "shared_limits": shared_limits,
    "helm_test_fails_without_model": helm_test_fails_without_model,
}
