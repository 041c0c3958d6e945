"""Encrypted, signed and watermarked models served by a real runtime replica, and each way one is refused.

The repository holds copies of the demo ``iris`` model, protected as
docs/security.md tells an operator to (``aiworks model watermark embed``,
``sign``, ``encrypt``), and one copy for each failure: a flipped ciphertext
byte, a foreign data key, a signature of other bytes, no signature while
signatures are required, and another owner's watermark. Three more models keep
their weights in an external data file (``weights.bin``): one signed and
served, one whose weights were overwritten after signing, one whose config
was. The runtime gets its keys from files outside the repository, through its
settings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import requests
from onnx import TensorProto, helper, numpy_helper

from aiworks.security import model_crypto as mc
from aiworks.security import model_keys as mk
from aiworks.security.watermark import watermark_file
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

pytestmark = pytest.mark.slow

OWNER = "acme-ml"
ROWS = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3], [5.9, 3.0, 4.2, 1.5]]
# model -> the reason the runtime refuses it
REFUSED = {
    "iris_tampered": "tampered",
    "iris_wrong_key": "wrong-key",
    "iris_bad_signature": "bad-signature",
    "iris_unsigned": "missing-signature",
    "iris_wrong_owner": "watermark-other-owner",
    "ext_weights_overwritten": "bad-signature",
    "ext_config_changed": "bad-signature",
}
WEIGHTS = np.arange(16, dtype=np.float32).reshape(4, 4)


def _aiworks(*args: str | Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIWORKS_MODEL_")}
    done = subprocess.run(
        [sys.executable, "-m", "aiworks", *map(str, args)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def _copy_iris(source: Path, repo: Path, name: str) -> Path:
    """``repo/name`` as a copy of the demo iris model; returns its version folder."""
    version = repo / name / "1"
    version.mkdir(parents=True)
    config = (source / "iris" / "config.pbtxt").read_text().replace('name: "iris"', f'name: "{name}"')
    (repo / name / "config.pbtxt").write_text(config)
    shutil.copy(source / "iris" / "1" / "model.onnx", version / "model.onnx")
    return version


def _protect(version: Path, keys: Path, *, owner: str = OWNER, sign: bool = True, data_key: str = "model.key"):
    model = version / "model.onnx"
    watermark_file(model, model, owner, mk.load_data_key(keys / "owner.key"))
    if sign:
        mc.sign_file(model, mk.load_signing_key(keys / "signing.key"))
    mc.encrypt_file(model, key=mk.load_data_key(keys / data_key))
    model.unlink()


def _external_weights(repo: Path, name: str, keys: Path) -> Path:
    """``repo/name``: y = x @ WEIGHTS with the weights in ``1/weights.bin``, watermarked and signed in place."""
    version = repo / name / "1"
    version.mkdir(parents=True)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[numpy_helper.from_array(WEIGHTS, "w")],
    )
    model = version / "model.onnx"
    onnx.save_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model, save_as_external_data=True,
        all_tensors_to_one_file=True, location="weights.bin", size_threshold=0,
    )  # fmt: skip
    (repo / name / "config.pbtxt").write_text(
        "max_batch_size: 8\n"
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    )
    watermark_file(model, model, OWNER, mk.load_data_key(keys / "owner.key"))
    _aiworks("model", "sign", model, "--signing-key", keys / "signing.key")
    return version


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("keys")
    _aiworks("model", "keygen", "--kind", "aes", "--out", folder / "model.key")
    _aiworks("model", "keygen", "--kind", "signing", "--out", folder / "signing.key")
    _aiworks("model", "keygen", "--kind", "aes", "--out", folder / "owner.key")
    mk.write_data_key(folder / "other.key", mk.generate_data_key())
    return folder


@pytest.fixture(scope="module")
def repo(model_repository, keys, tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("protected") / "model-repository"
    # The documented workflow, with the commands: watermark, sign the plaintext, encrypt; serve model.onnx.enc.
    secure = _copy_iris(model_repository, repo, "iris_secure")
    model = secure / "model.onnx"
    _aiworks("model", "watermark", "embed", model, "--owner", OWNER, "--key-file", keys / "owner.key")
    _aiworks("model", "sign", model, "--signing-key", keys / "signing.key")
    _aiworks("model", "encrypt", model, "--key-file", keys / "model.key")
    out = _aiworks(
        "model", "verify", secure / "model.onnx.enc", "--key-file", keys / "model.key",
        "--public-key", keys / "signing.key.pub",
    )  # fmt: skip
    assert out.startswith("ok: ")
    model.unlink()
    # The same, encrypted in place under the plain name.
    inplace = _copy_iris(model_repository, repo, "iris_inplace")
    _protect(inplace, keys)
    (inplace / "model.onnx.enc").rename(inplace / "model.onnx")

    _protect(_copy_iris(model_repository, repo, "iris_tampered"), keys)
    enc = repo / "iris_tampered" / "1" / "model.onnx.enc"
    raw = bytearray(enc.read_bytes())
    raw[-40] ^= 0x01  # one bit of the ciphertext
    enc.write_bytes(bytes(raw))
    _protect(_copy_iris(model_repository, repo, "iris_wrong_key"), keys, data_key="other.key")
    bad = _copy_iris(model_repository, repo, "iris_bad_signature")
    other = tmp_path_factory.mktemp("other") / "model.onnx"
    other.write_bytes((bad / "model.onnx").read_bytes() + b"more bytes")
    _protect(bad, keys)
    mc.sign_file(other, mk.load_signing_key(keys / "signing.key"))
    shutil.copy(other.with_name("model.onnx.sig"), bad / "model.onnx.sig")  # a valid signature, of other bytes
    _protect(_copy_iris(model_repository, repo, "iris_unsigned"), keys, sign=False)
    _protect(_copy_iris(model_repository, repo, "iris_wrong_owner"), keys, owner="someone-else")
    _external_weights(repo, "ext_signed", keys)
    overwritten = _external_weights(repo, "ext_weights_overwritten", keys)
    (overwritten / "weights.bin").write_bytes((WEIGHTS * 10).tobytes())  # same size, other weights
    _external_weights(repo, "ext_config_changed", keys)
    with open(repo / "ext_config_changed" / "config.pbtxt", "a") as config:
        config.write('parameters { key: "mask_patterns" value: { string_value: "" } }\n')
    return repo


@pytest.fixture(scope="module")
def suite(repo, keys, tmp_path_factory):
    logs = tmp_path_factory.mktemp("at-rest") / "logs"
    env = {
        "AIWORKS_RUNTIME_MODEL_KEY_FILES": str(keys / "model.key"),
        "AIWORKS_RUNTIME_MODEL_PUBLIC_KEY_FILES": str(keys / "signing.key.pub"),
        "AIWORKS_RUNTIME_REQUIRE_SIGNED_MODELS": "true",
        "AIWORKS_RUNTIME_MODEL_WATERMARK_KEY_FILE": str(keys / "owner.key"),
        "AIWORKS_RUNTIME_MODEL_WATERMARK_OWNER": OWNER,
        "AIWORKS_RUNTIME_AUDIT_LOG": str(logs.parent / "audit" / "runtime-{replica_id}.jsonl"),
    }
    config = SuiteConfig.on_free_ports(model_repository=repo, log_dir=logs, replicas=1, cache=False, extra_env=env)
    supervisor = Supervisor(config)
    try:
        supervisor.start()
    except Exception:
        supervisor.stop()
        raise
    yield supervisor
    supervisor.stop()


def _audit_path(suite: Supervisor) -> Path:
    return suite.config.log_dir.parent / "audit" / "runtime-runtime-0.jsonl"


def _infer(suite: Supervisor, model: str) -> requests.Response:
    body = {"inputs": [{"name": "input", "shape": [len(ROWS), 4], "datatype": "FP32", "data": sum(ROWS, [])}]}
    return requests.post(f"{suite.http_url}/v2/models/{model}/infer", json=body, timeout=10)


def test_protected_models_serve_the_outputs_of_the_plaintext_model(suite, model_repository, repo):
    session = ort.InferenceSession(
        str(model_repository / "iris" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    labels, probabilities = session.run(["label", "probabilities"], {"input": np.array(ROWS, dtype=np.float32)})
    for model in ("iris_secure", "iris_inplace"):
        reply = _infer(suite, model)
        assert reply.status_code == 200, reply.text
        outputs = {o["name"]: o for o in reply.json()["outputs"]}
        assert outputs["label"]["data"] == labels.tolist()
        np.testing.assert_allclose(
            np.array(outputs["probabilities"]["data"]).reshape(probabilities.shape), probabilities, rtol=1e-6
        )
    # Weights in an external file, covered by the signature's manifest: served from the checked bytes.
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 0, 0, 0]}]}
    reply = requests.post(f"{suite.http_url}/v2/models/ext_signed/infer", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == WEIGHTS[0].tolist()
    # Nothing decrypted was left on disk: the protected folders hold ciphertext and signature only.
    assert sorted(p.name for p in (repo / "iris_secure" / "1").iterdir()) == ["model.onnx.enc", "model.onnx.sig"]
    assert (repo / "iris_inplace" / "1" / "model.onnx").read_bytes().startswith(mc.MAGIC)


def test_each_failing_model_is_unavailable_with_its_reason_in_the_index(suite):
    reply = requests.post(f"{suite.http_url}/v2/repository/index", json={}, timeout=10)
    assert reply.status_code == 200, reply.text
    index = {m["name"]: m for m in reply.json()}
    assert index["iris_secure"]["state"] == "READY" and index["iris_inplace"]["state"] == "READY"
    for model, reason in REFUSED.items():
        assert index[model]["state"] == "UNAVAILABLE", index[model]
        assert f"refused ({reason})" in index[model]["reason"], index[model]


def test_loading_a_failing_model_at_the_gateway_answers_with_the_reason(suite):
    for model, reason in REFUSED.items():
        reply = requests.post(f"{suite.http_url}/v2/repository/models/{model}/load", json={}, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert f"cannot load model '{model}' version 1: refused ({reason})" in error, error
        assert f"{model}/1/model.onnx" in error  # names the file...
        assert str(suite.config.model_repository) not in error  # ...never the server's path
        assert _infer(suite, model).status_code in (404, 503)
    errors = {
        model: requests.post(f"{suite.http_url}/v2/repository/models/{model}/load", json={}, timeout=60).json()["error"]
        for model in ("ext_weights_overwritten", "ext_config_changed")
    }
    assert errors["ext_weights_overwritten"].endswith(
        "model file ext_weights_overwritten/1/model.onnx: external data file 'weights.bin' was modified after signing"
    )
    assert errors["ext_config_changed"].endswith("config 'config.pbtxt' was modified after signing")


def test_refusals_are_audited_and_the_audit_log_verifies(suite):
    suite.stop()  # the runtime flushes and closes its audit file
    lines = [json.loads(line) for line in _audit_path(suite).read_text().splitlines()]
    refused = [line for line in lines if line["action"] == "model_refused"]
    assert {line["model"] for line in refused} == set(REFUSED)
    for line in refused:
        assert line["kind"] == "admin" and line["status"] == "refused" and line["actor"] == "runtime-0"
        assert line["details"]["reason"] == REFUSED[line["model"]]
        assert line["details"]["file"].startswith(f"{line['model']}/1/model.onnx")
    verified = {line["model"] for line in lines if line["action"] == "model_verified"}
    assert verified == {"iris_secure", "iris_inplace", "ext_signed"}
    [ext] = [line for line in lines if line["action"] == "model_verified" and line["model"] == "ext_signed"][:1]
    assert ext["details"]["signed_files"] == "../config.pbtxt, model.onnx, weights.bin"
    out = _aiworks("audit", "verify", _audit_path(suite))
    assert out.startswith(f"ok: {len(lines)} records")
