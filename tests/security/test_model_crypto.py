"""Encrypted and signed models: round trips, and a clear refusal for each way a file can be wrong.

Every decrypted model is loaded by onnxruntime to prove the bytes are the model.
"""

from __future__ import annotations

import json
import shutil
import stat

import numpy as np
import onnxruntime as ort
import pytest

from aiworks.core.errors import InvalidArgument
from aiworks.security import model_crypto as mc
from aiworks.security import model_keys as mk
from aiworks.security.model_crypto import ModelIntegrityError, open_model, open_model_checked
from aiworks.security.model_keys import Keyring


@pytest.fixture
def data_key() -> bytes:
    return mk.generate_data_key()


@pytest.fixture
def signer():
    return mk.generate_signing_key()


def _run(model_bytes: bytes) -> np.ndarray:
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    return session.run(None, {"x": x})[0]


def _reason(exc_info) -> str:
    return exc_info.value.reason


def test_encrypted_model_opens_to_the_same_bytes_and_runs(onnx_model, data_key):
    plain = onnx_model.read_bytes()
    enc = mc.encrypt_file(onnx_model, key=data_key)
    assert enc.name == "model.onnx.enc"
    raw = enc.read_bytes()
    assert raw.startswith(mc.MAGIC) and plain not in raw
    opened = open_model_checked(enc, Keyring({mk.data_key_id(data_key): data_key}))
    assert opened.data == plain and opened.encrypted and opened.signed_by is None
    np.testing.assert_array_equal(_run(opened.data), _run(plain))
    header = mc.describe(enc)
    assert header["algorithm"] == "AES-256-GCM" and header["kid"] == mk.data_key_id(data_key)
    assert header["name"] == "model.onnx"


def test_two_encryptions_use_fresh_nonces(onnx_model, data_key, tmp_path):
    a = mc.encrypt_file(onnx_model, tmp_path / "a.onnx.enc", key=data_key, name="model.onnx")
    b = mc.encrypt_file(onnx_model, tmp_path / "b.onnx.enc", key=data_key, name="model.onnx")
    assert a.read_bytes() != b.read_bytes()


def test_plain_model_passes_through_an_empty_keyring(onnx_model):
    assert open_model(onnx_model, Keyring()) == onnx_model.read_bytes()


def test_wrong_key_is_named(onnx_model, data_key):
    enc = mc.encrypt_file(onnx_model, key=data_key)
    other = mk.generate_data_key()
    with pytest.raises(ModelIntegrityError, match=mk.data_key_id(data_key)) as info:
        open_model(enc, Keyring({mk.data_key_id(other): other}))
    assert _reason(info) == "wrong-key" and str(enc) in str(info.value)


@pytest.mark.parametrize("where", ["ciphertext", "tag", "nonce", "header"])
def test_tampered_file_is_refused(onnx_model, data_key, where):
    enc = mc.encrypt_file(onnx_model, key=data_key)
    raw = bytearray(enc.read_bytes())
    header_end = len(mc.read_header(bytes(raw), enc).aad)
    if where == "ciphertext":
        raw[header_end + mc.NONCE_BYTES + 100] ^= 0x01
    elif where == "tag":
        raw[-1] ^= 0x80
    elif where == "nonce":
        raw[header_end] ^= 0x01
    else:  # same length, valid JSON, still the right key id: only the AAD check can notice
        raw[:header_end] = bytes(raw[:header_end]).replace(b'"name":"model.onnx"', b'"name":"model.onnz"')
    enc.write_bytes(bytes(raw))
    ring = Keyring({mk.data_key_id(data_key): data_key})
    with pytest.raises(ModelIntegrityError) as info:
        open_model(enc, ring, name="model.onnz" if where == "header" else None)
    assert _reason(info) == "tampered", info.value


