"""Launch ``python -m trainer.train`` under torchrun: the command, its environment, local agents.

The same command serves every target: one agent per host, ``--standalone`` on one host, a shared
c10d rendezvous across hosts (or across several agents on 127.0.0.1 to simulate them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from torch.distributed import TCPStore

from trainer.backends import get_backend
from trainer.config import JobConfig
from trainer.failures import FailureKind, UserError, classify_exit, worker_exit_code
from trainer.rundir import RunDir
from trainer.runtime.agents import is_stopped, kill_agent, start_agent, stop_agent
from trainer.runtime.fork_client import SOCKET_ENV
from trainer.runtime.fork_server import SHARED_ENV, ForkServer

LOG_TAIL_LINES = 200  # enough to hold torchrun's root-cause block and the ranks' last words
POLL_S = 1.0
FORK_CLIENT = "trainer.runtime.fork_client"


def torchrun_command(
    job_json: Path,
    run_dir: Path,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    run_id: str = "tessera",
    entry: Sequence[str] | None = None,
    min_nodes: int | None = None,
    replacement_wait_s: int = 60,
    warm_restart: bool = False,
) -> list[str]:
    """argv for one torchrun agent; ``rdzv_endpoint`` (host:port) is required when ``nnodes > 1``.

    ``entry`` replaces what the workers run (default: ``-m trainer.train --job JOB --run-dir DIR``).
    ``min_nodes`` makes the job elastic (``--nnodes=MIN:MAX``): a lost node is noticed after three missed
    heartbeats (``replacement_wait_s`` in all), then the survivors wait ``replacement_wait_s`` for a
    replacement (torch's ``last_call_timeout``) before continuing without it. ``warm_restart`` runs the
    entry through :mod:`trainer.runtime.fork_client`, forked by the host's fork server that :func:`run_agents`
    starts for such commands (see :mod:`trainer.runtime.fork_server`).
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
    ]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise UserError(f"nnodes={nnodes} needs rdzv_endpoint=host:port of the rendezvous (node 0)")
        # c10d assigns node ranks itself; node_rank only orders agents that share one host name.
        cmd += [
            f"--nnodes={nnodes}" if min_nodes is None else f"--nnodes={min_nodes}:{nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={run_id}",
        ]
        if min_nodes is not None:
            heartbeat = max(1, replacement_wait_s // 3)
            cmd.append(f"--rdzv-conf=last_call_timeout={replacement_wait_s},keep_alive_interval={heartbeat}")
    if entry is None:
        entry = ["-m", "trainer.train", "--job", str(job_json), "--run-dir", str(run_dir)]
    if warm_restart:
        entry = ["-m", FORK_CLIENT, *entry]
    return [*cmd, *entry]


def launch_env(job: JobConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The workers' environment: the caller's, plus the backend's variables, plus unbuffered output
    so a rank's last words reach the log before it dies."""
    env = dict(os.environ if base is None else base)
    env.update(get_backend(job.hardware.accelerator).launch_env(job.hardware.chips_per_node))
    env["PYTHONUNBUFFERED"] = "1"
    if job.faults.min_nodes is not None:
        # torch caches the workers' bootstrap store address from the first rendezvous on every node but
        # rank 0 (elastic/rendezvous/dynamic_rendezvous.py, next_rendezvous); once the node ranks change
        # (a node lost, another back) that address can be stale. Unshared, node 0's agent publishes a
        # fresh address every round.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


@dataclass(frozen=True)
class LaunchResult:
    returncode: int  # torchrun's own code (1 whenever a worker failed)
    worker_exit_code: int  # the failed worker's code that says what happened (trainer.failures)
    kind: FailureKind
    log_tail: str


class Stopped(Exception):
    """The launcher was told to stop (SIGTERM, SIGHUP, a cancelled flow run): not a failure of the job."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into :class:`Stopped` in the main thread, so that every ``finally``
    on the way out runs: agents stopped, the lease released, Prefect's temporary server shut down.
    Elsewhere than the main thread (signal handlers live there) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class _Agent:
    """One torchrun agent, with a thread that keeps its output's tail (and echoes it)."""

    proc: subprocess.Popen[str]
    tail: deque[str]
    reader: threading.Thread

    @classmethod
    def start(
        cls, command: list[str], env: dict[str, str], run_dir: RunDir, echo: Callable[[str], object] | None
    ) -> _Agent:
        proc = start_agent(command, env, run_dir)
        tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        reader = threading.Thread(target=_drain, args=(proc.stdout, tail, echo), daemon=True)
        reader.start()
        return cls(proc, tail, reader)

    def note(self, message: str, echo: Callable[[str], object] | None) -> None:
        """A launcher line in the agent's log tail and the run's output."""
        line = f"tessera: {message}\n"
        self.tail.append(line)
        if echo is not None:
            echo(line)

    def stop(self) -> None:
        stop_agent(self.proc)
        self.reader.join(timeout=5)

    def result(self) -> LaunchResult:
        """The launch's outcome when this agent's failure decides it."""
        code, log_tail = self.proc.returncode, "".join(self.tail)
        return LaunchResult(code, worker_exit_code(code, log_tail), classify_exit(code, log_tail), log_tail)


def _drain(stream: IO[str], tail: deque[str], echo: Callable[[str], object] | None) -> None:
    for line in stream:
        tail.append(line)
        if echo is not None:
            echo(line)


def run_agents(
    commands: list[list[str]],
    env: dict[str, str],
    run_dir: RunDir,
    echo: Callable[[str], object] | None = None,
    poll: Callable[[], None] = lambda: None,
    stopped_after_s: float = 300.0,
    elastic: bool = False,
) -> LaunchResult:
    """Run one torchrun agent per command on this host and wait for them; never raises on failure.

    Each agent runs in its own session, recorded in the run directory, so a tear-down can stop it
    even when this call could not. The first agent's output goes to ``echo``; ``poll`` runs about
    once a second (the progress artifact). How a failure decides the outcome: :func:`_wait`.

    ``elastic`` (commands with ``--nnodes=MIN:MAX``): a failed agent is a lost node, and the others
    carry on without it. Every agent's output goes to ``echo``, since any of them may be the one left.
    The rendezvous store is hosted here, not in an agent, so that any agent may die and a returning
    one (started by whoever restores the capacity) finds it.

    Commands whose workers run through :mod:`trainer.runtime.fork_client` (``faults.warm_restart``) get
    this host's fork server, started first and stopped after the agents. With ``$TESSERA_FORK_SERVER``
    (the socket of a fork server started for the whole host, e.g. by a test session) every worker is
    forked from that one instead: no rank imports torch again.
    """
    agents: list[_Agent] = []
    store = _host_rendezvous_store(commands) if elastic else None
    server = None
    if env.get(SHARED_ENV):
        commands, env = through_shared_fork_server(commands, env)
    elif any(FORK_CLIENT in command for command in commands):
        server = ForkServer(run_dir.path, _as_torchrun_sets_it(env, commands[0]))
        env = {**env, **server.env}
    try:
        for node, command in enumerate(commands):
            agents.append(_Agent.start(command, env, run_dir, echo if node == 0 or elastic else None))
        failed = _wait(agents, elastic, echo, poll, stopped_after_s)
    finally:
        for agent in agents:
            agent.stop()
        if server is not None:
            server.stop()
        del store
    return LaunchResult(0, 0, "ok", "") if failed is None else failed.result()


def _as_torchrun_sets_it(env: dict[str, str], command: list[str]) -> dict[str, str]:
    """``env`` with the OMP_NUM_THREADS=1 torchrun gives its workers where ``env`` has none and it starts
    more than one per node: the fork server must import torch with what the workers will have, else it
    refuses them (see ``IMPORT_TIME_ENV`` in :mod:`trainer.runtime.fork_server`)."""
    nproc = next((arg.split("=", 1)[1] for arg in command if arg.startswith("--nproc-per-node=")), "1")
    return {"OMP_NUM_THREADS": "1", **env} if nproc.isdigit() and int(nproc) > 1 else env


def through_fork_client(command: list[str]) -> list[str]:
    """``command`` (a torchrun agent's argv, possibly after ``env NAME=VALUE``, or ``python ARGS``) with
    its workers' entry run through :mod:`trainer.runtime.fork_client`; unchanged when it already is."""
    if "torch.distributed.run" in command:
        at = command.index("torch.distributed.run") + 1
        while command[at].startswith("--"):  # the launcher's own flags, each --name=value
            at += 1
    else:
        at = 1  # after the interpreter
    if command[at : at + 2] == ["-m", FORK_CLIENT]:
        return command
    return [*command[:at], "-m", FORK_CLIENT, *command[at:]]


def through_shared_fork_server(
    commands: list[list[str]], env: dict[str, str]
) -> tuple[list[list[str]], dict[str, str]]:
    """``commands`` and ``env`` as they run with the host's shared fork server (``$TESSERA_FORK_SERVER``
    in ``env``): each worker's entry through the fork client, whose server is that one. Unchanged where
    ``env`` names none."""
    if not env.get(SHARED_ENV):
        return commands, env
    return [through_fork_client(command) for command in commands], {**env, SOCKET_ENV: env[SHARED_ENV]}


def _wait(
    agents: list[_Agent],
    elastic: bool,
    echo: Callable[[str], object] | None,
    poll: Callable[[], None],
    stopped_after_s: float,
) -> _Agent | None:
    """Follow the agents to the end; the failed agent that decides the outcome, or None on success.

    The first agent to fail decides it and the others are stopped at once, since they would otherwise
    wait out the collective timeout; an elastic run succeeds when an agent completes, and fails only
    when all have failed. An agent held stopped (SIGSTOP) for ``stopped_after_s`` is a hang: it is
    killed, which reads as a node failure.
    """
    failed = None
    lost: set[int] = set()
    stopped_since: dict[int, float] = {}
    while failed is None and any(agent.proc.poll() is None for agent in agents):
        failed = None if elastic else next((agent for agent in agents if agent.proc.poll()), None)
        for agent in agents:
            pid = agent.proc.pid
            if elastic and agent.proc.poll() and pid not in lost:
                lost.add(pid)
                agent.note(
                    f"agent {pid} exited with {agent.proc.returncode}: the others continue without it", echo
                )
            if _held_stopped(pid, stopped_since, stopped_after_s):
                agent.note(f"agent {pid} was stopped for {stopped_after_s:.0f} s; killed it", echo)
                kill_agent(pid)
        poll()
        time.sleep(POLL_S)
    failed = failed or _outcome(agents, elastic)
    poll()
    return failed


def _outcome(agents: list[_Agent], elastic: bool) -> _Agent | None:
    """The failed agent that decides a finished run, or None when it succeeded: any failure, or for
    an elastic run only when no agent completed."""
    if elastic and any(agent.proc.returncode == 0 for agent in agents):
        return None
    return next((agent for agent in agents if agent.proc.poll()), None)


def _host_rendezvous_store(commands: list[list[str]]) -> TCPStore | None:
    """Host the c10d rendezvous store at the agents' ``--rdzv-endpoint`` for as long as the launcher runs.

    torch's c10d rendezvous otherwise serves it from whichever agent bound the port first, and it dies
    with that agent. Agents then find the port taken and connect as clients (c10d_rendezvous_backend.py,
    ``_create_tcp_store``). None for one standalone agent, which has no rendezvous to keep.
    """
    endpoint = next((arg.split("=", 1)[1] for arg in commands[0] if arg.startswith("--rdzv-endpoint=")), None)
    if endpoint is None:
        return None
    host, port = endpoint.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=True, wait_for_workers=False)


def _held_stopped(pid: int, since: dict[int, float], limit_s: float) -> bool:
    """Whether ``pid`` has been stopped for ``limit_s``; ``since`` remembers when each stop began."""
    if not is_stopped(pid):
        since.pop(pid, None)
        return False
    return time.monotonic() - since.setdefault(pid, time.monotonic()) >= limit_s
