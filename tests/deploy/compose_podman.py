"""Bring docker-compose.yml up with podman, in a network namespace of its own, and send inferences.

Run by tests/deploy/test_images.py as ``unshare --net python -m deploy.compose_podman PLAN RESULT``
(PYTHONPATH=tests): containers use host networking (the facts of these machines), and the host is this
private namespace, so their ports never meet anyone else's. Writes the results as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import yaml


def sh(*command: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


ONE_SHOT = ("certs", "models", "gateway-ca")


def failed_containers(project: str) -> list[str]:
    """Containers of the project that have exited with an error (one-shot jobs may exit 0)."""
    ps = sh("podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
            "--format", "{{.Names}}\t{{.Status}}", check=False)  # fmt: skip
    failed = []
    for line in ps.stdout.splitlines():
        name, _, status = line.partition("\t")
        exited_ok = status.startswith("Exited (0)") and any(f"_{job}_" in name for job in ONE_SHOT)
        if status.startswith("Exited") and not exited_ok:
            failed.append(name)
    return failed


def state(project: str, service: str) -> tuple[str, int]:
    """A service's container's status ("created", "running", "exited", ...) and exit code."""
    found = sh("podman", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", f"{project}_{service}_1",
               check=False).stdout.split()  # fmt: skip
    return (found[0], int(found[1])) if len(found) == 2 else ("missing", -1)


def holds(project: str, service: str, condition: str) -> bool:
    status, code = state(project, service)
    if condition == "service_completed_successfully":
        return status == "exited" and code == 0
    return status == "running"


def up(base: list[str], project: str, compose: str, timeout_s: float) -> None:
    """Create the containers with podman-compose, then start each once its dependencies' conditions hold.

    Not `podman-compose up -d`: it gives each container podman's `--requires` on its dependencies, and podman
    starts a container's required ones with it. A one-shot job (certs, models) then runs again at each
    dependent's start, and when it has finished before podman checks it, the dependent is not started ("the
    following dependencies ... are not running"; CI saw the cache left so, with no log line). Created with
    --no-deps, the containers carry no such link, and the order is the compose file's: a one-shot dependency has
    exited 0, any other is running (its health is not waited for: podman runs healthchecks from systemd timers,
    which these machines lack). Fails fast when a container exits during start-up (a missing module, a bad
    setting), rather than waiting for the timeout."""
    sh(*base, "up", "--no-build", "--no-start", "--no-deps")
    services = yaml.safe_load(Path(compose).read_text())["services"]
    pending = {name: spec.get("depends_on", {}) for name, spec in services.items()}
    deadline = time.monotonic() + timeout_s
    while pending:
        failed = failed_containers(project)
        if failed:
            raise RuntimeError(f"exited during start-up: {', '.join(failed)}")
        for name, needs in list(pending.items()):
            if all(dep not in pending and holds(project, dep, c["condition"]) for dep, c in needs.items()):
                sh("podman", "start", f"{project}_{name}_1")
                del pending[name]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not started in {timeout_s:.0f} s: {', '.join(sorted(pending))}")
        time.sleep(1)


def infer(model: str, ca: str) -> dict:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    features = 4 if model == "iris" else 64
    data = np.random.default_rng(1).random((2, features), dtype=np.float32)
    http = httpclient.InferenceServerClient("127.0.0.1:8000", ssl=True, ssl_options={"ca_certs": ca})
    tensor = httpclient.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    over_http = http.infer(model, [tensor]).as_numpy("label").tolist()
    http.close()
    grpc = grpcclient.InferenceServerClient("127.0.0.1:8001", ssl=True, root_certificates=ca)
    tensor = grpcclient.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    over_grpc = grpc.infer(model, [tensor]).as_numpy("label").tolist()
    grpc.close()
    return {"http": over_http, "grpc": over_grpc}


def tiers(ca: str, timeout_s: float) -> dict:
    """The tiers through the gateway's HTTPS, as a client sees them: one asynchronous request answered by the
    nearline worker, and a three-line batch job run by the batch runner (the Batch API's files on their volume)."""
    import requests

    base = "https://localhost:8000"
    rows = np.random.default_rng(2).random((3, 4), dtype=np.float32).tolist()
    requests_ = [{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": row}]} for row in rows]
    session = requests.Session()
    session.verify = ca
    session.trust_env = False  # REQUESTS_CA_BUNDLE (a TLS-inspecting proxy's, on these machines) would replace `ca`
    found: dict = {}
    deadline = time.monotonic() + timeout_s

    def label(answer: dict) -> list:
        return next(o["data"] for o in answer["outputs"] if o["name"] == "label")

    found["sync"] = [label(session.post(f"{base}/v2/models/iris/infer", json=r, timeout=30).json()) for r in requests_]
    queued = session.post(f"{base}/v2/models/iris/infer", json=requests_[0], headers={"prefer": "respond-async"},
                          timeout=30)  # fmt: skip
    found["async_submit"] = queued.status_code
    request_id = queued.json()["id"]
    while True:
        reply = session.get(f"{base}/v2/requests/{request_id}", timeout=30)
        if reply.status_code != 202:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"asynchronous request {request_id} still queued: is the nearline worker up?")
        time.sleep(0.5)
    found["async"] = {"status": reply.status_code, "request_status": reply.headers.get("aiworks-request-status"),
                      "label": label(reply.json()) if reply.status_code == 200 else reply.text}  # fmt: skip

    lines = "".join(json.dumps({"custom_id": f"row-{i}", **r}) + "\n" for i, r in enumerate(requests_))
    upload = session.post(f"{base}/v1/files", data={"purpose": "batch"}, files={"file": ("rows.jsonl", lines)},
                          timeout=30)  # fmt: skip
    assert upload.status_code == 200, upload.text
    batch = session.post(f"{base}/v1/batches", json={"input_file_id": upload.json()["id"], "completion_window": "24h",
                                                    "endpoint": "/v2/models/iris/infer"}, timeout=30)  # fmt: skip
    assert batch.status_code == 200, batch.text
    batch_id = batch.json()["id"]
    while True:
        job = session.get(f"{base}/v1/batches/{batch_id}", timeout=30).json()
        if job["status"] in ("completed", "failed", "cancelled", "expired"):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch job {batch_id} is {job['status']}: is the batch runner up?")
        time.sleep(1)
    found["batch"] = {"status": job["status"], "counts": job["request_counts"]}
    if job.get("output_file_id"):
        output = session.get(f"{base}/v1/files/{job['output_file_id']}/content", timeout=30).text
        found["batch"]["labels"] = {d["custom_id"]: label(d["response"]) for d in map(json.loads, output.splitlines())}
    return found


def main(plan_path: str, result_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    compose, project = plan["compose"], plan["project"]
    base = [plan["podman_compose"], "-p", project, "-f", compose]
    result: dict = {}
    started = time.monotonic()
    try:
        sh("ip", "link", "set", "lo", "up")
        up(base, project, compose, timeout_s=600)
        result["up_s"] = round(time.monotonic() - started, 1)
        mountpoint = sh("podman", "volume", "inspect", f"{project}_certs", "--format", "{{.Mountpoint}}").stdout.strip()
        ca = f"{mountpoint}/gateway/ca.crt"
        deadline = time.monotonic() + plan["timeout_s"]
        last = None
        for model in ("iris", "digits"):
            while True:
                try:
                    result[model] = infer(model, ca)
                    result[f"{model}_s"] = round(time.monotonic() - started, 1)
                    break
                except Exception as exc:  # not up yet
                    last = exc
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{model} never answered: {last}") from None
                    time.sleep(2)
        result["tiers"] = tiers(ca, timeout_s=120)
        result["tiers_s"] = round(time.monotonic() - started, 1)
        ps = sh("podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
                "--format", "{{.Names}} {{.Status}}", check=False)  # fmt: skip
        result["containers"] = ps.stdout.splitlines()
        for name in ("gateway", "cache", "monitor", "batch-runner"):
            probe = sh("podman", "exec", f"{project}_{name}_1", "python", "-c",
                       "import importlib.util as u; print(bool(u.find_spec('onnxruntime')), bool(u.find_spec('torch')))",
                       check=False)  # fmt: skip
            result[f"{name}_heavy"] = probe.stdout.strip()
        # Still up after their work: a role that exited (a bad setting, a missing module) shows here.
        result["tiers_up"] = {name: sh("podman", "inspect", "--format", "{{.State.Status}}", f"{project}_{name}_1",
                                       check=False).stdout.strip() for name in ("batch-runner", "nearline-worker")}  # fmt: skip
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["trace"] = traceback.format_exc()[-2000:]
        logs = {}
        ps = sh("podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={project}", "--format", "{{.Names}}",
                check=False)  # fmt: skip
        for name in ps.stdout.split():
            logs[name] = sh("podman", "logs", "--tail", "30", name, check=False).stdout[-2500:]
        result["logs"] = logs
    finally:
        sh(*base, "down", "-v", timeout=300, check=False)
        result["total_s"] = round(time.monotonic() - started, 1)
        Path(result_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
