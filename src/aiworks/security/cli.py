"""The security subcommands: ``certs``, ``audit verify`` and ``model ...``.

``add_security_parsers(sub)`` registers them on the ``aiworks`` parser.
Imports happen inside each command, so ``aiworks --help`` stays instant. Keys
are read from files or environment variables named on the command line, never
passed as arguments (they would land in shell history and ``ps``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from aiworks.core.output import add_output_flag

DEFAULT_KEY_ENV = "AIWORKS_MODEL_KEY"
# aiworks.security.keyring's steps; not imported from there, which would load grpc and cryptography for --help.
ROTATION_STEPS = ("stage", "promote", "retire", "at-once")
EXIT_FAILED_CHECK = 1
EXIT_USAGE = 2


def _fail(message: str, code: int = EXIT_USAGE) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for text in values or [] for v in text.split(",") if v.strip()]


# ---- certs -------------------------------------------------------------------------------------


def cmd_certs(args) -> None:
    from aiworks.core.errors import AIWorksError
    from aiworks.security.certs import DEFAULT_HOSTNAMES, write_certificates

    if args.rotate_credential_key and not args.credential_key:
        _fail("--rotate-credential-key needs --credential-key FILE, the file to rotate")
    if args.rotate_internal_token and not args.internal_token:
        _fail("--rotate-internal-token needs --internal-token FILE, the file to rotate")
    if not args.out_dir:
        if args.internal_token or args.credential_key:
            _secret_files(args)  # only the secrets were asked for
            return
        _fail("--out-dir is required to write certificates")
    hostnames = _split(args.hostname) or list(DEFAULT_HOSTNAMES)
    out = Path(args.out_dir)
    wanted = [out / "tls.crt"] + [out / svc / "tls.crt" for svc in _split(args.services)]
    _secret_files(args)
    if args.if_missing and all(p.is_file() for p in wanted):
        print(f"certificates already in {out}; kept (--if-missing)")
        return
    try:
        result = write_certificates(
            Path(args.out_dir),
            hostnames,
            _split(args.services),
            ca_dir=Path(args.ca_dir) if args.ca_dir else None,
            force=args.force,
        )
    except AIWorksError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write certificates: {exc.filename or args.out_dir}: {exc.strerror or exc}")
    print(result.summary())


def _secret_files(args) -> None:
    """The installation's secrets asked for (--internal-token, --credential-key): made when missing, else kept."""
    from aiworks.core.errors import AIWorksError
    from aiworks.security.callers import ensure_secret_file

    for value, what in ((args.internal_token, "internal token file"), (args.credential_key, "credential key file")):
        if not value:
            continue
        path = Path(value)
        step = args.rotate_credential_key if what == "credential key file" else args.rotate_internal_token
        if step:
            _rotate(path, step, what)
            continue
        try:
            ensure_secret_file(path)
        except (AIWorksError, OSError) as exc:
            _fail(f"cannot write the {what} {path}: {exc}")
        print(f"{what}: {path} (mode 0600; kept when it exists)")


# What each rotatable file's steps mean, for the line that says what happened: who takes it, then what comes next.
_ROTATIONS = {
    "credential key file": (
        "--rotate-credential-key",
        "every gateway, batch runner and nearline worker reading this file takes it within 10 s (their /metrics: "
        "aiworks_credential_key_info)",
        {"stage": "once all hold it, {flag} promote",
         "promote": "once what the older key sealed has ended, {flag} retire",
         "retire": "what an older key sealed no longer opens", "at-once": "later, {flag} retire"},
    ),
    "internal token file": (
        "--rotate-internal-token",
        "every service, the monitor and `aiworks up` reading this file take it within 10 s (their /metrics: "
        "aiworks_internal_token_info); the command-line tools read it at each run",
        {"stage": "once all hold it, {flag} promote", "promote": "once all present the new token, {flag} retire",
         "retire": "the older secret's tokens are refused", "at-once": "once all hold it, {flag} retire"},
    ),
}  # fmt: skip


