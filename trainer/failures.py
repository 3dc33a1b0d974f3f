"""The exit-code contract between the trainer, torchrun and the orchestrator's retry condition.

A training attempt ends in one of four ways, and two of them deserve a retry:

* ``ok`` — exit 0.
* ``node_failure`` — the job died for reasons outside its code: a process killed by a signal
  (OOM-killer, preemption, ``kill -9``), a lost peer or rendezvous, a collective that timed out
  or had its connection reset, the step watchdog firing on a hang (:data:`EXIT_HANG`), or the
  object store / a data-loader worker failing underneath the job (:data:`EXIT_INFRA`).
  Retrying resumes from the last committed checkpoint and is expected to succeed.
* ``preempted`` — the job was told to stop (SIGTERM) and checkpointed the step it was on before
  exiting :data:`EXIT_PREEMPTED`; retrying resumes there, with no step lost.
* ``user_error`` — the job itself is wrong: an invalid config, a NaN loss, a checkpoint of another
  model shape, out of memory on the first step (:data:`EXIT_USER_ERROR`), or any other Python
  exception raised by a rank. Retrying would fail the same way, so the orchestrator fails fast.

torchrun restarts the workers after any failure (``--max-restarts``), user errors included; a rank that
fails with one leaves ``user_error.json`` in the run directory, and a restarted rank that finds it
exits at once with the same message instead of failing the same way again (:func:`restarted_after_user_error`).

torchrun always exits 1 when a worker fails; the workers' own exit codes are in the report it prints
(``exitcode  : -9 (pid: 123)  (SIGKILL)``, the "Root Cause" first), so classification reads the log tail.
"""

from __future__ import annotations

import json
import os
import re
import signal
from typing import Literal

from trainer.rundir import RunDir

EXIT_OK = 0
EXIT_USER_ERROR = 3  # a failure retrying cannot fix
EXIT_HANG = 4  # the step watchdog fired: treated as a node failure
EXIT_INFRA = 5  # the store, the network or a loader worker failed under the job: a node failure
EXIT_PREEMPTED = 6  # SIGTERM: the running step was checkpointed before exiting (trainer.rank.preemption)

FailureKind = Literal["ok", "user_error", "node_failure", "preempted"]
RETRYABLE: tuple[FailureKind, ...] = ("node_failure", "preempted")


class UserError(Exception):
    """A failure caused by the job's own inputs; its message names the input and the fix."""


# Phrases that only appear when the fault lies outside the job's code: the network, a peer, the
# rendezvous store. Matched case-insensitively against the log tail.
NODE_FAILURE_MARKERS = (
    "RendezvousClosedError",
    "RendezvousTimeoutError",
    "RendezvousConnectionError",
    "DistNetworkError",
    "DistStoreError",
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",  # e.g. gloo connectFullMesh to a peer that is gone
    "Broken pipe",
    "Timed out waiting",  # gloo collective / store timeout
    "Watchdog caught collective operation timeout",  # NCCL
    "NCCL communicator was aborted",
    "ncclRemoteError",
    "ncclSystemError",
    "is killed by signal",  # torch DataLoader: a worker process was killed (OOM-killer, kill -9)
    "exited unexpectedly",  # torch DataLoader: a worker process died
)

_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\n(.*?)\n=+", re.DOTALL)
_EXIT_CODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_MARKERS = re.compile("|".join(re.escape(m) for m in NODE_FAILURE_MARKERS), re.IGNORECASE)


def is_infra_error(error: BaseException) -> bool:
    """True when ``error`` (or what it wraps) is the infrastructure's fault, not the job's.

    A rank that catches it exits :data:`EXIT_INFRA` so the attempt is retried: a 503 or a reset
    connection from the checkpoint store mid-save, a peer's closed gloo connection, a killed
    data-loader worker, a rendezvous store that timed out (its message names no cause, only its
    class does). A missing file, a denied permission or a bad URL stay user errors.
    """
    from trainer.storage import is_transient  # here: most importers of this module never touch a store

    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if is_transient(current) or _MARKERS.search(f"{type(current).__name__}: {current}"):
            return True
        current = current.__cause__ or current.__context__
    return False


