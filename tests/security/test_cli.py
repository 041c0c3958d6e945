"""The security subcommands, driven in-process through an argparse parser as ``aiworks`` builds it."""

from __future__ import annotations

import argparse
import json
import stat

import pytest

from aiworks.security import model_keys as mk
from aiworks.security.cli import add_security_parsers


@pytest.fixture(autouse=True)
def no_key_in_environment(monkeypatch):
    monkeypatch.delenv("AIWORKS_MODEL_KEY", raising=False)


def _parser(model_command: str = "model") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiworks")
    sub = parser.add_subparsers(dest="command", required=True)
    add_security_parsers(sub, model_command=model_command)
    return parser


def run(*argv: str) -> None:
    args = _parser().parse_args(list(argv))
    args.func(args)


def _exit_code(*argv: str) -> int:
    with pytest.raises(SystemExit) as info:
        run(*argv)
    return info.value.code


def test_help_texts(capsys):
    for argv in (["certs"], ["audit", "verify"], ["model"], ["model", "encrypt"], ["model", "watermark", "embed"]):
        with pytest.raises(SystemExit):
            _parser().parse_args([*argv, "--help"])
        assert "usage: aiworks" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _parser("seal").parse_args(["seal", "--help"])
    assert "aiworks seal keygen" in capsys.readouterr().out


def test_certs_command_as_docker_compose_calls_it(tmp_path, capsys):
    run("certs", "--out-dir", str(tmp_path), "--hostname", "localhost")
    assert "CA created" in capsys.readouterr().out
    assert stat.S_IMODE((tmp_path / "tls.key").stat().st_mode) == 0o600
    assert (tmp_path / "tls.crt").exists() and (tmp_path / "ca.crt").exists()
    run(
        "certs",
        "--out-dir",
        str(tmp_path),
        "--hostname",
        "localhost",
        "--services",
        "gateway,scheduler,runtime,cache,monitor",
    )
    assert "CA reused" in capsys.readouterr().out
    for svc in ("gateway", "scheduler", "runtime", "cache", "monitor"):
        assert (tmp_path / svc / "tls.key").exists() and (tmp_path / svc / "ca.crt").exists()
    assert _exit_code("certs", "--out-dir", str(tmp_path), "--hostname", "bad host") == 2
    assert "neither a hostname nor an IP" in capsys.readouterr().err


def test_certs_rotates_the_credential_key_file_step_by_step(tmp_path, capsys):
    from aiworks.security import cli, keyring
    from aiworks.security.keyring import read_keys
    from aiworks.security.sealing import Sealer

    assert cli.ROTATION_STEPS == keyring.ROTATION_STEPS

    key = tmp_path / "credential-key"
    assert _exit_code("certs", "--credential-key", str(key), "--rotate-credential-key", "stage") == 2
    assert "does not exist" in capsys.readouterr().err
    run("certs", "--credential-key", str(key))  # no --out-dir: only the secret file
    assert "credential key file" in capsys.readouterr().out and not (tmp_path / "ca.crt").exists()
    first = read_keys(key)
    run("certs", "--credential-key", str(key), "--rotate-credential-key", "stage")
    out = capsys.readouterr().out
    staged = read_keys(key)
    assert staged[0] == first[0] and len(staged) == 2
    assert f"credential key ids {Sealer(first).key_id} (seals), {Sealer(staged[1:]).key_id} (opens only)" in out
    assert first[0].decode() not in out and staged[1].decode() not in out, "key ids only, never a key"
    run("certs", "--credential-key", str(key), "--rotate-credential-key", "promote")
    assert f"credential key ids {Sealer(staged[1]).key_id} (seals), " in capsys.readouterr().out
    run("certs", "--credential-key", str(key), "--rotate-credential-key", "retire")
    assert read_keys(key) == [staged[1]] and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert _exit_code("certs", "--credential-key", str(key), "--rotate-credential-key", "promote") == 2
    assert "stage a new one before promoting" in capsys.readouterr().err
    assert _exit_code("certs", "--rotate-credential-key", "at-once") == 2
    assert "needs --credential-key FILE" in capsys.readouterr().err
    assert _exit_code("certs") == 2 and "--out-dir is required" in capsys.readouterr().err


async def test_audit_verify_command(tmp_path, capsys):
    from aiworks.security.audit import AuditLog

    path = tmp_path / "audit.jsonl"
    async with AuditLog(path) as audit:
        for i in range(3):
            audit.admin(actor="ops", action=f"step{i}")
    run("audit", "verify", str(path))
    out = capsys.readouterr().out
    assert out.startswith("ok: 3 records, head seq 3")
    head = out.split("hash ")[-1].strip()
    run("audit", "verify", str(path), "--expect-head", head)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[2])
    assert _exit_code("audit", "verify", str(path)) == 1
    assert "line 2: seq 3 where 2 was expected" in capsys.readouterr().out
    path.write_text("".join(lines[:2]))
    assert _exit_code("audit", "verify", str(path), "--expect-head", head) == 1
    assert "cut off the end" in capsys.readouterr().out