def _rotate(path: Path, step: str, what: str) -> None:
    """One step of a rotation of the credential key file or the internal token file (:mod:`aiworks.security.keyring`);
    says which key ids each role has now and what comes next. Running processes take the file within their reload
    interval (10 s by default), with no restart."""
    from aiworks.core.errors import AIWorksError
    from aiworks.security.callers import CallerAuth
    from aiworks.security.keyring import CREDENTIAL_KEY_FILE, INTERNAL_TOKEN_FILE, rotate_file
    from aiworks.security.sealing import Sealer

    kind = CREDENTIAL_KEY_FILE if what == "credential key file" else INTERNAL_TOKEN_FILE
    try:
        keys = rotate_file(path, step, kind)
    except AIWorksError as exc:
        _fail(f"cannot rotate: {exc.message}")
    except OSError as exc:
        _fail(f"cannot rotate the {what} {path}: {exc.strerror or exc}")
    flag, taken, after = _ROTATIONS[what]
    ring = Sealer(keys).describe() if kind is CREDENTIAL_KEY_FILE else CallerAuth(secret=keys).describe_keys()
    noun = "key" if kind is CREDENTIAL_KEY_FILE else "secret"
    separator = ": " if step == "retire" else "; "
    print(f"{what} {path}: {step}: {len(keys)} {noun}{'s' if len(keys) > 1 else ''}, {ring}; {taken}"
          f"{separator}{after[step].format(flag=flag)}")  # fmt: skip


# ---- audit -------------------------------------------------------------------------------------


def _audit_key(args) -> bytes | None:
    if args.key_file:
        return Path(args.key_file).read_bytes().strip()
    if args.key_env:
        value = os.environ.get(args.key_env)
        if not value:
            _fail(f"environment variable {args.key_env} is not set")
        return value.encode()
    return None


def cmd_audit_verify(args) -> None:
    from aiworks.core.output import emit, plain
    from aiworks.security.audit import verify_audit_log

    redis_url = args.redis_url or os.environ.get("AIWORKS_AUDIT_REDIS_URL")
    if redis_url:
        if args.files or args.expect_head:
            _fail("give files or --redis-url, not both (the stream's heads replace --expect-head)")
        _verify_audit_stream(args, redis_url)
        return
    if not args.files:
        _fail("name the audit log file(s), or give --redis-url for the shared stream")
    result = verify_audit_log([Path(f) for f in args.files], key=_audit_key(args))
    lines, doc = [result.summary()], plain(result)
    cut = bool(args.expect_head and result.ok and result.head_hash != args.expect_head)
    if cut:
        why = (
            f"head hash {result.head_hash} is not the expected {args.expect_head}: "
            "lines were cut off the end, or the log was rewritten"
        )
        lines.append(f"FAILED: {why}")
        doc.update(ok=False, reason=why, expected_head=args.expect_head)
    emit(doc, args.output, lambda: "\n".join(lines))
    if cut or not result.ok:
        raise SystemExit(EXIT_FAILED_CHECK)


def _verify_audit_stream(args, url: str) -> None:
    import redis

    from aiworks.core.output import emit, plain
    from aiworks.security.audit_redis import verify_audit_stream

    try:
        result = verify_audit_stream(url, stream=args.stream, key=_audit_key(args))
    except redis.RedisError as exc:
        _fail(f"cannot read the audit stream {args.stream}: {exc}")
    doc = {"stream": result.stream, "ok": result.ok, "problems": result.problems,
           "writers": {w: plain(r) for w, r in result.writers.items()}}  # fmt: skip
    emit(doc, args.output, result.summary)
    if not result.ok:
        raise SystemExit(EXIT_FAILED_CHECK)


# ---- model -------------------------------------------------------------------------------------


def _data_key(args) -> bytes:
    from aiworks.security.model_keys import load_data_key, parse_data_key

    if args.key_file:
        return load_data_key(args.key_file)
    env = args.key_env or DEFAULT_KEY_ENV
    value = os.environ.get(env)
    if not value:
        _fail(f"no data key: pass --key-file, or set {env} (base64 key from `aiworks model keygen`)")
    return parse_data_key(value, f"${env}")


def _keyring(args, *, require_signature: bool = False):
    """Trusted public keys from --public-key, plus the data key when one is given."""
    from aiworks.security.model_keys import Keyring, data_key_id

    ring = Keyring.load(public_key_files=getattr(args, "public_key", None) or [], require_signature=require_signature)
    if args.key_file or args.key_env or os.environ.get(DEFAULT_KEY_ENV):
        key = _data_key(args)
        ring.data_keys[data_key_id(key)] = key
    return ring


def _guarded(func):
    """Run a model command, turning AIWorks errors into one line on stderr."""

    def run(args) -> None:
        from aiworks.core.errors import AIWorksError
        from aiworks.security.model_crypto import ModelIntegrityError
        from aiworks.security.watermark import WatermarkError

        try:
            func(args)
        except (ModelIntegrityError, WatermarkError) as exc:
            _fail(str(exc), EXIT_FAILED_CHECK)
        except AIWorksError as exc:
            _fail(str(exc))
        except OSError as exc:
            _fail(f"{exc.filename or ''}: {exc.strerror or exc}")

    return run


