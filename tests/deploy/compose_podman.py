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


def up(base: list[str], project: str, timeout_s: float) -> None:
    """`podman-compose up -d`, failing fast: podman-compose waits on a dependency's condition for ever, so a
    service that exits at start (a missing module, a bad setting) would otherwise hold it until the timeout."""
    process = subprocess.Popen([*base, "up", "-d", "--no-build"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while process.poll() is None:
            failed = failed_containers(project)
            if failed:
                raise RuntimeError(f"exited during start-up: {', '.join(failed)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"podman-compose up did not finish in {timeout_s:.0f} s")
            time.sleep(3)
        output = process.stdout.read() if process.stdout else ""
        if process.returncode:
            raise RuntimeError(f"podman-compose up exited {process.returncode}:\n{output[-3000:]}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


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
        up(base, project, timeout_s=600)
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
