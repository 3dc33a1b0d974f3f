"""Warm restarts: a per-host server that imports torch and the trainer once and forks each worker.

Starting a worker process costs ~7 s on a small CPU host, nearly all of it imports (torch, DCP,
DTensor, sympy, pipelining); restoring from host memory then takes under a second. torchrun restarts
every worker of the group after any failure, so with ``faults.warm_restart`` each worker entry is
:mod:`trainer.runtime.fork_client`, a stdlib-only stand-in that has this server fork the real worker::

    python -m trainer.runtime.fork_server --socket PATH [--preload trainer.train]   # the launcher starts it

One server may also serve every local launch of a host (``TESSERA_FORK_SERVER``, see
:func:`trainer.runtime.launch.run_agents`): a user or a test session starts it once, and each rank of
each run is forked from it instead of importing torch again. A fork keeps what the server's imports
read from the environment, so the server refuses (and the client starts the worker cold) a request
whose value differs for any variable in :data:`IMPORT_TIME_ENV`.

The server imports the modules and runs no torch op: torch's thread pools do not exist yet when it
forks (OpenBLAS's, started by numpy's import, shuts down and restarts around a fork by itself).
A forked worker takes its client's stdio, environment, working directory and argv, leads a session
of its own (as torchrun's workers do), dies with the server (``PR_SET_PDEATHSIG``) and is SIGKILLed
when its client's connection closes. It ends as the interpreter would, minus the teardown of every
module (:func:`_exit_status`); the server reports how, and the client mirrors it. On
SIGTERM (the launcher's stop, or its death) the server stops accepting, removes its socket, waits for
the workers it forked and exits.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from trainer.runtime.agents import terminate_with_parent
from trainer.runtime.fork_client import SOCKET_ENV

PRELOAD = ("trainer.train",)  # everything a worker imports comes with it
SHARED_ENV = "TESSERA_FORK_SERVER"  # a host-wide server's socket: every local launch forks from it
# What torch, its OpenMP runtime and the other preloaded packages read from the environment once, at
# import or load: a worker forked from a server that saw other values would not be the worker a cold
# start makes (its thread count, its logging, its compile caches). Names, and prefixes ending in "_".
IMPORT_TIME_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "PYTHONHASHSEED",
    "TORCH_LOGS",
    "TORCH_TRACE",
    "TORCH_COMPILE_",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
    "FSSPEC_CONFIG_DIR",
    "WDS_",
    "SYMPY_",
)
STOP_WAIT_S = 10.0  # the workers are gone when the launcher stops the server: it only has to exit
REQUEST_TIMEOUT_S = 5.0
LISTEN_WAIT_S = 10.0  # else the workers start cold (the client falls back)
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, one of them the terminating NUL


def socket_path(run_dir: Path) -> Path:
    """``fork.sock`` in the run directory, or a path under /tmp named after it when that is too long."""
    path = run_dir.resolve() / "fork.sock"
    if len(str(path).encode()) <= _MAX_SOCKET_PATH:
        return path
    return Path("/tmp", f"tessera-fork-{hashlib.sha256(str(path).encode()).hexdigest()[:16]}.sock")


class ForkServer:
    """The launcher's handle on one fork server: started before the agents, stopped after them."""

    def __init__(self, run_dir: Path, env: dict[str, str], preload: tuple[str, ...] = PRELOAD) -> None:
        self.path = socket_path(run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a killed server's: its existence means "listening" below
        args = [sys.executable, "-m", "trainer.runtime.fork_server", "--socket", str(self.path)]
        # The workers' environment: what torch reads at import time is what a cold worker would see.
        self.proc = subprocess.Popen(
            [*args, *(f"--preload={module}" for module in preload)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=terminate_with_parent,  # a launcher killed outright leaves no server behind
        )
        # Listening takes ~0.1 s, the imports seconds more: clients connecting meanwhile wait for them.
        deadline = time.monotonic() + LISTEN_WAIT_S
        while not self.path.exists() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        self.env = {SOCKET_ENV: str(self.path)}

    def stop(self) -> None:
        """SIGTERM (it exits once its workers have), SIGKILL if it lingers; remove the socket."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@dataclass
class Request:
    """What a client sends: the worker's argv (after ``python``), environment, cwd and stdio fds."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int]
    signals: bytes = b""  # signal numbers the client forwarded before the worker existed


@dataclass
class _Worker:
    pid: int
    conn: socket.socket | None  # None once the client is gone


class _Server:
    """One thread, one selector: the listening socket, the clients' connections and SIGCHLD."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pid = os.getpid()
        self.env = dict(os.environ)  # what the preloaded modules read as they were imported
        self.stopping = False
        self.workers: dict[int, _Worker] = {}
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a killed server's
        self.listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(128)
        self.wake, wake_writer = socket.socketpair()
        self._wake_writer = wake_writer
        for end in (self.wake, wake_writer):
            end.setblocking(False)
        signal.set_wakeup_fd(wake_writer.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a handler, so the wakeup fd hears it
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake, selectors.EVENT_READ)

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def run(self) -> Request | None:
        """Serve until stopped and every worker has ended (None), or return a request in a forked child."""
        while not self.stopping or self.workers:
            if self.stopping and self.listener is not None:  # a late client falls back to a cold start
                self.selector.unregister(self.listener)
                self.listener.close()
                self.listener = None
                self.path.unlink(missing_ok=True)
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    request = self._accept()
                    if request is not None:
                        return request
                elif key.fileobj is self.wake:
                    with contextlib.suppress(BlockingIOError):
                        while self.wake.recv(4096):
                            pass
                    self._reap()
                else:
                    self._from_client(key.data)
        return None

    def _accept(self) -> Request | None:
        assert self.listener is not None
        conn, _ = self.listener.accept()
        try:
            request = _receive(conn)
        except (OSError, ValueError) as exc:
            print(f"tessera fork server: dropped a request: {exc}", file=sys.stderr, flush=True)
            conn.close()
            return None
        differs = env_differences(self.env, request.env)
        if differs:  # the client reads this line as no answer and starts the worker cold, saying why
            for fd in request.fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(f"refused: {', '.join(differs)} differ from the fork server's\n".encode())
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._close_in_child(conn)
            return request
        for fd in request.fds:
            os.close(fd)
        worker = self.workers[pid] = _Worker(pid, conn)
        try:
            conn.sendall(b"pid %d\n" % pid)
        except OSError:
            self._client_gone(worker)
            return None
        self.selector.register(conn, selectors.EVENT_READ, worker)
        self._deliver(worker, request.signals)
        return None

    def _from_client(self, worker: _Worker) -> None:
        """Signal numbers to deliver, one a line; end of file: the client died, so must the worker."""
        assert worker.conn is not None
        try:
            data = worker.conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            self._client_gone(worker)
            return
        self._deliver(worker, data)

    def _deliver(self, worker: _Worker, signals: bytes) -> None:
        for number in signals.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(worker.pid, int(number))

    def _client_gone(self, worker: _Worker) -> None:
        if worker.conn is not None:
            with contextlib.suppress(KeyError):
                self.selector.unregister(worker.conn)
            worker.conn.close()
            worker.conn = None
        if worker.pid in self.workers:  # not reaped yet, so the pid is still this worker's
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)

    def _reap(self) -> None:
        """Collect ended workers and tell each one's client: ``exit N``, N negative for a signal."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            worker = self.workers.pop(pid, None)
            if worker is not None and worker.conn is not None:
                with contextlib.suppress(OSError):
                    worker.conn.sendall(b"exit %d\n" % os.waitstatus_to_exitcode(status))
                self._client_gone(worker)

    def _close_in_child(self, conn: socket.socket) -> None:
        """Drop the server's sockets: a client must see end of file when the server dies, whatever
        its siblings hold, and the worker needs none of them."""
        signal.set_wakeup_fd(-1)
        self.selector.close()
        for sock in (self.listener, self.wake, self._wake_writer, conn):
            if sock is not None:
                sock.close()
        for worker in self.workers.values():
            if worker.conn is not None:
                worker.conn.close()


def env_differences(server: dict[str, str], worker: dict[str, str]) -> list[str]:
    """The variables of :data:`IMPORT_TIME_ENV` whose value (or absence) differs between the two."""
    names = {
        name
        for name in server.keys() | worker.keys()
        if name in IMPORT_TIME_ENV or any(p.endswith("_") and name.startswith(p) for p in IMPORT_TIME_ENV)
    }
    return sorted(name for name in names if server.get(name) != worker.get(name))


def _receive(conn: socket.socket) -> Request:
    conn.settimeout(REQUEST_TIMEOUT_S)
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    try:
        if len(fds) != 3 or len(data) < 4:
            raise ValueError(f"a request carries fds 0-2 and a message, got {len(fds)} fds")
        (size,) = struct.unpack("!I", data[:4])
        body = data[4:]
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ValueError("the client closed its request half-way")
            body += chunk
        message = json.loads(body[:size])
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return Request(message["argv"], message["env"], message["cwd"], fds, body[size:])


def _become_worker(request: Request, server_pid: int) -> None:
    """In the forked child: a session of its own, the client's stdio, environment and cwd, the
    server's signal handlers undone."""
    os.setsid()  # as torchrun starts its workers: a signal to the server's group does not reach them
    terminate_with_parent(signal.SIGKILL)
    if os.getppid() != server_pid:  # the server died before the line above
        os._exit(1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
        os.close(fd)
    # Unbuffered, like the workers torchrun starts with ``python -u``: a rank's last words reach the log.
    encoding = sys.stdout.encoding
    stdin = io.BufferedReader(io.FileIO(0, "r", closefd=False))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(stdin, encoding=encoding)
    sys.stdout = sys.__stdout__ = _unbuffered(1, encoding, "strict")
    sys.stderr = sys.__stderr__ = _unbuffered(2, encoding, "backslashreplace")
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)


def _unbuffered(fd: int, encoding: str, errors: str) -> io.TextIOWrapper:
    """What ``python -u`` makes of an output fd: text written through to the raw file."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding, errors, write_through=True)


def _exit_status(argv: list[str]) -> int:
    """Run ``argv`` and end as the interpreter ends ``python -u ARGV``, but for the teardown of every
    module, which takes ~0.8 s with torch loaded (a failed rank's exit holds up its group's restart):
    the exit code of SystemExit, or a traceback and 1; non-daemon threads joined, atexit handlers run,
    output flushed. Negative: the signal to die by (an uncaught KeyboardInterrupt ends by SIGINT).
    tessera's own files are line-buffered, so nothing written is lost, as with multiprocessing's
    forked children, which exit the same way."""
    try:
        _run(argv)
        code = 0
    except SystemExit as exit:
        code = _system_exit_code(exit.code)
    except BaseException as error:
        sys.excepthook(type(error), error, error.__traceback__)
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return code


def _system_exit_code(code: object) -> int:
    """As CPython reads ``SystemExit.code``: None is 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run(argv: list[str]) -> None:
    """What ``python -u ARGV`` runs: a module as ``__main__`` (sys.path[0] the cwd) or a script (its
    directory)."""
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        # The preloaded module runs again as __main__, which runpy warns of on every rank's stderr; a
        # cold worker prints no such line, so neither does this one.
        warnings.filterwarnings("ignore", f"'{argv[1]}' found in sys.modules", RuntimeWarning)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.runtime.fork_server", description=__doc__)
    parser.add_argument("--socket", type=Path, required=True, help="Unix socket to listen on.")
    parser.add_argument("--preload", action="append", default=[], help="Module to import before forking.")
    args = parser.parse_args(argv)
    server = _Server(args.socket)  # listening already: early clients queue while the imports run
    for module in args.preload:
        importlib.import_module(module)
    request = server.run()
    if request is None:  # stopped
        return
    _become_worker(request, server.pid)
    code = _exit_status(request.argv)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main()