@_guarded
def cmd_model_keygen(args) -> None:
    from aiworks.security import model_keys as mk
    from aiworks.security.model_crypto import sm4_available

    out = Path(args.out)
    targets = [out, out.with_name(out.name + ".pub")] if args.kind == "signing" else [out]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not args.force:
        _fail(
            f"{', '.join(existing)} already exist(s); pass --force to replace (anything sealed with it becomes unreadable)"
        )
    if args.kind == "signing":
        pub, kid = mk.write_signing_key(out, mk.generate_signing_key())
        print(f"signing key {out} (mode 0600), public key {pub}, key id {kid}")
    else:
        algorithm = mk.SM4_GCM if args.kind == "sm4" else mk.AES_256_GCM
        if algorithm == mk.SM4_GCM and not sm4_available():
            _fail(f"{mk.SM4_GCM} is unavailable in this OpenSSL build; use an AES key")
        kid = mk.write_data_key(out, mk.generate_data_key(algorithm))
        print(f"{algorithm} data key {out} (mode 0600), key id {kid}")


@_guarded
def cmd_model_encrypt(args) -> None:
    from aiworks.security.model_crypto import encrypt_file

    dst = encrypt_file(args.file, args.out, key=_data_key(args), name=args.name, algorithm=args.algorithm)
    print(f"encrypted {args.file} -> {dst}")


@_guarded
def cmd_model_decrypt(args) -> None:
    from aiworks.security.model_crypto import ENC_SUFFIX, decrypt_file

    src = Path(args.file)
    out = args.out or (str(src)[: -len(ENC_SUFFIX)] if src.name.endswith(ENC_SUFFIX) else None)
    if not out:
        _fail("pass --out: the input does not end in .enc")
    if Path(out).exists() and not args.force:
        _fail(f"{out} exists; pass --force to replace it")
    decrypt_file(src, out, _keyring(args), name=args.name)
    print(f"decrypted {src} -> {out}")


@_guarded
def cmd_model_sign(args) -> None:
    from aiworks.security.model_crypto import sign_file
    from aiworks.security.model_keys import load_signing_key, public_key_id

    key = load_signing_key(args.signing_key)
    sig = sign_file(args.file, key, _keyring(args))
    covered = ", ".join(sorted(json.loads(sig.read_text())["files"]))
    print(f"signed {args.file} ({covered}) with key id {public_key_id(key.public_key())} -> {sig}")


@_guarded
def cmd_model_verify(args) -> None:
    from aiworks.security.model_crypto import open_model_checked

    opened = open_model_checked(args.file, _keyring(args, require_signature=True), name=args.name)
    state = "encrypted, decrypted and " if opened.encrypted else ""
    covered = f", covering {', '.join(opened.covered)}" if opened.covered else ""
    print(f"ok: {args.file} is {state}signed by trusted key {opened.signed_by} ({len(opened.data)} bytes{covered})")


@_guarded
def cmd_model_watermark_embed(args) -> None:
    from aiworks.security.watermark import watermark_file

    mark = watermark_file(args.file, args.out or args.file, args.owner, _data_key(args), replace=args.replace)
    print(f"watermarked {args.out or args.file} for owner {mark.owner!r} (weights sha256 {mark.weights_sha256})")


@_guarded
def cmd_model_watermark_check(args) -> None:
    from aiworks.security.watermark import check_file

    mark = check_file(args.file, _data_key(args), owner=args.owner)
    print(f"ok: {args.file} carries the watermark of {mark.owner!r} and its weights are unchanged")


# ---- parser ------------------------------------------------------------------------------------


