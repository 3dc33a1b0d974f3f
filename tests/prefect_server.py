"""Prefect servers for tests, registered in ``tests/conftest.py``.

- ``prefect_harness`` (session): Prefect's in-process test harness (temporary SQLite server), for
  calling tasks and flows directly. ~8 s to start, once per session.
- ``prefect_server`` (session): a real ``prefect server start`` subprocess on 127.0.0.1 with its own
  ``PREFECT_HOME``; yields its API URL. Subprocesses (``prefect deploy``, workers) reach it through
  :func:`server_env`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.register import REPO_ROOT

STARTUP_TIMEOUT_S = 120  # ~11 s on an idle machine; the CI box is shared
# A busy box stalls SQLite past Prefect's defaults (10 s per query, 5 s to connect), and the server then
# answers 503 to a healthy request (seen on create_flow_run at a load average of 27): the tests' servers
# wait as long as a test would, rather than fail a healthy run.
DATABASE_TIMEOUTS = {
    "PREFECT_SERVER_DATABASE_TIMEOUT": "120",
    "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": "60",
}


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"  # avoids SQLite "database is locked" noise
    os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"  # tasks called outside a flow
    os.environ.update(DATABASE_TIMEOUTS)
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=STARTUP_TIMEOUT_S):
        yield


def server_env(api_url: str, home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        **DATABASE_TIMEOUTS,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# A real process worker for the CPU pool, as a user starts one.
CPU_WORKER = [
    sys.executable,
    "-m",
    "prefect",
    "worker",
    "start",
    "--pool",
    "tessera-cpu",
    "--type",
    "process",
]


def start_process(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start a server or worker from the repo root in its own session, its output in ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            args, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``: servers and workers never outlive a test."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(api_url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"prefect server not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log = home / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=server_env(api_url, home),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(api_url, proc, log)
        yield api_url
    finally:
        stop_process(proc)
