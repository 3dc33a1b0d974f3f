"""A torchrun worker's entry with warm restarts: the worker is forked by the host's fork server.

``python -m trainer.runtime.fork_client -m trainer.train --job JOB --run-dir DIR`` (or ``SCRIPT ARGS``) asks
the fork server (:mod:`trainer.runtime.fork_server`, its socket in ``$TESSERA_FORK_SOCKET``), which imported
torch and the trainer once, to fork a worker with this process's argv, environment, working
directory and stdin/stdout/stderr: a restarted rank skips the ~7 s of imports. This process stays
where torchrun sees it and stands in for the worker: SIGTERM, SIGINT and the other stop signals it
receives are forwarded, and it ends as the worker ended, with its exit code or killed by the same
signal. Killed itself (torchrun's SIGKILL), it closes the connection and the server kills the worker.

Stdlib only, so it starts in ~30 ms. With no server answering it execs ``python -u ARGS`` instead,
saying why in one line: the worker then starts cold, as without warm restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import BinaryIO, NoReturn

SOCKET_ENV = "TESSERA_FORK_SOCKET"
# What torchrun's agent passes on to its workers when it is stopped, plus the user signals.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# The server imports torch before it forks the first worker: a busy 2-core host can take this long.
ANSWER_TIMEOUT_S = 120.0
COMM_PREFIX = "fork:"  # this process's name once the worker runs: how trainer.runtime.agents finds the worker


def main(argv: list[str]) -> NoReturn:
    if not argv:
        print("usage: python -m trainer.runtime.fork_client (-m MODULE | SCRIPT) [ARGS...]", file=sys.stderr)
        os._exit(2)
    path = os.environ.get(SOCKET_ENV)
    if not path:
        _exec_directly(argv, f"${SOCKET_ENV} is not set")
    if argv[0].startswith("-") and argv[0] != "-m":
        _exec_directly(argv, f"the fork server runs '-m MODULE' or a script, not {argv[0]}")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(ANSWER_TIMEOUT_S)
    try:
        conn.connect(path)
        for signum in FORWARDED:
            signal.signal(signum, lambda signum, frame: _forward(conn, signum))
        _send_request(conn, argv)
        answers = conn.makefile("rb")
        pid = _answer(answers, "pid")
    except (OSError, ValueError) as exc:
        _exec_directly(argv, f"the fork server at {path} did not answer ({exc})")
    # torchrun knows this pid, not the worker's; the name links them (see trainer.runtime.agents.worker_pid).
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(f"{COMM_PREFIX}{pid}")
    conn.settimeout(None)
    try:
        code = _answer(answers, "exit")
    except (OSError, ValueError):
        # The server died: its children die with it (PR_SET_PDEATHSIG), so the worker was killed.
        print(f"tessera: the fork server at {path} is gone; worker {pid} was killed", file=sys.stderr)
        code = -signal.SIGKILL
    if code >= 0:
        os._exit(code)
    _die_by(-code)


def _send_request(conn: socket.socket, argv: list[str]) -> None:
    """argv, environment and cwd as one length-prefixed JSON message, with fds 0-2 attached."""
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    message = struct.pack("!I", len(body)) + body
    sent = socket.send_fds(conn, [message], [0, 1, 2])
    if sent < len(message):  # an empty send to a server that already refused and closed fails (EPIPE)
        conn.sendall(message[sent:])


def _answer(answers: BinaryIO, word: str) -> int:
    """The number in the server's next line, which must be ``WORD N``."""
    line = answers.readline().decode()
    name, _, number = line.partition(" ")
    if name == "refused:":  # the server's environment would not give the worker a cold start's
        raise ValueError(line.strip())
    if name != word:
        raise ValueError(f"expected {word!r}, got {line.strip()!r}" if line else "connection closed")
    return int(number)


def _forward(conn: socket.socket, signum: int) -> None:
    """A stop signal for this stand-in is meant for the worker: the server delivers it."""
    with contextlib.suppress(OSError):
        conn.sendall(b"%d\n" % signum)


def _die_by(signum: int) -> NoReturn:
    """End the way the worker did, killed by ``signum``, so torchrun reports the same signal."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the worker dumped core already, if it was allowed
    if signum != signal.SIGKILL:  # the one signal whose action cannot be set, nor needs to be
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default action is not to terminate


def _exec_directly(argv: list[str], why: str) -> NoReturn:
    print(f"tessera: {why}; starting the worker directly", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-u", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