async def test_audit_verify_prints_json_and_yaml(tmp_path, capsys):
    import yaml

    from aiworks.security.audit import AuditLog

    path = tmp_path / "audit.jsonl"
    async with AuditLog(path) as audit:
        for i in range(3):
            audit.admin(actor="ops", action=f"step{i}")
    run("audit", "verify", str(path), "-o", "json")
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ok"], doc["records"], doc["head_seq"], doc["bad_line"]) == (True, 3, 3, None)
    run("audit", "verify", str(path), "--json")  # the hidden alias of -o json
    assert json.loads(capsys.readouterr().out) == doc
    run("audit", "verify", str(path), "-o", "yaml")
    assert yaml.safe_load(capsys.readouterr().out) == doc
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]))  # cut off the end: caught by the head recorded earlier
    assert _exit_code("audit", "verify", str(path), "--expect-head", doc["head_hash"], "-o", "json") == 1
    cut = json.loads(capsys.readouterr().out)
    assert cut["ok"] is False and cut["expected_head"] == doc["head_hash"] and "cut off the end" in cut["reason"]
    path.write_text(lines[0] + lines[2])
    assert _exit_code("audit", "verify", str(path), "-o", "yaml") == 1
    bad = yaml.safe_load(capsys.readouterr().out)
    assert (bad["ok"], bad["bad_line"], bad["file"]) == (False, 2, str(path))


def test_model_keygen_encrypt_sign_verify_decrypt(tmp_path, onnx_model, capsys, monkeypatch):
    keys = tmp_path / "keys"
    run("model", "keygen", "--kind", "aes", "--out", str(keys / "model.key"))
    run("model", "keygen", "--kind", "signing", "--out", str(keys / "signing.key"))
    assert "key id" in capsys.readouterr().out
    assert _exit_code("model", "keygen", "--out", str(keys / "model.key")) == 2
    assert "already exist" in capsys.readouterr().err

    plain = onnx_model.read_bytes()
    run("model", "sign", str(onnx_model), "--signing-key", str(keys / "signing.key"))
    run("model", "encrypt", str(onnx_model), "--key-file", str(keys / "model.key"))
    enc = onnx_model.with_name("model.onnx.enc")
    onnx_model.unlink()
    pub = str(keys / "signing.key.pub")
    run("model", "verify", str(enc), "--key-file", str(keys / "model.key"), "--public-key", pub)
    assert "ok:" in capsys.readouterr().out

    monkeypatch.setenv("MY_MODEL_KEY", (keys / "model.key").read_text().strip())
    run("model", "decrypt", str(enc), "--key-env", "MY_MODEL_KEY")
    assert onnx_model.read_bytes() == plain
    assert stat.S_IMODE(onnx_model.stat().st_mode) == 0o600

    # A flipped byte: verify exits 1 and names the failure.
    raw = bytearray(enc.read_bytes())
    raw[-30] ^= 1
    enc.write_bytes(bytes(raw))
    assert _exit_code("model", "verify", str(enc), "--key-file", str(keys / "model.key"), "--public-key", pub) == 1
    assert "authentication failed" in capsys.readouterr().err


def test_model_verify_refuses_an_unsigned_model(tmp_path, onnx_model, capsys):
    mk.write_signing_key(tmp_path / "signing.key", mk.generate_signing_key())
    code = _exit_code("model", "verify", str(onnx_model), "--public-key", str(tmp_path / "signing.key.pub"))
    assert code == 1 and "has no signature" in capsys.readouterr().err


def test_model_watermark_commands(tmp_path, onnx_model, capsys):
    mk.write_data_key(tmp_path / "owner.key", mk.generate_data_key())
    key = ["--key-file", str(tmp_path / "owner.key")]
    run("model", "watermark", "embed", str(onnx_model), "--owner", "acme-ml", *key)
    run("model", "watermark", "check", str(onnx_model), "--owner", "acme-ml", *key)
    assert "unchanged" in capsys.readouterr().out
    assert _exit_code("model", "watermark", "check", str(onnx_model), "--owner", "globex", *key) == 1
    assert _exit_code("model", "watermark", "check", str(onnx_model)) == 2
    assert "AIWORKS_MODEL_KEY" in capsys.readouterr().err


def test_signature_file_is_json_with_key_id(tmp_path, onnx_model):
    _, kid = mk.write_signing_key(tmp_path / "signing.key", mk.generate_signing_key())
    run("model", "sign", str(onnx_model), "--signing-key", str(tmp_path / "signing.key"))
    assert json.loads(onnx_model.with_name("model.onnx.sig").read_text())["kid"] == kid