def test_truncated_file_is_refused(onnx_model, data_key):
    enc = mc.encrypt_file(onnx_model, key=data_key)
    enc.write_bytes(enc.read_bytes()[:-40])
    with pytest.raises(ModelIntegrityError) as info:
        open_model(enc, Keyring({mk.data_key_id(data_key): data_key}))
    assert _reason(info) == "tampered"


def test_swapped_files_are_refused(onnx_model, data_key, tmp_path, monkeypatch):
    ring = Keyring({mk.data_key_id(data_key): data_key})
    for model in ("iris", "digits"):
        (tmp_path / "repo" / model / "1").mkdir(parents=True)
        mc.encrypt_file(
            onnx_model, tmp_path / "repo" / model / "1" / "model.onnx", key=data_key, name=f"{model}/1/model.onnx"
        )
    iris, digits = (tmp_path / "repo" / m / "1" / "model.onnx" for m in ("iris", "digits"))
    assert open_model(iris, ring) == onnx_model.read_bytes()
    monkeypatch.chdir(iris.parent)  # a relative path is checked as the absolute one
    assert open_model("model.onnx", ring) == onnx_model.read_bytes()
    shutil.copyfile(iris, digits)
    with pytest.raises(ModelIntegrityError, match="encrypted for 'iris/1/model.onnx'") as info:
        open_model(digits, ring)
    assert _reason(info) == "wrong-name"
    # A file-name binding stops a swap between differently named files, too.
    renamed = tmp_path / "other.onnx.enc"
    shutil.copyfile(mc.encrypt_file(onnx_model, key=data_key), renamed)
    with pytest.raises(ModelIntegrityError) as info:
        open_model(renamed, ring)
    assert _reason(info) == "wrong-name"


def test_sm4_gcm_round_trip_or_clear_unavailability(onnx_model):
    if not mc.sm4_available():
        with pytest.raises(mc.AlgorithmUnavailable, match="SM4-GCM is unavailable"):
            mc.encrypt_file(onnx_model, key=bytes(16), algorithm=mk.SM4_GCM)
        return
    key = mk.generate_data_key(mk.SM4_GCM)
    assert len(key) == 16
    enc = mc.encrypt_file(onnx_model, key=key, algorithm=mk.SM4_GCM)
    assert mc.describe(enc)["algorithm"] == "SM4-GCM"
    assert open_model(enc, Keyring({mk.data_key_id(key): key})) == onnx_model.read_bytes()


def test_key_length_must_match_the_algorithm(onnx_model):
    with pytest.raises(InvalidArgument, match="needs a 32-byte key"):
        mc.encrypt_file(onnx_model, key=bytes(16))


# ---- signatures --------------------------------------------------------------------------------


def _trusting(signer, **kw) -> Keyring:
    pub = signer.public_key()
    return Keyring(trusted_keys={mk.public_key_id(pub): pub}, **kw)


def test_signed_model_verifies(onnx_model, signer):
    sig = mc.sign_file(onnx_model, signer)
    assert sig.name == "model.onnx.sig"
    body = json.loads(sig.read_text())
    assert body["alg"] == "Ed25519" and body["kid"] == mk.public_key_id(signer.public_key())
    opened = open_model_checked(onnx_model, _trusting(signer, require_signature=True))
    assert opened.signed_by == body["kid"]


def test_modified_model_fails_its_signature(onnx_model, signer):
    mc.sign_file(onnx_model, signer)
    data = bytearray(onnx_model.read_bytes())
    data[-5] ^= 0x01
    onnx_model.write_bytes(bytes(data))
    with pytest.raises(ModelIntegrityError, match="signature does not match") as info:
        open_model(onnx_model, _trusting(signer))
    assert _reason(info) == "bad-signature"


def test_signature_by_an_untrusted_key_is_refused(onnx_model, signer):
    mc.sign_file(onnx_model, mk.generate_signing_key())
    with pytest.raises(ModelIntegrityError, match="not trusted") as info:
        open_model(onnx_model, _trusting(signer))
    assert _reason(info) == "untrusted-signer"


