"""Shadow traffic through the whole suite: clients see only the primary, the shadow is compared and counted.

Digits version 3 is a byte-for-byte copy of version 1 (an identical shadow);
version 2 is a different model, and the test rows are chosen so that exactly
half of the requests get the same class from v1 and v2.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
from e2e_support import internal_channel, start_suite, tool_env

from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc


@pytest.fixture(scope="module")
def shadow_suite(model_repository, tmp_path_factory):
    root = tmp_path_factory.mktemp("shadow")
    repo = root / "repo"
    shutil.copytree(model_repository / "digits", repo / "digits")
    shutil.copytree(repo / "digits" / "1", repo / "digits" / "3")
    suite = start_suite(repo, root / "logs", replicas=2, cache=False)
    yield suite
    suite.supervisor.stop()


@pytest.fixture(scope="module")
def local(shadow_suite):
    """Each version's answers computed here, with onnxruntime, and rows where v1 and v2 agree or not."""
    from aiworks.demo.models import digits_split

    x_train, x_test, _, _ = digits_split()
    x = np.concatenate([x_test, x_train]).astype(np.float32)
    repo = shadow_suite.model_repository
    answers = {}
    for v in ("1", "2"):
        session = ort.InferenceSession(str(repo / "digits" / v / "model.onnx"))
        label, probabilities = session.run(["label", "probabilities"], {"input": x})
        answers[v] = (label.reshape(-1), probabilities)
    same = np.flatnonzero(answers["1"][0] == answers["2"][0])
    different = np.flatnonzero(answers["1"][0] != answers["2"][0])
    assert len(different) >= 10, "v1 and v2 must disagree on some test rows"
    return x, answers, same, different


def _stub(suite):
    channel = internal_channel(suite.supervisor, suite.supervisor.scheduler_address, "scheduler")
    return channel, scheduler_pb2_grpc.SchedulerServiceStub(channel)


def _traffic(suite, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "aiworks", "traffic", "--scheduler", suite.supervisor.scheduler_address, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=tool_env(suite.supervisor),
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _send(suite, x, rows) -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    """One unversioned request per row, 8 at a time; (model, version, label, probabilities) each."""

    def one(i):
        client = httpclient.InferenceServerClient(suite.http_url)
        try:
            inp = httpclient.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x[i : i + 1])
            r = client.infer("digits", [inp])
            meta = r.get_response()
            return meta["model_name"], meta["model_version"], r.as_numpy("label"), r.as_numpy("probabilities")
        finally:
            client.close()

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, rows))


def _shadow_counts(stub, version: str, compare: str, compared: int, timeout_s: float = 20.0):
    """The shadow's status entry once ``compared`` answers were compared (the shadow finishes after the client)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = stub.Status(scheduler_pb2.StatusRequest(), timeout=5)
        found = [s for s in status.shadows if (s.model, s.shadow_version, s.compare) == ("digits", version, compare)]
        entry = found[0] if found else None
        if entry is not None and entry.compared + entry.errors + entry.dropped >= compared and entry.inflight == 0:
            return entry
        assert time.monotonic() < deadline, f"shadow v{version} counts never settled: {entry}"
        time.sleep(0.1)


def _shadow_rows(suite, version: str) -> int:
    """Rows the runtimes executed for a version (the statistics extension, summed over replicas)."""
    client = httpclient.InferenceServerClient(suite.http_url)
    try:
        stats = client.get_inference_statistics("digits", version)
    finally:
        client.close()
    return sum(int(m.get("inference_count", 0)) for m in stats["model_stats"])


def test_an_identical_shadow_agrees_always_and_clients_see_only_the_primary(shadow_suite, local):
    suite = shadow_suite
    x, answers, same, different = local
    before = _shadow_rows(suite, "3")
    printed = _traffic(suite, "set", "digits", "1=100", "--shadow", "3")
    assert "shadow: v3" in printed

    rows = list(range(40))
    replies = _send(suite, x, rows)
    for i, (model, version, label, probabilities) in zip(rows, replies):
        assert (model, version) == ("digits", "1")
        assert int(label.reshape(-1)[0]) == int(answers["1"][0][i])
        np.testing.assert_allclose(probabilities[0], answers["1"][1][i], rtol=1e-6, atol=1e-7)

    channel, stub = _stub(suite)
    with channel:
        entry = _shadow_counts(stub, "3", "allclose", len(rows))
    assert (entry.mirrored, entry.compared, entry.agreed, entry.errors, entry.dropped) == (40, 40, 40, 0, 0)
    assert entry.agreement == 1.0 and entry.active
    assert _shadow_rows(suite, "3") - before == len(rows)  # the shadow really ran every copy


def test_a_different_shadow_is_counted_by_the_comparison_chosen(shadow_suite, local):
    suite = shadow_suite
    x, answers, same, different = local
    rows = [int(i) for i in np.concatenate([same[:10], different[:10]])]
    channel, stub = _stub(suite)
    with channel:
        # Weights stay 1=100: a shadow change keeps them.
        _traffic(suite, "set", "digits", "--shadow", "2")
        replies = _send(suite, x, rows)
        assert {(m, v) for m, v, _, _ in replies} == {("digits", "1")}
        allclose = _shadow_counts(stub, "2", "allclose", len(rows))

        _traffic(suite, "set", "digits", "--shadow", "2", "--shadow-compare", "argmax")
        replies = _send(suite, x, rows)
        for i, (_, version, label, _) in zip(rows, replies):
            assert version == "1" and int(label.reshape(-1)[0]) == int(answers["1"][0][i])
        argmax = _shadow_counts(stub, "2", "argmax", len(rows))
        policy = stub.GetTrafficPolicy(scheduler_pb2.GetTrafficPolicyRequest(model="digits"), timeout=5)

    # Probabilities of two different models are never within 1e-4; their decisions agree on half the rows.
    assert (allclose.compared, allclose.agreed) == (20, 0)
    assert (argmax.compared, argmax.agreed, argmax.errors) == (20, 10, 0) and argmax.agreement == 0.5
    assert dict(policy.weights) == {"1": 100} and policy.shadow.version == "2"

    shown = _traffic(suite, "show", "digits")
    assert "50.0%" in shown and "argmax" in shown
    [address] = suite.supervisor.metrics_targets()["scheduler"]
    scraped = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    assert 'aiworks_scheduler_shadow_agreed_total{compare="argmax",model="digits",shadow_version="2"} 10.0' in scraped
    assert 'aiworks_scheduler_shadow_agreement_ratio{compare="argmax",model="digits",shadow_version="2"} 0.5' in scraped

    _traffic(suite, "set", "digits", "--no-shadow")
    before = _shadow_rows(suite, "2")
    _send(suite, x, rows[:5])
    assert _shadow_rows(suite, "2") == before  # no shadow, no copies
