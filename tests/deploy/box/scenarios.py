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
                    if "RESOURCE_EXHAUSTED" in str(exc.status()) or "429" in str(exc):
                        counts["limited"] += 1
                        continue
                    counts["other"] += 1
                    counts.setdefault("first_other", str(exc)[:300])  # the first, not whichever came next

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


def _digits_load(gateway: Gateway, callers: int, duration_s: float, during: Callable[[], None] | None = None,
                 rate: float = 60.0, hosts: list[str] | None = None) -> dict:
    """Closed-loop tritonclient gRPC callers on digits naming no version (each sends its next request once the
    last is answered, at most ``rate`` requests/s in all: under the default tenant's 100/s, so every failure is
    the control plane's), through the gateway Service or, given ``hosts``, those gateway pods. ``during`` runs a
    quarter of the way in. Answers, failures, longest gap, versions."""
    import tritonclient.grpc.aio as grpcclient

    data = np.random.default_rng(1).random((1, 64), dtype=np.float32)
    stats: dict[str, Any] = {"ok": 0, "failed": [], "gap_s": 0.0, "versions": {}}

    async def run() -> None:
        clients = [gateway.grpc_aio(h) for h in hosts] if hosts else [gateway.grpc_aio()]
        last_ok = time.monotonic()
        stop_at = time.monotonic() + duration_s

        async def caller(client) -> None:
            nonlocal last_ok
            next_at = time.monotonic()
            while time.monotonic() < stop_at:
                next_at = max(next_at + callers / rate, time.monotonic() - 1.0)
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                x = grpcclient.InferInput("input", [1, 64], "FP32")
                x.set_data_from_numpy(data)
                try:
                    result = await client.infer("digits", [x], headers=gateway.headers, client_timeout=30)
                except Exception as exc:
                    stats["failed"].append(str(exc)[:200])
                    continue
                now = time.monotonic()
                stats["gap_s"] = max(stats["gap_s"], now - last_ok)
                last_ok = now
                stats["ok"] += 1
                version = result.get_response().model_version
                stats["versions"][version] = stats["versions"].get(version, 0) + 1

        try:
            tasks = [asyncio.create_task(caller(clients[i % len(clients)])) for i in range(callers)]
            if during is not None:
                await asyncio.sleep(duration_s / 4)
                await asyncio.get_running_loop().run_in_executor(None, during)
            await asyncio.gather(*tasks)
        finally:
            for client in clients:
                await client.close()

    started = time.monotonic()
    asyncio.run(run())
    stats["seconds"] = round(time.monotonic() - started, 2)
    stats["gap_s"] = round(stats["gap_s"], 3)
    failed = stats["failed"]
    stats["failed"] = failed[:10] + ([f"... {len(failed)} in all"] if len(failed) > 10 else [])
    stats["failed_count"] = len(failed)
    return stats


def _admin_scheduler(box: Box, pod):
    """A scheduler client to one scheduler pod as the release's admin (its certificate, as `aiworks` CLIs use)."""
    from aiworks.scheduler.client import BlockingSchedulerClient
    from aiworks.security.tls import TLSFiles

    tls = None
    secret = box.api.secret_data(box.namespace, f"{RELEASE}-admin-tls")
    if secret:
        folder = box.workdir / "admin-tls"
        folder.mkdir(exist_ok=True)
        for key in ("tls.crt", "tls.key", "ca.crt"):
            (folder / key).write_bytes(secret[key])
        tls = TLSFiles.from_dir(folder)
    return BlockingSchedulerClient(f"{pod.ip}:8010", tls, timeout_s=10)


def _scheduler_view(box: Box, pod) -> dict:
    """What one scheduler holds: digits' weights and how many live runtime replicas registered with it."""
    try:
        with _admin_scheduler(box, pod) as client:
            weights = dict(client.get_traffic("digits").weights)
            live = sum(1 for r in client.status().replicas if r.live and r.models)
        return {"weights": weights, "live_replicas": live}
    except Exception as exc:  # not up yet
        return {"error": str(exc)[:200]}