def test_relabelled_signature_is_refused(onnx_model, signer):
    sig = mc.sign_file(onnx_model, mk.generate_signing_key())
    body = json.loads(sig.read_text())
    body["kid"] = mk.public_key_id(signer.public_key())  # claims the trusted signer
    sig.write_text(json.dumps(body))
    with pytest.raises(ModelIntegrityError) as info:
        open_model(onnx_model, _trusting(signer))
    assert _reason(info) == "bad-signature"


def test_unsigned_model_is_refused_only_when_signatures_are_required(onnx_model, signer):
    assert open_model(onnx_model, _trusting(signer)) == onnx_model.read_bytes()
    with pytest.raises(ModelIntegrityError, match="has no signature") as info:
        open_model(onnx_model, _trusting(signer, require_signature=True))
    assert _reason(info) == "missing-signature"
    with pytest.raises(InvalidArgument, match="no trusted public key"):
        Keyring(require_signature=True)


def test_encrypted_and_signed_model(onnx_model, data_key, signer):
    plain = onnx_model.read_bytes()
    mc.sign_file(onnx_model, signer)
    enc = mc.encrypt_file(onnx_model, key=data_key)
    onnx_model.unlink()
    ring = _trusting(signer, require_signature=True)
    ring.data_keys[mk.data_key_id(data_key)] = data_key
    opened = open_model_checked(enc, ring)
    assert opened.data == plain and opened.encrypted and opened.signed_by
    np.testing.assert_array_equal(_run(opened.data), _run(plain))
    # Signing an encrypted file signs its plaintext.
    enc.with_name("model.onnx.sig").unlink()
    mc.sign_file(enc, signer, ring)
    assert open_model(enc, ring) == plain


# ---- keys --------------------------------------------------------------------------------------


def test_keys_round_trip_through_files_and_environment(tmp_path, onnx_model):
    keys = tmp_path / "keys"
    kid = mk.write_data_key(keys / "model.key", mk.generate_data_key())
    pub_path, signer_kid = mk.write_signing_key(keys / "signing.key", mk.generate_signing_key())
    assert stat.S_IMODE((keys / "model.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((keys / "signing.key").stat().st_mode) == 0o600
    ring = Keyring.load(data_key_files=[keys / "model.key"], public_key_files=[pub_path], require_signature=True)
    assert list(ring.data_keys) == [kid] and list(ring.trusted_keys) == [signer_kid]
    env = {
        "AIWORKS_MODEL_KEY": (keys / "model.key").read_text().strip(),
        "AIWORKS_MODEL_PUBLIC_KEY_FILE": str(pub_path),
        "AIWORKS_MODEL_REQUIRE_SIGNATURE": "true",
    }
    from_env = Keyring.from_env(env)
    assert list(from_env.data_keys) == [kid] and from_env.require_signature
    assert list(from_env.trusted_keys) == [signer_kid]
    enc = mc.encrypt_file(onnx_model, key=from_env.data_keys[kid])
    mc.sign_file(onnx_model, mk.load_signing_key(keys / "signing.key"))
    assert open_model(enc, from_env) == onnx_model.read_bytes()


def test_key_files_inside_the_model_repository_are_refused(tmp_path):
    repo = tmp_path / "repo"
    mk.write_data_key(repo / "iris" / "model.key", mk.generate_data_key())
    with pytest.raises(InvalidArgument, match="inside the model repository"):
        Keyring.load(data_key_files=[repo / "iris" / "model.key"], forbidden_root=repo)


def test_bad_key_material_is_named(tmp_path):
    (tmp_path / "short.key").write_text("c2hvcnQ=\n")
    with pytest.raises(InvalidArgument, match="short.key is 5 bytes"):
        mk.load_data_key(tmp_path / "short.key")
    with pytest.raises(InvalidArgument, match="not base64"):
        mk.parse_data_key("***", "$AIWORKS_MODEL_KEY")
    with pytest.raises(InvalidArgument, match="neither PEM nor base64"):
        mk.parse_public_key(b"nope", "value")
