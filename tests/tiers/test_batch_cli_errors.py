"""`aiworks batch` when things go wrong outside it: a gateway it cannot reach is one line naming the URL and
why; a reader that leaves its output early (`| head`) ends it quietly. Both were Python tracebacks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RESULT_BYTES = 8 << 20  # far more than a pipe holds: the writer meets the closed pipe


class _Gateway(BaseHTTPRequestHandler):
    """A finished job, and its output file of RESULT_BYTES."""

    def do_GET(self) -> None:  # noqa: N802 - the handler's protocol
        if self.path == "/v1/batches/batch_1":
            body = json.dumps({"id": "batch_1", "status": "completed", "output_file_id": "file-out"}).encode()
        else:
            body = b'{"line": 1}\n' * (RESULT_BYTES // 12)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args) -> None:
        pass


def _aiworks(*args: str, **options) -> subprocess.CompletedProcess:
    env = {**os.environ, "AIWORKS_API_KEY": "aiw_not_a_real_key"}
    return subprocess.run([sys.executable, "-m", "aiworks", *args], env=env, timeout=60, **options)


def test_a_gateway_it_cannot_reach_is_one_line_naming_it():
    with socket.socket() as held:  # bound, never listening: connections to it are refused
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        for argv in (["status", "batch_1"], ["cancel", "batch_1"], ["files"]):
            done = _aiworks("batch", *argv, "-u", url, capture_output=True, text=True)
            assert done.returncode == 1, (argv, done.stderr)
            assert done.stderr.strip() == f"error: cannot reach the gateway at {url}: Connection refused", done.stderr


def test_a_reader_that_leaves_early_ends_it_quietly():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reader, writer = os.pipe()
        process = subprocess.Popen([sys.executable, "-m", "aiworks", "batch", "results", "batch_1", "-u", url],
                                   stdout=writer, stderr=subprocess.PIPE,
                                   env={**os.environ, "AIWORKS_API_KEY": "aiw_not_a_real_key"})  # fmt: skip
        os.close(writer)
        assert os.read(reader, 12) == b'{"line": 1}\n'  # `| head -1`: one line read, then gone
        os.close(reader)
        _, err = process.communicate(timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert process.returncode == 1
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
