"""The runtime's model gate on real files: what it hands onnxruntime, and each refusal with its audit line.

The guard is exercised in-process against files written by the same
functions as ``aiworks model ...``; tests/e2e/test_model_at_rest.py runs the
same checks through a real runtime replica.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from aiworks.core.errors import InvalidArgument
from aiworks.security import model_crypto as mc
from aiworks.security import model_keys as mk
from aiworks.security.audit import AuditLog, verify_audit_log
from aiworks.security.model_guard import ModelGuard, ModelRefused
from aiworks.security.watermark import watermark_file

OWNER = "acme-ml"


@pytest.fixture
def keys(tmp_path):
    """Data key, signing key pair and owner key, in a folder apart from the repository."""
    folder = tmp_path / "keys"
    mk.write_data_key(folder / "model.key", mk.generate_data_key())
    mk.write_data_key(folder / "other.key", mk.generate_data_key())
    mk.write_signing_key(folder / "signing.key", mk.generate_signing_key())
    mk.write_data_key(folder / "owner.key", mk.generate_data_key())
    return folder


@pytest.fixture
def repo(tmp_path, onnx_model):
    """A repository folder holding one plaintext version of the test MLP."""
    folder = tmp_path / "repo" / "mlp" / "1"
    folder.mkdir(parents=True)
    shutil.copy(onnx_model, folder / "model.onnx")
    return tmp_path / "repo"


def protect(model, keys, *, owner=OWNER, owner_key="owner.key", sign=True, data_key="model.key"):
    """Watermark, sign, then encrypt ``model`` in place as model.onnx.enc (the documented order)."""
    watermark_file(model, model, owner, mk.load_data_key(keys / owner_key))
    if sign:
        mc.sign_file(model, mk.load_signing_key(keys / "signing.key"))
    mc.encrypt_file(model, key=mk.load_data_key(keys / data_key))
    model.unlink()
    return model.with_name("model.onnx.enc")


def guard(repo, keys, audit=None, **overrides) -> ModelGuard:
    options = dict(
        repository=repo,
        data_key_files=[keys / "model.key"],
        public_key_files=[keys / "signing.key.pub"],
        require_signature=True,
        watermark_key_file=keys / "owner.key",
        watermark_owner=OWNER,
        audit=audit,
        actor="runtime-test",
    )
    return ModelGuard.load(**{**options, **overrides})


def _run(source) -> np.ndarray:
    session = ort.InferenceSession(
        source if isinstance(source, bytes) else str(source), providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": np.arange(8, dtype=np.float32).reshape(2, 4)})[0]


@pytest.fixture
async def audit(tmp_path):
    log = AuditLog(tmp_path / "audit" / "runtime.jsonl")
    await log.start()
    yield log
    await log.close()


def _lines(log: AuditLog) -> list[dict]:
    log.flush_sync()
    return [json.loads(line) for line in log.path.read_text().splitlines()]


async def test_protected_model_opens_to_plaintext_bytes_with_the_same_outputs(repo, keys, audit, onnx_model):
    expected = _run(onnx_model)
    enc = protect(repo / "mlp" / "1" / "model.onnx", keys)
    data = guard(repo, keys, audit).open(enc, model="mlp", version="1")
    assert isinstance(data, bytes) and onnx.load_model_from_string(data).graph.name == "mlp"
    np.testing.assert_array_equal(_run(data), expected)
    [line] = _lines(audit)
    assert line["action"] == "model_verified" and line["actor"] == "runtime-test"
    assert line["details"]["encrypted"] is True and line["details"]["watermark_owner"] == OWNER
    assert line["details"]["file"] == "mlp/1/model.onnx.enc"  # relative to the repository
    assert not list(repo.rglob("*.onnx")), "no plaintext was written next to the ciphertext"


def test_unprotected_plain_file_loads_from_its_path(repo):
    path = repo / "mlp" / "1" / "model.onnx"
    assert ModelGuard().open(path) == path


def test_encrypted_file_without_keys_is_refused(repo, keys):
    enc = protect(repo / "mlp" / "1" / "model.onnx", keys)
    with pytest.raises(ModelRefused, match=r"refused \(wrong-key\).*key ids loaded: none"):
        ModelGuard().open(enc)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("tampered", "tampered"),
        ("wrong-key", "wrong-key"),
        ("bad-signature", "bad-signature"),
        ("missing-signature", "missing-signature"),
        ("wrong-watermark", "watermark-other-owner"),
        ("watermark-other-key", "watermark-mismatch"),
    ],
)
async def test_each_failing_model_is_refused_with_its_reason_and_audited(repo, keys, audit, tmp_path, case, reason):
    model = repo / "mlp" / "1" / "model.onnx"
    if case == "tampered":
        enc = protect(model, keys)
        raw = bytearray(enc.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        enc.write_bytes(bytes(raw))
    elif case == "wrong-key":
        enc = protect(model, keys, data_key="other.key")
    elif case == "bad-signature":
        other = tmp_path / "other" / "model.onnx"
        other.parent.mkdir()
        other.write_bytes(model.read_bytes() + b"another model")  # signed, but not these bytes
        enc = protect(model, keys)
        mc.sign_file(other, mk.load_signing_key(keys / "signing.key"))
        shutil.copy(other.with_name("model.onnx.sig"), model.with_name("model.onnx.sig"))
    elif case == "missing-signature":
        enc = protect(model, keys, sign=False)
    elif case == "wrong-watermark":
        enc = protect(model, keys, owner="someone-else")
    else:
        enc = protect(model, keys, owner_key="other.key")
    with pytest.raises(ModelRefused) as info:
        guard(repo, keys, audit).open(enc, model="mlp", version="1")
    assert info.value.reason == reason
    # The file is named relative to the repository: the message reaches clients, the server's path must not.
    assert str(info.value).startswith(f"refused ({reason}): model file mlp/1/model.onnx.enc: ")
    assert str(repo) not in str(info.value)
    [line] = _lines(audit)
    assert (line["kind"], line["action"], line["status"]) == ("admin", "model_refused", "refused")
    assert (line["model"], line["version"], line["details"]["reason"]) == ("mlp", "1", reason)
    assert verify_audit_log(audit.path).ok


def test_key_files_inside_the_repository_are_refused(repo, keys):
    shutil.copy(keys / "model.key", repo / "model.key")
    with pytest.raises(InvalidArgument, match="inside the model repository"):
        guard(repo, keys, data_key_files=[repo / "model.key"])
    shutil.copy(keys / "owner.key", repo / "owner.key")
    with pytest.raises(InvalidArgument, match="inside the model repository"):
        guard(repo, keys, watermark_key_file=repo / "owner.key")


def test_runtime_settings_take_key_lists_from_variables(monkeypatch, keys):
    from pydantic import ValidationError

    from aiworks.runtime.settings import RuntimeSettings

    monkeypatch.setenv("AIWORKS_RUNTIME_MODEL_KEY_FILES", f"{keys / 'model.key'}, {keys / 'other.key'}")
    monkeypatch.setenv("AIWORKS_RUNTIME_MODEL_KEYS", (keys / "owner.key").read_text().strip())
    monkeypatch.setenv("AIWORKS_RUNTIME_MODEL_PUBLIC_KEY_FILES", f'["{keys / "signing.key.pub"}"]')
    monkeypatch.setenv("AIWORKS_RUNTIME_AUDIT_LOG", "/var/log/aiworks/{replica_id}.jsonl")
    settings = RuntimeSettings(scheduler_address="127.0.0.1:8010")
    assert settings.model_key_files == [keys / "model.key", keys / "other.key"]
    assert len(settings.model_keys) == 1 and "owner" not in repr(settings.model_keys)  # a secret: never printed
    assert settings.model_public_key_files == [keys / "signing.key.pub"]
    assert str(settings.resolved_audit_log("runtime-1")) == "/var/log/aiworks/runtime-1.jsonl"
    with pytest.raises(ValidationError, match="AIWORKS_RUNTIME_MODEL_WATERMARK_KEY_FILE"):
        RuntimeSettings(scheduler_address="127.0.0.1:8010", model_watermark_owner=OWNER)


# ---- the signed manifest: external weights and the config are covered too -----------------------------


def external_model(version, *, config: str | None = 'name: "mlp"\nmax_batch_size: 8\n'):
    """``version/model.onnx`` with its weights in ``version/weights.bin`` (ONNX external data), and a config."""
    version.mkdir(parents=True, exist_ok=True)
    weights = onnx.numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])],
        "mlp",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])],
        initializer=[weights],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    onnx.save_model(
        model, version / "model.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
        location="weights.bin", size_threshold=0,
    )  # fmt: skip
    if config is not None:
        (version.parent / "config.pbtxt").write_text(config)
    return version / "model.onnx"


def signing_guard(repo, keys, audit=None) -> ModelGuard:
    """Signatures required, no encryption or watermark: the signature alone has to catch a swapped file."""
    return guard(repo, keys, audit, data_key_files=[], watermark_key_file=None, watermark_owner=None)


def test_sign_covers_the_model_its_external_data_and_its_config(tmp_path, keys):
    model = external_model(tmp_path / "repo" / "mlp" / "1")
    sig = json.loads(mc.sign_file(model, mk.load_signing_key(keys / "signing.key")).read_text())
    assert sig["format"] == 2 and set(sig["files"]) == {"model.onnx", "weights.bin", "../config.pbtxt"}
    opened = signing_guard(tmp_path / "repo", keys).open_all(model, model="mlp", version="1")
    assert isinstance(opened.source, bytes) and opened.external == {"weights.bin": (model.parent / "weights.bin").read_bytes()}


async def test_overwritten_external_weights_are_refused_naming_the_file_and_audited(tmp_path, keys, audit):
    repo = tmp_path / "repo"
    model = external_model(repo / "mlp" / "1")
    mc.sign_file(model, mk.load_signing_key(keys / "signing.key"))
    weights = model.parent / "weights.bin"
    weights.write_bytes(np.full(16, 9, dtype=np.float32).tobytes())  # same size, other weights
    with pytest.raises(ModelRefused) as info:
        signing_guard(repo, keys, audit).open_all(model, model="mlp", version="1")
    message = str(info.value)
    assert info.value.reason == "bad-signature"
    assert message == (
        "refused (bad-signature): model file mlp/1/model.onnx: external data file 'weights.bin' was modified after signing"
    )
    assert str(repo) not in message and str(tmp_path) not in message
    [line] = _lines(audit)
    assert (line["kind"], line["action"], line["status"], line["model"]) == ("admin", "model_refused", "refused", "mlp")
    assert line["details"]["reason"] == "bad-signature" and "weights.bin" in line["details"]["message"]
    assert verify_audit_log(audit.path).ok


@pytest.mark.parametrize(
    "change, reason, says",
    [
        ("config", "bad-signature", "config 'config.pbtxt' was modified after signing"),
        ("new-config", "unsigned-file", "config 'config.pbtxt' is not covered by the signature"),
        ("weights-gone", "missing-file", "external data file 'weights.bin' does not exist"),
        ("format-1", "unsigned-file", "external data file 'weights.bin' is not covered by the signature"),
    ],
)
def test_every_file_the_model_reads_must_match_what_was_signed(tmp_path, keys, change, reason, says):
    repo = tmp_path / "repo"
    model = external_model(repo / "mlp" / "1", config=None if change == "new-config" else 'name: "mlp"\n')
    signer = mk.load_signing_key(keys / "signing.key")
    if change == "format-1":  # what earlier versions signed: the graph file alone
        model.with_name("model.onnx.sig").write_text(json.dumps(mc.sign_bytes(model.read_bytes(), signer)))
    else:
        mc.sign_file(model, signer)
    if change == "config":
        (repo / "mlp" / "config.pbtxt").write_text('name: "mlp"\nparameters { key: "mask_patterns" value: {} }\n')
    elif change == "new-config":
        (repo / "mlp" / "config.pbtxt").write_text('name: "mlp"\n')
    elif change == "weights-gone":
        (model.parent / "weights.bin").unlink()
    with pytest.raises(ModelRefused) as info:
        signing_guard(repo, keys).open_all(model, model="mlp", version="1")
    assert info.value.reason == reason and says in str(info.value)


def test_the_runtime_checks_the_config_it_parsed_and_feeds_onnxruntime_the_checked_weights(tmp_path, keys):
    from aiworks.runtime import onnxruntime_backend
    from aiworks.runtime.repository import ModelRepository

    repo = tmp_path / "repo"
    model = external_model(repo / "mlp" / "1", config='name: "mlp"\nmax_batch_size: 8\n')
    mc.sign_file(model, mk.load_signing_key(keys / "signing.key"))
    onnxruntime_backend.use_model_guard(signing_guard(repo, keys))
    try:
        config = ModelRepository(repo).entry("mlp").config
        # The config the runtime parsed is what is compared, not a second read of the file.
        tampered = dataclasses.replace(config, source_sha256="0" * 64)
        with pytest.raises(ModelRefused, match="config 'config.pbtxt' was modified after signing"):
            onnxruntime_backend.OnnxRuntimeModel(model, tampered, 1)
        loaded = onnxruntime_backend.OnnxRuntimeModel(model, config, 1)
        (model.parent / "weights.bin").write_bytes(b"\0" * 64)  # after the check: the session has its own copy
        [y] = loaded.run({"x": np.eye(4, dtype=np.float32)[:1]}, ["y"])
        np.testing.assert_array_equal(y, [[0, 1, 2, 3]])
    finally:
        onnxruntime_backend.use_model_guard(ModelGuard())