def _launch() -> tuple[str, int]:
    """This torchrun launch's id and how many times it has restarted its workers."""
    return os.environ.get("TORCHELASTIC_RUN_ID", ""), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def record_user_error(run_dir: RunDir, message: str) -> None:
    """Note a user error of this attempt for the launch's next restart (any rank may; last one wins)."""
    run_id, restart = _launch()
    tmp = run_dir.user_error.with_name(f"{run_dir.user_error.name}.{os.getpid()}")
    try:
        run_dir.path.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"run_id": run_id, "attempt": restart, "message": message}))
        tmp.replace(run_dir.user_error)
    except OSError:  # e.g. the disk is full: the error itself still reaches the log, one line
        tmp.unlink(missing_ok=True)


def restarted_after_user_error(run_dir: RunDir) -> str | None:
    """On a torchrun restart after a user error in the same launch, that error's message; else None.

    A new launch (restart count 0, e.g. after the user fixed the spec) clears the old note.
    """
    note = run_dir.user_error
    run_id, restart = _launch()
    if restart == 0:
        note.unlink(missing_ok=True)
        return None
    try:
        recorded = json.loads(note.read_text())
    except (OSError, ValueError):
        return None
    if recorded.get("run_id") != run_id:
        return None
    return f"attempt {recorded['attempt']} failed with a user error, not retrying it: {recorded['message']}"


def _root_cause(log_tail: str) -> str | None:
    """torchrun's report on the first failed worker (the last one in the tail, after restarts)."""
    blocks = _ROOT_CAUSE.findall(log_tail)
    return blocks[-1] if blocks else None


def _other_failures(log_tail: str) -> str:
    """The "Failures:" block of torchrun's last report: the failed workers besides the root cause."""
    at = log_tail.rfind("Root Cause (first observed failure):")
    start = log_tail.rfind("Failures:\n", 0, at) if at >= 0 else -1
    block = log_tail[start:at] if start >= 0 else ""
    return "" if "Root Cause" in block else block  # that report's own block was cut off the tail


def worker_exit_code(returncode: int, log_tail: str) -> int:
    """The exit code of the failed worker that torchrun's report names as the root cause, else
    ``returncode``; but not an :data:`EXIT_INFRA` echo when another worker failed otherwise.

    A rank whose peer failed (a hang its watchdog ended, a user error, a kill) sees its connections
    close and exits :data:`EXIT_INFRA`, often within the same second; torchrun's "first observed"
    compares whole-second times and then takes the lower rank, so it may name the echo. The report's
    other failures then hold the cause.
    """
    if returncode == 0:
        return 0
    cause = _root_cause(log_tail)
    code = _EXIT_CODE.search(cause) if cause else None
    if not code:
        return returncode
    first = int(code.group(1))
    others = [int(other) for other in _EXIT_CODE.findall(_other_failures(log_tail))]
    return next((other for other in others if other != EXIT_INFRA), first) if first == EXIT_INFRA else first


def killed_by_signal(code: int) -> bool:
    """Negative codes come from Popen/torchrun; 128+N from a shell or a container runtime (137, 143)."""
    return code < 0 or 128 < code <= 128 + max(signal.Signals)


def classify_exit(returncode: int, log_tail: str) -> FailureKind:
    """Classify an attempt from its exit code and the tail of its combined output.

    Rules, first match wins:
    1. exit 0 → ``ok``;
    2. the launcher itself, or the first failed worker, was killed by a signal → ``node_failure``;
    3. the worker exited with :data:`EXIT_PREEMPTED` → ``preempted``; with :data:`EXIT_HANG` or
       :data:`EXIT_INFRA` → ``node_failure``;
    4. the worker exited with :data:`EXIT_USER_ERROR` → ``user_error``;
    5. the failure shows a lost peer, rendezvous or collective timeout → ``node_failure``;
    6. anything else (a Python exception in a rank) → ``user_error``.

    For rule 5, when the failed worker recorded its own traceback (``@record`` on the entry point),
    only that traceback is searched: peers of a rank that raised ValueError see their connections
    close, and those echoes must not turn a user error into a retry.
    """
    if returncode == 0:
        return "ok"
    code = worker_exit_code(returncode, log_tail)
    if code == EXIT_PREEMPTED:
        return "preempted"
    if killed_by_signal(returncode) or killed_by_signal(code) or code in (EXIT_HANG, EXIT_INFRA):
        return "node_failure"
    if code == EXIT_USER_ERROR:
        return "user_error"
    cause = _root_cause(log_tail) or ""
    evidence = cause if "Traceback (most recent call last)" in cause else log_tail
    return "node_failure" if _MARKERS.search(evidence) else "user_error"
