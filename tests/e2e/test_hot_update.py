"""Hot update: a new version comes in and the old one leaves under load, and no request fails.

The first test keeps clients busy on digits while version 2 is added and
loaded (it becomes the served version, the latest) and version 1 is then
retired by a reload whose version policy no longer selects it: every request
succeeds, and the answers switch from v1's to v2's.

The second test makes batches slow on purpose (the runtimes' test-only delay)
so requests queue, then unloads the model: every request queued before the
unload is answered, one sent during it is refused (503), and a runtime's own
unload waits for the batch it is running.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from e2e_support import internal_channel, start_suite
from tritonclient.utils import InferenceServerException

from aiworks.core.datatypes import Tensor
from aiworks.core.inference import InferRequest
from aiworks.core.options import RequestOptions
from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from aiworks.runtime.client import RuntimeClient


def _digits_rows(n: int) -> np.ndarray:
    from aiworks.demo.models import digits_split

    return digits_split()[1][:n].astype(np.float32)


def _status(suite) -> scheduler_pb2.StatusResponse:
    with internal_channel(suite.supervisor, suite.supervisor.scheduler_address, "scheduler") as channel:
        return scheduler_pb2_grpc.SchedulerServiceStub(channel).Status(scheduler_pb2.StatusRequest(), timeout=5)


def _all_arrived(queues, arrived: int, queued: int) -> bool:
    waiting = sum(q.queued_requests for q in queues)
    return waiting + sum(q.rows for q in queues) >= arrived and waiting >= queued


def test_new_version_in_old_version_out_under_load_fails_nothing(model_repository, tmp_path):
    repo = tmp_path / "repo"
    (repo / "digits").mkdir(parents=True)
    shutil.copytree(model_repository / "digits" / "1", repo / "digits" / "1")
    config = (model_repository / "digits" / "config.pbtxt").read_text()
    assert "version_policy: { all { } }" in config
    (repo / "digits" / "config.pbtxt").write_text(config)
    x = _digits_rows(64)
    expected = {}
    for v in ("1", "2"):
        session = ort.InferenceSession(str(model_repository / "digits" / v / "model.onnx"))
        expected[v] = session.run(["probabilities"], {"input": x})[0]

    suite = start_suite(repo, tmp_path / "logs", replicas=2, cache=False)
    try:
        stop = threading.Event()
        answers: list[tuple[float, str]] = []
        failures: list[str] = []

        def client_loop(seed: int) -> None:
            client = grpcclient.InferenceServerClient(suite.grpc_url)
            i = seed
            try:
                while not stop.is_set():
                    rows = 1 + i % 4
                    start = (i * 7) % (len(x) - rows)
                    inp = grpcclient.InferInput("input", [rows, 64], "FP32")
                    inp.set_data_from_numpy(x[start : start + rows])
                    try:
                        r = client.infer("digits", [inp])
                    except InferenceServerException as exc:
                        failures.append(str(exc))
                    else:
                        version = r.get_response().model_version
                        got = r.as_numpy("probabilities")
                        if not np.allclose(got, expected[version][start : start + rows], rtol=1e-5, atol=1e-6):
                            failures.append(f"v{version} answered rows {start}..{start + rows} wrongly")
                        answers.append((time.monotonic(), version))
                    i += 1
            finally:
                client.close()

        threads = [threading.Thread(target=client_loop, args=(k * 13,)) for k in range(6)]
        for t in threads:
            t.start()
        admin = httpclient.InferenceServerClient(suite.http_url, network_timeout=180)
        try:
            time.sleep(1.5)
            shutil.copytree(model_repository / "digits" / "2", repo / "digits" / "2")
            admin.load_model("digits")  # v1 and v2 loaded; the latest, v2, serves from now on
            loaded_2 = time.monotonic()
            time.sleep(1.5)
            (repo / "digits" / "config.pbtxt").write_text(
                config.replace("version_policy: { all { } }", "version_policy: { specific { versions: [ 2 ] } }")
            )
            admin.load_model("digits")  # v1 retires: drained, then freed by the runtimes
            retired_1 = time.monotonic()
            time.sleep(3.0)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        meta = admin.get_model_metadata("digits")
        admin.close()

        assert not failures, failures[:5]
        assert len(answers) > 100
        assert {v for t, v in answers if t < loaded_2 - 0.5} == {"1"}
        assert {v for t, v in answers if t > loaded_2 + 0.5} == {"2"}  # answers switched to the new version
        assert any(t > retired_1 + 1.0 for t, _ in answers)  # load went on after the retirement
        assert meta["versions"] == ["2"]

        deadline = time.monotonic() + 15
        while True:  # the retired version's queue is closed once drained
            queues = {(q.model, q.version): q for q in _status(suite).queues}
            if ("digits", "1") not in queues:
                break
            assert time.monotonic() < deadline, queues[("digits", "1")]
            time.sleep(0.2)
        logs = "".join(c.log_path.read_text() for c in suite.supervisor.runtimes())
        assert "retiring digits version 1" in logs
    finally:
        suite.supervisor.stop()


def test_unload_answers_every_queued_request_first(model_repository, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(model_repository / "iris", repo / "iris")
    suite = start_suite(
        repo,
        tmp_path / "logs",
        replicas=2,
        cache=False,
        batching=False,
        extra_env={"AIWORKS_RUNTIME_DEBUG_DELAY_MS": "300"},
    )
    try:
        x = np.array([[5.1, 3.5, 1.4, 0.2]], dtype=np.float32)

        def infer(_):
            client = httpclient.InferenceServerClient(suite.http_url, network_timeout=60)
            try:
                inp = httpclient.InferInput("input", [1, 4], "FP32")
                inp.set_data_from_numpy(x)
                return int(client.infer("iris", [inp]).as_numpy("label").reshape(-1)[0])
            finally:
                client.close()

        with ThreadPoolExecutor(16) as pool:
            queued = [pool.submit(infer, i) for i in range(16)]
            deadline = time.monotonic() + 10
            # All 16 reached the runtimes: 2 replicas run 2 at a time (300 ms each), the rest are queued
            # or done (rows), and at least 8 still queued.
            while not _all_arrived(_status(suite).queues, 16 - 2, 8):
                assert time.monotonic() < deadline, "requests never queued"
                time.sleep(0.02)

            def unload():
                client = httpclient.InferenceServerClient(suite.http_url, network_timeout=60)
                try:
                    client.unload_model("iris")
                finally:
                    client.close()

            with ThreadPoolExecutor(1) as side:
                unloading = side.submit(unload)
                time.sleep(0.1)
                with pytest.raises(InferenceServerException) as refused:  # no new requests while it drains
                    infer(None)
                assert not unloading.done()  # still draining the queue
                unloading.result(timeout=60)
            answers = [f.result(timeout=60) for f in queued]
        assert answers == [0] * 16  # every request queued before the unload was answered
        assert "503" in str(refused.value) or "unloaded" in str(refused.value)
        admin = httpclient.InferenceServerClient(suite.http_url, network_timeout=60)
        assert not admin.is_model_ready("iris")

        # A runtime's own unload waits for the batch it is running (300 ms here).
        admin.load_model("iris")
        address = _status(suite).replicas[0].address

        async def unload_while_running() -> tuple[int, float]:
            sup = suite.supervisor
            gateway = RuntimeClient(address, 1 << 26, 10.0, sup.client_tls_for("gateway"), caller=sup.client_caller("gateway"))
            admin_client = RuntimeClient(address, 1 << 26, 10.0, sup.client_tls_for("admin"), caller=sup.client_caller("admin"))
            try:
                request = InferRequest("iris", "1", [Tensor("input", "FP32", (1, 4), x.tobytes())])
                running = asyncio.ensure_future(gateway.infer(request, RequestOptions()))
                await asyncio.sleep(0.15)
                started = time.monotonic()
                await admin_client.unload("iris")
                waited = time.monotonic() - started
                return len((await running).outputs), waited
            finally:
                await gateway.close()
                await admin_client.close()

        outputs, waited = asyncio.run(unload_while_running())
        assert outputs == 2  # the request in its batch finished, not cut off
        assert waited >= 0.05
        admin.close()
    finally:
        suite.supervisor.stop()
