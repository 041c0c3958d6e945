"""The storage initializer (`aiworks storage fetch`) against real servers on loopback: SeaweedFS's S3
gateway (signatures checked), fake-gcs-server's JSON API, an HTTPS server with the suite's own CA,
a PVC-like folder and the built-in demo source."""

from __future__ import annotations

import http.server
import io
import json
import os
import ssl
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from aiworks.core.errors import InvalidArgument, NotFound, PermissionDenied
from aiworks.security.certs import write_certificates
from aiworks.storage.fetch import MARKER, fetch_model

from .storage_servers import FakeGCS, SeaweedS3

CONFIG = 'name: "tiny"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A model in Triton's layout: config.pbtxt and two version folders."""
    root = tmp_path_factory.mktemp("src") / "tiny"
    (root / "1").mkdir(parents=True)
    (root / "2").mkdir()
    (root / "config.pbtxt").write_text(CONFIG)
    (root / "1" / "model.onnx").write_bytes(os.urandom(300_000))
    (root / "2" / "model.onnx").write_bytes(os.urandom(1000))
    return root


def tar_gz(folder: Path, arcname: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(folder, arcname=arcname)
    return buffer.getvalue()


def same_tree(a: Path, b: Path) -> bool:
    files_a = {p.relative_to(a): p.read_bytes() for p in a.rglob("*") if p.is_file() and p.name != MARKER}
    files_b = {p.relative_to(b): p.read_bytes() for p in b.rglob("*") if p.is_file() and p.name != MARKER}
    return files_a == files_b and len(files_a) == 3


@pytest.fixture(scope="module")
def s3(tmp_path_factory, model_folder: Path):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    server.start()
    server.put_tree(model_folder, "team/tiny")
    server.put("archives/tiny.tar.gz", tar_gz(model_folder, "tiny"))
    try:
        yield server
    finally:
        server.stop()


def test_s3_folder_and_archive(s3: SeaweedS3, model_folder: Path, tmp_path: Path, monkeypatch) -> None:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    result = fetch_model("s3://models/team/tiny", "tiny", tmp_path / "repo")
    assert result.files == 3 and same_tree(model_folder, tmp_path / "repo" / "tiny")
    # The same URI again: kept, not fetched.
    assert fetch_model("s3://models/team/tiny", "tiny", tmp_path / "repo").skipped
    # One archive holding a folder named after the model.
    archived = fetch_model("s3://models/archives/tiny.tar.gz", "other", tmp_path / "repo")
    assert not archived.skipped and same_tree(model_folder, tmp_path / "repo" / "other")
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["other", "tiny"], "no temporary folder left"


def test_s3_refuses_a_wrong_secret_and_names_missing_models(s3: SeaweedS3, tmp_path: Path, monkeypatch) -> None:
    for key, value in s3.env(AWS_SECRET_ACCESS_KEY="not-the-secret").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(PermissionDenied, match="AWS_SECRET_ACCESS_KEY"):
        fetch_model("s3://models/team/tiny", "tiny", tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env()["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(NotFound, match="no objects under s3://models/team/absent/"):
        fetch_model("s3://models/team/absent", "tiny", tmp_path)
    assert not (tmp_path / "tiny").exists()


def test_cli_fetches_from_s3_as_an_init_container_would(s3: SeaweedS3, tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], **s3.env()}
    command = [sys.executable, "-m", "aiworks", "storage", "fetch", "s3://models/team/tiny", "--model", "tiny",
               "--repository", str(tmp_path), "-o", "json"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "model": "tiny", "uri": "s3://models/team/tiny", "path": str(tmp_path / "tiny"), "files": 3,
        "bytes": 301_000 + len(CONFIG), "skipped": False,
    }  # fmt: skip
    env["AWS_ACCESS_KEY_ID"] = "AKIDUNKNOWN"
    done = subprocess.run([*command[:-2], "--force"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "S3 refused (403" in done.stderr


def test_gcs_folder_and_archive(tmp_path: Path, model_folder: Path, monkeypatch) -> None:
    server = FakeGCS(tmp_path / "gcs")
    bucket = server.data / "weights"
    import shutil

    shutil.copytree(model_folder, bucket / "prod" / "tiny")
    (bucket / "tiny.tgz").write_bytes(tar_gz(model_folder, "tiny"))
    server.start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
        fetch_model("gs://weights/prod/tiny", "tiny", tmp_path / "repo")
        assert same_tree(model_folder, tmp_path / "repo" / "tiny")
        fetch_model("gs://weights/tiny.tgz", "packed", tmp_path / "repo")
        assert same_tree(model_folder, tmp_path / "repo" / "packed")
        with pytest.raises(NotFound):
            fetch_model("gs://no-such-bucket/x", "tiny", tmp_path / "repo2")
    finally:
        server.stop()


@pytest.fixture
def https_server(tmp_path: Path, model_folder: Path):
    """An HTTPS file server whose certificate the suite's own CA signs."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "tiny.tar.gz").write_bytes(tar_gz(model_folder, "tiny"))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for path in model_folder.rglob("*"):
            if path.is_file():
                z.write(path, path.relative_to(model_folder).as_posix())
    (site / "tiny.zip").write_bytes(buffer.getvalue())
    certs = write_certificates(tmp_path / "certs", ["127.0.0.1"])
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(site), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.server_dir / "tls.crt", certs.server_dir / "tls.key")
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{httpd.server_address[1]}", str(certs.ca_cert)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_https_archives_with_a_private_ca(https_server, model_folder: Path, tmp_path: Path) -> None:
    url, ca = https_server
    fetch_model(f"{url}/tiny.tar.gz", "tiny", tmp_path / "repo", ca_file=ca)
    assert same_tree(model_folder, tmp_path / "repo" / "tiny")
    fetch_model(f"{url}/tiny.zip", "zipped", tmp_path / "repo", ca_file=ca)
    assert same_tree(model_folder, tmp_path / "repo" / "zipped")
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        fetch_model(f"{url}/tiny.zip", "untrusted", tmp_path / "repo")
    with pytest.raises(NotFound):
        fetch_model(f"{url}/absent.tar.gz", "absent", tmp_path / "repo", ca_file=ca)
    with pytest.raises(InvalidArgument, match="must be an archive"):
        fetch_model(f"{url}/tiny", "tiny", tmp_path / "repo", ca_file=ca)