def _watched(box: Box, schedulers: list) -> dict[str, str]:
    """Which scheduler pod each gateway pod watches now (the last "watching the routing table" line it logged)."""
    out = {}
    for gateway in box.pods_of("gateway"):
        lines = [line for line in gateway.containers[0].log.read_text().splitlines()
                 if "watching the routing table of scheduler " in line]  # fmt: skip
        if lines:
            host = lines[-1].split("watching the routing table of scheduler ", 1)[1].split(":", 1)[0]
            out[gateway.name] = next((p.name for p in schedulers if host.split(".", 1)[0] == p.name), host)
    return out


def _until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(0.5)


def scheduler_failover_and_canary(box: Box, ctx: dict) -> dict:
    """Two schedulers and digits' canary at the values' weight. The split shows the weight; SIGKILL of the
    scheduler the gateways watch under load loses nothing; its container restarts and holds the weights again
    (from Redis); a weight then set through it is what the gateways route by."""
    gateway = Gateway(box, ctx["values"])
    out: dict[str, Any] = {"ready_after_s": round(time.monotonic() - ctx["t0"] + box.wait_ready(300), 2)}
    out["digits_after_s"] = round(time.monotonic() - ctx["t0"] + wait_for_inference(gateway, "digits", 120), 2)
    schedulers = sorted(box.pods_of("scheduler"), key=lambda p: p.name)
    out["schedulers"] = [p.name for p in schedulers]
    runtimes = len(box.pods_of("runtime"))
    # Every runtime registered with both schedulers before anything is killed.

    def registered() -> list[dict] | None:
        views = [_scheduler_view(box, p) for p in schedulers]
        return views if all(v.get("live_replicas", 0) >= runtimes for v in views) else None

    out["registered"] = _until(registered, 60, "every runtime registered with both schedulers")
    out["split"] = _digits_load(gateway, 4, 6)
    # Each gateway watches one scheduler (the first that answered when it started): kill the one most watch,
    # with the load sent to the gateway pods that watch it, so every request depends on the failover.
    watched = _watched(box, schedulers)
    out["watched_before_kill"] = watched
    names = list(watched.values())
    victim = max(schedulers, key=lambda p: names.count(p.name))
    out["killed"] = victim.name
    watchers = [p for p in box.pods_of("gateway") if watched.get(p.name) == victim.name]
    out["kill_load_through"] = [p.name for p in watchers]
    restarts = victim.containers[0].restarts
    out["kill"] = _digits_load(gateway, 4, 12, during=victim.kill, hosts=[p.ip for p in watchers])
    out["watched_after_kill"] = _watched(box, schedulers)
    _until(lambda: victim.containers[0].restarts > restarts and victim.ready, 90, "the killed scheduler back and ready")
    out["restarts"] = victim.containers[0].restarts - restarts
    out["restarted"] = _until(lambda: (v := _scheduler_view(box, victim)).get("live_replicas", 0) >= runtimes and v,
                              60, "runtimes registered again with the restarted scheduler")  # fmt: skip
    # An operator's weight change, through the restarted scheduler: both agree, and the gateways (now all
    # watching the other one) obey.
    from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb

    stable, canary = (str(v) for v in (ctx["values"]["runtime"]["pools"]["digits"]["stable"]["version"],
                                        ctx["values"]["runtime"]["pools"]["digits"]["canary"]["version"]))  # fmt: skip
    with _admin_scheduler(box, victim) as client:
        client.set_traffic(pb.TrafficPolicy(model="digits", weights={stable: 50, canary: 50}))
    changed = {stable: 50, canary: 50}
    set_at = time.monotonic()
    _until(lambda: all(_scheduler_view(box, p).get("weights") == changed for p in schedulers), 10,
           "both schedulers hold the new weights")  # fmt: skip
    out["changed_on_both_s"] = round(time.monotonic() - set_at, 2)
    time.sleep(2)  # the watched scheduler's routing table reaches the gateways
    out["after_change"] = _digits_load(gateway, 4, 6)
    out["changed_to"] = changed
    return out