def _key_options(p: argparse.ArgumentParser, what: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--key-file", help=f"file holding the base64 {what} (from `aiworks model keygen`)")
    g.add_argument("--key-env", help=f"environment variable holding the base64 {what} (default {DEFAULT_KEY_ENV})")


def add_security_parsers(sub, *, model_command: str = "model") -> None:
    """Register ``certs``, ``audit`` and the model-protection command (``model`` unless renamed)."""
    fmt = argparse.RawDescriptionHelpFormatter

    c = sub.add_parser(
        "certs",
        help="create a local CA and TLS certificates for the gateway and for internal mTLS",
        formatter_class=fmt,
        description="Create (or reuse) a local CA and issue ECDSA P-256 certificates signed by it.\n\n"
        "Writes OUT/ca.crt, OUT/ca.key (0600), and OUT/tls.crt + OUT/tls.key (0600) valid for the\n"
        "--hostname list. With --services, also OUT/<service>/{tls.crt,tls.key,ca.crt}, each valid\n"
        "for the hostnames plus the service's name, usable as server and as client (mTLS).\n"
        "An existing CA is reused, so certificates issued earlier stay valid; --force replaces it.\n"
        "Run it again over a running suite's folder to renew: each process takes its new certificate\n"
        "within 10 s, no restart (docs/security.md, \"Renewing certificates\").\n\n"
        "With --internal-token FILE, also FILE (0600): the installation's secret, which the control APIs'\n"
        "bearer tokens and plaintext callers' tokens derive from (kept when it exists).\n"
        "With --credential-key FILE, also FILE (0600): the key the gateway seals callers' credentials under\n"
        "while their batch jobs and asynchronous requests wait in Redis; the tiers' workers read it too.\n"
        "With --rotate-credential-key STEP, rotate FILE's keys instead (docs/tiers.md, \"Rotating the key\"):\n"
        "stage, promote, retire where several processes read it (each step taken by all, within 10 s,\n"
        "before the next); at-once where one machine's processes read one file. No restart.\n"
        "With --rotate-internal-token STEP, rotate the --internal-token FILE the same way (docs/security.md).\n"
        "Without --out-dir, only the secret files are written.\n\n"
        "  aiworks certs --out-dir certs --services gateway,scheduler,runtime,cache,monitor,admin\n"
        "  aiworks certs --credential-key .aiworks/credential-key --rotate-credential-key at-once",
    )
    c.add_argument("--out-dir", help="folder to write the certificates into (required unless only secret files "
                   "are asked for)")  # fmt: skip
    c.add_argument(
        "--hostname",
        action="append",
        help="DNS name or IP the certificates are valid for; repeat or comma-separate (default localhost,127.0.0.1)",
    )
    c.add_argument("--services", action="append", help="comma-separated services to issue mTLS certificates for")
    c.add_argument(
        "--internal-token", metavar="FILE", help="also write the installation's secret to FILE (0600; kept if present)"
    )
    c.add_argument(
        "--credential-key", metavar="FILE",
        help="also write the credential key (the tiers' sealed credentials) to FILE (0600; kept if present)",
    )  # fmt: skip
    c.add_argument(
        "--rotate-credential-key", metavar="STEP", choices=ROTATION_STEPS,
        help="rotate the keys in --credential-key FILE: stage (a new key that opens only), promote (it seals), "
        "retire (drop the older keys), at-once (stage and promote)",
    )  # fmt: skip
    c.add_argument(
        "--rotate-internal-token", metavar="STEP", choices=ROTATION_STEPS,
        help="rotate the secrets in --internal-token FILE: stage (a new secret, accepted only), promote (its token "
        "is presented), retire (drop the older secrets), at-once (stage and promote)",
    )  # fmt: skip
    c.add_argument("--ca-dir", help="keep ca.crt and ca.key here instead of --out-dir (keep the CA key off servers)")
    c.add_argument(
        "--force", action="store_true", help="replace an existing CA (every older certificate stops working)"
    )
    c.add_argument(
        "--if-missing", action="store_true",
        help="do nothing when OUT already holds every certificate asked for (a job that may run again)",
    )  # fmt: skip
    c.set_defaults(func=cmd_certs)

    a = sub.add_parser("audit", help="work with the hash-chained audit log")
    a_sub = a.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    v = a_sub.add_parser(
        "verify",
        help="check that no audit line was edited, removed, inserted or reordered",
        formatter_class=fmt,
        description="Walk the hash chain of one audit log, or of rotated files given oldest first.\n"
        "Prints the head (last seq and hash) when intact, else the first bad line and why.\n"
        "Exit status 0: intact; 1: tampered. Lines cut off the end are only caught with --expect-head.\n"
        "With --redis-url: the shared stream the replicas write to (audit_sink redis), each writer's chain,\n"
        "and each writer's head, so records cut off the end are caught too.",
    )
    v.add_argument("files", nargs="*", metavar="FILE", help="audit log file(s), oldest first")
    v.add_argument("--redis-url", help="verify the Redis Stream at this URL instead of files (the password from "
                   "the URL; prefer AIWORKS_AUDIT_REDIS_URL in the environment to keep it out of `ps`)")  # fmt: skip
    v.add_argument("--stream", default="aiworks:audit", help="the stream's key (default: %(default)s)")
    g = v.add_mutually_exclusive_group()
    g.add_argument("--key-file", help="file holding the audit HMAC key, if the log was written with one")
    g.add_argument("--key-env", help="environment variable holding the audit HMAC key")
    v.add_argument("--expect-head", metavar="HASH", help="hash the last line must have (recorded earlier)")
    add_output_flag(v)
    v.set_defaults(func=cmd_audit_verify)

    m = sub.add_parser(
        model_command,
        help="encrypt, sign and watermark model files",
        formatter_class=fmt,
        description="Protect model files at rest and prove where they came from.\n\n"
        f"  aiworks {model_command} keygen --kind aes --out ~/.aiworks/model.key\n"
        f"  aiworks {model_command} keygen --kind signing --out ~/.aiworks/signing.key\n"
        f"  aiworks {model_command} sign model.onnx --signing-key ~/.aiworks/signing.key\n"
        f"  aiworks {model_command} encrypt model.onnx --key-file ~/.aiworks/model.key\n"
        f"  aiworks {model_command} verify model.onnx.enc --key-file ~/.aiworks/model.key "
        "--public-key ~/.aiworks/signing.key.pub",
    )
    m_sub = m.add_subparsers(dest="model_action", metavar="ACTION", required=True)

    kg = m_sub.add_parser("keygen", help="create a data key (AES-256 or SM4) or an Ed25519 signing key pair")
    kg.add_argument("--kind", choices=["aes", "sm4", "signing"], default="aes", help="key to create (default aes)")
    kg.add_argument("--out", required=True, help="key file (0600); a signing key also writes OUT.pub")
    kg.add_argument("--force", action="store_true", help="replace an existing key file")
    kg.set_defaults(func=cmd_model_keygen)

    en = m_sub.add_parser("encrypt", help="encrypt a model file with AES-256-GCM (or SM4-GCM)")
    en.add_argument("file", help="plaintext model file")
    en.add_argument("--out", help="encrypted file (default FILE.enc)")
    en.add_argument(
        "--name",
        help="name bound into the file (default its file name); e.g. digits/1/model.onnx also stops cross-model swaps",
    )
    en.add_argument("--algorithm", choices=["AES-256-GCM", "SM4-GCM"], default="AES-256-GCM")
    _key_options(en, "data key")
    en.set_defaults(func=cmd_model_encrypt)

    de = m_sub.add_parser("decrypt", help="decrypt a model file (written only if it authenticates)")
    de.add_argument("file", help="encrypted model file")
    de.add_argument("--out", help="plaintext file (default FILE without .enc)")
    de.add_argument("--name", help="expected bound name (default: checked against FILE's path)")
    de.add_argument("--force", action="store_true", help="replace --out if it exists")
    _key_options(de, "data key")
    de.set_defaults(func=cmd_model_decrypt)

    sg = m_sub.add_parser(
        "sign",
        help="sign every file a model reads (its plaintext, external data, config) with Ed25519, writing MODEL.sig",
    )
    sg.add_argument("file", help="model file (an encrypted one is decrypted in memory first: pass its data key)")
    sg.add_argument("--signing-key", required=True, help="Ed25519 private key file from `keygen --kind signing`")
    _key_options(sg, "data key")
    sg.set_defaults(func=cmd_model_sign)

    ve = m_sub.add_parser(
        "verify", help="decrypt (if encrypted) and check the signature exactly as the runtime does at load time"
    )
    ve.add_argument("file", help="model file, plain or encrypted")
    ve.add_argument(
        "--public-key", action="append", required=True, help="trusted Ed25519 public key file; repeat for several"
    )
    ve.add_argument("--name", help="expected bound name of an encrypted file")
    _key_options(ve, "data key")
    ve.set_defaults(func=cmd_model_verify)

    wm = m_sub.add_parser("watermark", help="embed or check an owner fingerprint in an ONNX model's metadata")
    wm_sub = wm.add_subparsers(dest="watermark_action", metavar="ACTION", required=True)
    we = wm_sub.add_parser("embed", help="add the owner's fingerprint (HMAC of the weights) to metadata_props")
    we.add_argument("file", help="ONNX model")
    we.add_argument("--owner", required=True, help="owner id stored in the model")
    we.add_argument("--out", help="watermarked model (default: FILE, in place)")
    we.add_argument("--replace", action="store_true", help="overwrite another owner's watermark")
    _key_options(we, "owner key")
    we.set_defaults(func=cmd_model_watermark_embed)
    wc = wm_sub.add_parser("check", help="check the fingerprint: fails if missing, another owner's, or weights changed")
    wc.add_argument("file", help="ONNX model")
    wc.add_argument("--owner", help="owner id the watermark must name")
    _key_options(wc, "owner key")
    wc.set_defaults(func=cmd_model_watermark_check)
