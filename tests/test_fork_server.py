"""Warm restarts without torchrun: a fork server that preloads only ``json``, and the stdlib client.

A worker run through the client must look to torchrun exactly like one it started itself: the same
exit code, death by the same signal, SIGTERM reaching the worker, the worker gone when torchrun
SIGKILLs the client, and a cold start when there is no server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer.rundir import RunDir
from trainer.runtime.agents import worker_pid
from trainer.runtime.fork_client import SOCKET_ENV
from trainer.runtime.fork_server import SHARED_ENV, ForkServer, env_differences, socket_path
from trainer.runtime.launch import run_agents, through_fork_client, torchrun_command

pytestmark = pytest.mark.cold  # the fork server under test is the per-run one

WAIT_S = 30.0
# One script for every case: argv[1] says what the worker does once it reports its pid.
WORKER = """
import os, signal, sys, time
print("worker", os.getpid(), os.getcwd(), os.environ.get("TESSERA_TEST_VALUE"), sys.argv[1:], flush=True)
action = sys.argv[1]
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "signal":
    os.kill(os.getpid(), int(sys.argv[2]))
if action == "term":
    signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM: stopping", flush=True), sys.exit(6)))
    print("ready", flush=True)
if action in ("term", "sleep"):
    time.sleep(WAIT)
if action == "raise":
    raise RuntimeError("boom")
if action == "interrupt":
    raise KeyboardInterrupt
if action == "finish":
    import atexit, threading
    atexit.register(print, "atexit ran", flush=True)
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
    sys.exit("a message")