def test_pvc_and_hostile_archives(model_folder: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(model_folder, tmp_path / "pvc" / "models-claim" / "release-3" / "tiny")
    fetch_model("pvc://models-claim/release-3/tiny", "tiny", tmp_path / "repo", pvc_root=tmp_path / "pvc")
    assert same_tree(model_folder, tmp_path / "repo" / "tiny")
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../../escaped")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    with pytest.raises(Exception, match="outside|escaped"):
        fetch_model(evil.as_uri(), "tiny2", tmp_path / "repo")
    linked = tmp_path / "link.tar.gz"
    with tarfile.open(linked, "w:gz") as tar:
        info = tarfile.TarInfo("tiny/passwd")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(InvalidArgument, match="link"):
        fetch_model(linked.as_uri(), "tiny3", tmp_path / "repo")
    assert not (tmp_path / "escaped").exists()
    with pytest.raises(InvalidArgument, match="not a model name"):
        fetch_model("demo", "../x", tmp_path / "repo")
    with pytest.raises(InvalidArgument, match="unknown scheme"):
        fetch_model("ftp://host/x", "x", tmp_path / "repo")


def test_demo_source_builds_the_named_model(tmp_path: Path) -> None:
    result = fetch_model("demo", "iris", tmp_path)
    assert (tmp_path / "iris" / "config.pbtxt").read_text().startswith('name: "iris"')
    assert (tmp_path / "iris" / "1" / "model.onnx").stat().st_size > 100
    assert result.files == 2
    with pytest.raises(NotFound, match="demo models are iris, digits"):
        fetch_model("demo", "resnet", tmp_path)