def _call(gateway: Gateway, method: str, path: str, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One HTTP call to the gateway's Service, over its TLS when it has one, with the install's key."""
    import http.client

    if gateway.ca_path:
        connection = http.client.HTTPSConnection(gateway.address, 8000, timeout=30, context=gateway.ssl_context())
    else:
        connection = http.client.HTTPConnection(gateway.address, 8000, timeout=30)
    try:
        connection.request(method, path, body=body, headers={**gateway.headers, **(headers or {})})
        reply = connection.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        connection.close()


def tiers_serve(box: Box, ctx: dict) -> dict:
    """batchRunner and nearlineWorker on: an asynchronous request answered by a worker pod as the synchronous call
    is, and a batch job (the Batch API's files on a claim the gateway and runner pods share) run by a runner pod,
    each line's answer the online one; both pods called the gateway as the install's key."""
    gateway = Gateway(box, ctx["values"])
    box.wait_ready(300)
    wait_for_inference(gateway, "iris", 120)
    out: dict[str, Any] = {"ready_after_s": round(time.monotonic() - ctx["t0"], 1)}
    rows = np.random.default_rng(3).random((3, 4), dtype=np.float32).tolist()
    bodies = [{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": row}]} for row in rows]

    def label(answer: bytes) -> list:
        return next(o["data"] for o in json.loads(answer)["outputs"] if o["name"] == "label")

    json_type = {"content-type": "application/json"}
    out["sync"] = [label(_call(gateway, "POST", "/v2/models/iris/infer", json.dumps(b).encode(), json_type)[2])
                   for b in bodies]  # fmt: skip
    status, _, answer = _call(gateway, "POST", "/v2/models/iris/infer", json.dumps(bodies[0]).encode(),
                              {**json_type, "prefer": "respond-async"})  # fmt: skip
    out["async_submit"] = status
    request_id = json.loads(answer)["id"]
    out["async"] = _until(lambda: (lambda r: r if r[0] != 202 else None)(
        _call(gateway, "GET", f"/v2/requests/{request_id}")), 60, "the asynchronous answer")  # fmt: skip
    out["async"] = {"status": out["async"][0], "request_status": out["async"][1].get("aiworks-request-status"),
                    "label": label(out["async"][2]) if out["async"][0] == 200 else out["async"][2].decode()}  # fmt: skip

    lines = "".join(json.dumps({"custom_id": f"row-{i}", **b}) + "\n" for i, b in enumerate(bodies)).encode()
    boundary = "aiworks-box-boundary"
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"rows.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + lines + f"\r\n--{boundary}--\r\n".encode()
    status, _, answer = _call(gateway, "POST", "/v1/files", form,
                              {"content-type": f"multipart/form-data; boundary={boundary}"})  # fmt: skip
    assert status == 200, answer
    job = {"input_file_id": json.loads(answer)["id"], "endpoint": "/v2/models/iris/infer", "completion_window": "24h"}
    status, _, answer = _call(gateway, "POST", "/v1/batches", json.dumps(job).encode(), json_type)
    assert status == 200, answer
    batch_id = json.loads(answer)["id"]

    def finished():
        batch = json.loads(_call(gateway, "GET", f"/v1/batches/{batch_id}")[2])
        return batch if batch["status"] in ("completed", "failed", "cancelled", "expired") else None

    batch = _until(finished, 120, "the batch job")
    out["batch"] = {"status": batch["status"], "counts": batch["request_counts"]}
    if batch.get("output_file_id"):
        output = _call(gateway, "GET", f"/v1/files/{batch['output_file_id']}/content")[2].decode()
        out["batch"]["labels"] = {d["custom_id"]: next(o["data"] for o in d["response"]["outputs"] if o["name"] == "label")
                                  for d in map(json.loads, output.splitlines())}  # fmt: skip
    out["tier_pods"] = {c: [p.ready for p in box.pods_of(c)] for c in ("batch-runner", "nearline-worker")}
    out["files_on_claim"] = sorted(p.name for p in box.claim("batch-files").rglob("*") if p.is_file())
    return out


SCENARIOS: dict[str, Callable[[Box, dict], dict]] = {
    "tiers_serve": tiers_serve,
    "values_install_serves": values_install_serves,
    "default_install_serves": default_install_serves,
    "shared_limits": shared_limits,
    "helm_test_fails_without_model": helm_test_fails_without_model,
    "scheduler_failover_and_canary": scheduler_failover_and_canary,
}
