"""Real object-store servers on 127.0.0.1 for tests: a GCS emulator and moto's S3 server.

Registered in ``tests/conftest.py`` (``pytest_plugins = ["tests.stores"]``), so any test can ask for:

- ``gcs_bucket`` (session): ``"gs://tessera-test"`` on ``gcp-storage-emulator`` (in memory). Sets
  ``STORAGE_EMULATOR_HOST`` and ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` for the session, so
  plain ``gcsfs``/``fsspec`` calls (and subprocesses such as torchrun workers) reach the emulator.
- ``s3_bucket`` (session): ``"s3://tessera-test"`` on ``moto_server``. Sets ``AWS_ENDPOINT_URL`` and
  dummy ``AWS_*`` credentials for the session, so plain ``s3fs``/``boto3`` calls reach moto.
- ``flaky_s3_bucket`` (function): a :class:`FlakyStore` whose ``url`` is an ``s3://`` bucket reached
  through :class:`FlakyProxy`, an HTTP proxy that answers every Nth request with 503; ``.proxy.failures``
  counts the injected errors. ``AWS_ENDPOINT_URL`` points at the proxy for the test only.

Each test should write under its own prefix (e.g. ``f"{gcs_bucket}/{test_name}"``): buckets are
shared by the session. Servers are started once, waited for, and terminated at session end.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal

# Set before anything imports gcsfs: its bucket-type probe over gRPC hangs ~60 s per call on the emulator.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import fsspec
import pytest

BUCKET = "tessera-test"
# Seconds for an emulator (moto, the GCS emulator) to listen: ~2 s on an idle machine, but each imports
# its whole package, and on a shared 2-core box at a load of 10-20 that is many times slower.
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, name: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode} before listening on port {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{name} did not listen on 127.0.0.1:{port} within {STARTUP_TIMEOUT_S:.0f}s")


def _executable(name: str) -> str:
    """The console script next to this interpreter (the venv), else on PATH."""
    local = Path(sys.executable).with_name(name)
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return found


@pytest.fixture(scope="session")
def _server() -> Iterator[Callable[[list[str], int, str], None]]:
    """Start a server process, wait for its port; terminate every one at session end."""
    processes: list[subprocess.Popen] = []

    def start(args: list[str], port: int, name: str) -> None:
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        processes.append(process)
        wait_for_port(port, process, name)

    yield start
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def gcs_bucket(_server: Callable[[list[str], int, str], None]) -> Iterator[str]:
    port = free_port()
    _server(
        [
            _executable("gcp-storage-emulator"),
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
            "--default-bucket",
            BUCKET,
        ],
        port,
        "gcp-storage-emulator",
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        env.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        _clear_fsspec_cache()
        yield f"gs://{BUCKET}"
    _clear_fsspec_cache()


@pytest.fixture(scope="session")
def _moto_endpoint(_server: Callable[[list[str], int, str], None]) -> Iterator[str]:
    port = free_port()
    _server([_executable("moto_server"), "-H", "127.0.0.1", "-p", str(port)], port, "moto_server")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        _clear_fsspec_cache()
        import s3fs

        s3fs.S3FileSystem().mkdir(BUCKET)
        yield f"http://127.0.0.1:{port}"
    _clear_fsspec_cache()


@pytest.fixture(scope="session")
def s3_bucket(_moto_endpoint: str) -> str:
    return f"s3://{BUCKET}"


class FlakyProxy(ThreadingHTTPServer):
    """Forwards HTTP requests to ``upstream``, failing every ``fail_every``-th one instead with
    ``fault``: a 503, a 403, or a ``reset`` (the connection dropped with a TCP RST, no response)."""

    daemon_threads = True

    def __init__(self, upstream: str, fail_every: int) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.fail_every = fail_every
        self.fault: Literal["503", "403", "reset"] = "503"  # 403 with fail_every=1: a permanent error
        self.requests = 0
        self.failures = 0
        self._lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _ProxyHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def should_fail(self) -> bool:
        with self._lock:
            self.requests += 1
            fail = self.requests % self.fail_every == 0
            self.failures += fail
            return fail


_ERROR_CODES = {503: "ServiceUnavailable", 403: "AccessDenied"}


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FlakyProxy

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.server.should_fail():
            if self.server.fault == "reset":
                # SO_LINGER 0: close() sends RST, what a crashed load balancer or a dropped flow looks like
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
                return
            status = int(self.server.fault)
            payload = (
                f"<Error><Code>{_ERROR_CODES[status]}</Code><Message>injected</Message></Error>".encode()
            )
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":  # a body after a HEAD response would corrupt the connection
                self.wfile.write(payload)
            return
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=30)
        headers = {
            k: v for k, v in self.headers.items() if k.lower() not in ("connection", "transfer-encoding")
        }
        upstream.request(self.command, self.path, body=body, headers=headers)
        response = upstream.getresponse()
        data = response.read()
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("connection", "transfer-encoding", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        upstream.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, *args: object) -> None:
        """Quiet: the test asserts on counters, not on logs."""


@dataclass
class FlakyStore:
    url: str
    proxy: FlakyProxy


@pytest.fixture
def flaky_s3_bucket(_moto_endpoint: str, s3_bucket: str) -> Iterator[FlakyStore]:
    proxy = FlakyProxy(_moto_endpoint, fail_every=4)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", proxy.url)
        # botocore would retry the 503s itself (with ~1 s backoffs); leave the retrying to the code under test.
        env.setenv("AWS_MAX_ATTEMPTS", "1")
        _clear_fsspec_cache()
        yield FlakyStore(s3_bucket, proxy)
    _clear_fsspec_cache()
    proxy.shutdown()
    proxy.server_close()
    thread.join()


def _clear_fsspec_cache() -> None:
    """fsspec caches filesystem instances per constructor args: drop them so new env takes effect."""
    for protocol in ("gs", "s3"):  # by class: an instance made directly (s3fs.S3FileSystem()) is cached too
        fsspec.get_filesystem_class(protocol).clear_instance_cache()
