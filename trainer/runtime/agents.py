"""torchrun agents on this host: each in its own session, recorded in the run dir, stopped as a group.

The launcher stops its agents when it ends; the record lets tear-down stop them too when the flow
run is cancelled or crashes while the task's thread cannot clean up. And each agent asks the kernel
to send it SIGTERM when its launcher dies (``PR_SET_PDEATHSIG``), so even a launcher killed with
SIGKILL leaves no agent training behind: torchrun stops its ranks on SIGTERM.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.rundir import RunDir
from trainer.runtime.fork_client import COMM_PREFIX

STOP_GRACE_S = 30.0  # torchrun gives its workers as long to save a preempted step
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Resolved here, in the parent: between fork and exec the child only makes the one libc call.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def terminate_with_parent(signum: int = signal.SIGTERM) -> None:
    """In the child, before exec: ``signum`` when the thread that started it exits (Linux only)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signum)


def start_agent(cmd: list[str], env: dict[str, str], run_dir: RunDir) -> subprocess.Popen[str]:
    """Start one agent (own session: a signal to its group reaches all its workers) and record its pid.

    Call it from a thread that outlives the agent (the launcher waits for it in the same thread):
    the kernel's parent-death signal follows the starting thread, not the process.
    """
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
        preexec_fn=terminate_with_parent,
    )
    run_dir.path.mkdir(parents=True, exist_ok=True)
    with run_dir.agents.open("a") as record:
        record.write(f"{proc.pid}\n")
    return proc


def is_stopped(pid: int) -> bool:
    """True while ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP): state T in /proc/PID/stat."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def agent_workers(pid: int) -> list[int]:
    """The ranks agent ``pid`` started. torchrun puts each in a session of its own, so a signal to the
    agent's process group does not reach them (nor their data-loader workers)."""
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def worker_pid(pid: int) -> int:
    """The process that trains for torchrun's worker ``pid``: with warm restarts the worker torchrun
    started is a stand-in (trainer.runtime.fork_client, named ``fork:PID`` once the fork server's child
    runs), else ``pid`` itself."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        if not name.startswith(COMM_PREFIX):
            return pid
        forked = int(name.removeprefix(COMM_PREFIX))
        parent = Path(f"/proc/{forked}/stat").read_text().rsplit(")", 1)[1].split()[1]
        server = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return pid
    return forked if b"trainer.runtime.fork_server" in server else pid  # not a reused pid


def kill_agent(pid: int) -> None:
    """SIGKILL an agent's group and each of its ranks' sessions at once: what a lost node looks like."""
    workers = agent_workers(pid)
    forked = [forked for worker in workers if (forked := worker_pid(worker)) != worker]
    for group in (pid, *workers, *forked):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def stop_agent(proc: subprocess.Popen[str]) -> None:
    """TERM the agent (it stops its ranks), then KILL it and its ranks after a grace period."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        kill_agent(proc.pid)
        proc.wait()


def _is_agent_of(pid: int, run_dir: RunDir) -> bool:
    """Guards against pid reuse: the process must still be a torchrun agent for this run dir."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"torch.distributed.run" in argv and str(run_dir.path).encode() in argv


def stop_recorded_agents(run_dir: RunDir) -> list[int]:
    """Stop every recorded agent of ``run_dir`` still running (not our child here); return their pids."""
    record = run_dir.agents
    if not record.exists():
        return []
    alive = [pid for pid in map(int, record.read_text().split()) if _is_agent_of(pid, run_dir)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive:
            if not _is_agent_of(pid, run_dir):
                continue
            if sig == signal.SIGKILL:
                kill_agent(pid)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, sig)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(_is_agent_of(pid, run_dir) for pid in alive):
            time.sleep(0.2)
    record.unlink()
    return alive
