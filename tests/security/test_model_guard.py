"""The runtime's model gate on real files: what it hands onnxruntime, and each refusal with its audit line.

The guard is exercised in-process against files written by the same
functions as ``aiworks model ...``; tests/e2e/test_model_at_rest.py runs the
same checks through a real runtime replica.
"""

from __future__ import annotations

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
    assert str(info.value).startswith(f"refused ({reason}): ") and str(enc) in str(info.value)
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
    from aiworks.runtime.settings import RuntimeSettings
    from pydantic import ValidationError

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