""".replace("WAIT", str(WAIT_S))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    with ForkServer(tmp_path_factory.mktemp("fork"), dict(os.environ), preload=("json",)) as served:
        yield served


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def client(socket: Path | str, *argv: str, cwd: Path) -> subprocess.Popen[str]:
    """The client as torchrun starts a worker: its own session, output piped to the agent."""
    env = {**os.environ, SOCKET_ENV: str(socket), "TESSERA_TEST_VALUE": "from-the-client"}
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "trainer.runtime.fork_client", *argv],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def first_line(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    return proc.stdout.readline().split()


def test_worker_runs_with_the_clients_argv_env_cwd_and_exit_code(
    server: ForkServer, script: Path, tmp_path: Path
) -> None:
    proc = client(server.path, str(script), "exit", "7", cwd=tmp_path)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 7, err
    word, pid, cwd, value, *_ = out.split()
    assert (word, cwd, value) == ("worker", str(tmp_path), "from-the-client")
    assert int(pid) != proc.pid and "['exit', '7']" in out  # forked by the server, not this process
    assert "directly" not in err


def test_module_runs_as_main(server: ForkServer, tmp_path: Path) -> None:
    proc = client(server.path, "-m", "json.tool", "--help", cwd=tmp_path)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    assert out.startswith("usage: python -m json.tool")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV])
def test_death_by_a_signal_is_mirrored(server: ForkServer, script: Path, tmp_path: Path, signum: int) -> None:
    proc = client(server.path, str(script), "signal", str(signum), cwd=tmp_path)
    proc.communicate(timeout=WAIT_S)
    assert proc.returncode == -signum  # what torchrun reports as "exitcode: -9"


@pytest.mark.parametrize("action", ["raise", "interrupt", "finish"])
def test_worker_ends_as_a_directly_started_one(
    server: ForkServer, script: Path, tmp_path: Path, action: str
) -> None:
    """Uncaught exception, KeyboardInterrupt (death by SIGINT), SystemExit with a message after a
    non-daemon thread and an atexit handler: same code and output as ``python -u SCRIPT``."""
    direct = subprocess.run(
        [sys.executable, "-u", str(script), action], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    proc = client(server.path, str(script), action, cwd=tmp_path)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == direct.returncode
    assert out.splitlines()[1:] == direct.stdout.splitlines()[1:]  # the first line has the pid
    assert err.splitlines()[-1] == direct.stderr.splitlines()[-1]


def test_sigterm_to_the_client_reaches_the_worker(server: ForkServer, script: Path, tmp_path: Path) -> None:
    proc = client(server.path, str(script), "term", cwd=tmp_path)
    worker = int(first_line(proc)[1])
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    assert worker_pid(proc.pid) == worker  # how the fault tests find the process that trains
    os.killpg(proc.pid, signal.SIGTERM)  # as torchrun stops its workers
    out, err = proc.communicate(timeout=WAIT_S)
    assert "SIGTERM: stopping" in out and proc.returncode == 6, err


def test_killing_the_client_kills_the_worker(server: ForkServer, script: Path, tmp_path: Path) -> None:
    proc = client(server.path, str(script), "sleep", cwd=tmp_path)
    worker = int(first_line(proc)[1])
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not Path(f"/proc/{worker}").exists()  # SIGKILLed and reaped by the server


def test_without_a_server_the_worker_starts_directly(script: Path, tmp_path: Path) -> None:
    proc = client(tmp_path / "no-server.sock", str(script), "exit", "3", cwd=tmp_path)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 3
    assert out.split()[1] == str(proc.pid)  # exec'd in place
    assert err.count("\n") == 1 and "starting the worker directly" in err


def test_stopped_server_leaves_no_process_nor_socket(tmp_path: Path) -> None:
    server = ForkServer(tmp_path, dict(os.environ), preload=())
    assert server.path.exists()  # listening once started
    server.stop()
    assert server.proc.returncode == 0 and not server.path.exists()


def test_socket_path_falls_back_to_tmp_when_too_long(tmp_path: Path) -> None:
    assert socket_path(tmp_path) == tmp_path.resolve() / "fork.sock"
    deep = tmp_path / ("d" * 120)
    assert socket_path(deep).parent == Path("/tmp") and len(str(socket_path(deep))) < 107


def test_warm_restart_puts_the_client_before_the_entry(tmp_path: Path) -> None:
    job = str(tmp_path / "job.json")
    command = torchrun_command(Path(job), tmp_path, 2, warm_restart=True)
    entry = ["-m", "trainer.train", "--job", job, "--run-dir", str(tmp_path)]
    assert command[-8:] == ["-m", "trainer.runtime.fork_client", *entry]
    assert torchrun_command(Path(job), tmp_path, 2)[-6:] == entry


@pytest.mark.slow
def test_launcher_serves_warm_commands_and_stops_its_server(script: Path, tmp_path: Path) -> None:
    """run_agents starts the fork server (preloading the trainer: ~7 s) for a command whose worker
    entry is the client, and leaves neither it nor its socket behind."""
    lines: list[str] = []
    command = [sys.executable, "-m", "trainer.runtime.fork_client", str(script), "exit", "0"]
    result = run_agents([command], dict(os.environ), RunDir(tmp_path / "run"), echo=lines.append)
    assert result.returncode == 0, result.log_tail
    assert lines[0].startswith("worker") and not any("directly" in line for line in lines), lines
    served = str(socket_path(tmp_path / "run")).encode()
    assert not Path(served.decode()).exists()
    assert not [proc for proc in Path("/proc").glob("[0-9]*") if served in _cmdline(proc)]


def _cmdline(proc: Path) -> list[bytes]:
    try:
        return (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def test_a_worker_whose_import_time_environment_differs_starts_cold(
    server: ForkServer, script: Path, tmp_path: Path
) -> None:
    """A fork keeps what torch read at import (its OpenMP thread count, say): a worker that asks for
    another value gets a cold start, and one line that says why, rather than the server's."""
    env = {**os.environ, SOCKET_ENV: str(server.path), "OMP_NUM_THREADS": "3"}
    proc = subprocess.run(
        [sys.executable, "-u", "-m", "trainer.runtime.fork_client", str(script), "exit", "4"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert proc.returncode == 4
    assert "refused: OMP_NUM_THREADS differ" in proc.stderr and "starting the worker directly" in proc.stderr
    assert (
        env_differences({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "a"}, {"OMP_NUM_THREADS": "1"}) == []
    )
    assert env_differences({}, {"TORCHINDUCTOR_CACHE_DIR": "/x", "TORCH_LOGS": "+dynamo"}) == [
        "TORCHINDUCTOR_CACHE_DIR",
        "TORCH_LOGS",
    ]


@pytest.mark.slow  # two torchrun agents
def test_a_shared_server_serves_every_launch_and_outlives_it(
    server: ForkServer, script: Path, tmp_path: Path
) -> None:
    """With ``$TESSERA_FORK_SERVER`` the launcher forks each worker from that server (no server of its
    own, no socket in the run directory) and leaves it running for the next launch."""
    lines: list[str] = []
    env = {**os.environ, SHARED_ENV: str(server.path)}
    for run in ("a", "b"):
        command = torchrun_command(Path(), Path(), 1, entry=[str(script), "exit", "0"])
        result = run_agents([command], env, RunDir(tmp_path / run), echo=lines.append)
        assert result.returncode == 0, result.log_tail
        assert not socket_path(tmp_path / run).exists()
    workers = [line.split() for line in lines if line.startswith("worker")]
    assert len(workers) == 2 and not any("directly" in line for line in lines), lines
    assert server.proc.poll() is None  # still serving
    assert through_fork_client(command) == through_fork_client(through_fork_client(command))
