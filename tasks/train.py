"""Launch training on a provisioned cluster, follow it, and decide whether a failure deserves a retry.

Each attempt starts the same torchrun job, which resumes from the latest committed checkpoint, so a
retry after a node failure loses at most one checkpoint interval. Retries are configured per spec
(``faults.node_failure_retries``, ``faults.retry_delay_s``) with :func:`retry_on_node_failure`,
which lets user errors (bad config, NaN loss, OOM on the first step) fail fast. Every failure
carries the run's history (:mod:`tasks.attempts`), so the attempt that exhausts the budget says
which faults were seen, how many steps they cost and where a new run would resume.
"""

from __future__ import annotations

import json
import time
from logging import Logger, LoggerAdapter
from pathlib import Path
from typing import Any

from prefect import Task, get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.client.schemas.objects import State, TaskRun
from prefect.states import Completed

from deployments.kubernetes import client
from deployments.run import Run
from tasks.attempts import publish, record_failure, summary
from tasks.checkpoints import publish_loss_curve
from tasks.goodput import record_launch
from tasks.keys import artifact_key
from tasks.live import CURVE_INTERVAL_S, Every, StepLines, step_line
from tasks.provision import LaunchTarget
from trainer.checkpoint.commit import list_checkpoints
from trainer.failures import RETRYABLE, FailureKind, classify_exit, worker_exit_code
from trainer.metrics import mirror_of, read_metrics
from trainer.storage import write_atomic

K8S_POLL_S = 10.0


class TrainingFailed(RuntimeError):
    """A training attempt that exited non-zero; ``kind`` (from trainer.failures) drives retries."""

    def __init__(self, kind: FailureKind, exit_code: int, log_tail: str, history: str = "") -> None:
        super().__init__(
            f"training failed ({kind}, worker exit code {exit_code}){'; ' + history if history else ''}:\n"
            + cause_of(log_tail)
        )
        self.kind = kind
        self.exit_code = exit_code


class RunStopped(RuntimeError):
    """The flow is ending (a stop signal, a cancellation, an error elsewhere) and tore the agents down:
    not a failure of the job, and nothing to retry."""


def cause_of(log_tail: str) -> str:
    """What the state message shows: the trainer's own one-line error (``error: [rank N] ...``) when a
    rank printed one, rather than torchrun's ChildFailedError box; else the log's last lines."""
    lines = log_tail.strip().splitlines()
    said = [line for line in lines if line.startswith("error: [rank ")]
    return said[0] if said else "\n".join(lines[-5:])


def retry_on_node_failure(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect ``retry_condition_fn``: retry only what a fresh attempt can fix."""
    error = state.result(raise_on_failure=False)
    return isinstance(error, TrainingFailed) and error.kind in RETRYABLE


class Progress:
    """The run's progress artifact, step lines and live loss curve, refreshed from ``metrics.jsonl`` as
    the trainer appends to it (see :mod:`tasks.live`).

    ``source`` is the run directory's file, or the trainer's mirror of it in the run's object store
    (``JobConfig.run_url``) for a run on other machines; ``copy_to`` then keeps a copy of what was
    read in the run directory, so the report and the loss curve read a remote run as a local one.
    """

    def __init__(
        self,
        run: Run,
        source: Path | str,
        logger: Logger | LoggerAdapter[Logger],
        copy_to: Path | None = None,
    ) -> None:
        self.run, self.source, self.logger, self.copy_to, self.seen = run, source, logger, copy_to, -1
        self.total = run.job.train.steps
        self.lines = StepLines(self.total, run.job.train.step_line_every)
        self.curve_due = Every(CURVE_INTERVAL_S)
        self.artifact = create_progress_artifact(
            0.0, key=artifact_key(run.run_id, "progress"), description="waiting for the first step"
        )

    def update(self, final: bool = False) -> None:
        """Show the steps logged since the last call; ``final`` also redraws the loss curve once more."""
        records = read_metrics(self.source)
        fresh = bool(records) and records[-1]["step"] != self.seen
        if fresh:
            self._show(records)
        if records and (final or (fresh and self.curve_due())):
            publish_loss_curve(self.run.dir)

    def _show(self, records: list[dict[str, Any]]) -> None:
        if self.copy_to is not None:
            write_atomic(str(self.copy_to), "".join(json.dumps(r) + "\n" for r in records).encode())
        new = [r for r in records if r["step"] > self.seen]
        # A retry's first read holds the earlier attempts' steps too: a line for where it stands, not a backlog.
        for level, line in self.lines.lines(new if self.seen >= 0 else new[-1:]):
            self.logger.log(level, line)
        last = records[-1]
        self.seen = last["step"]
        update_progress_artifact(
            self.artifact,
            100.0 * last["step"] / self.total,
            description=step_line(last, self.total, None)[1],
        )


def already_complete(run: Run) -> State[str] | None:
    """Completed, with a message saying so, when the run's last good checkpoint is at ``train.steps``."""
    good = [m for m in list_checkpoints(run.checkpoint_url) if m.good]
    if not good or good[-1].step < run.job.train.steps:
        return None
    return Completed(
        message=f"run {run.run_id} was already complete at step {good[-1].step}: trained 0 steps (continue "
        "it with more train.steps, or leave resume_from empty for a new run)",
        data=good[-1].url,
    )


def run_kubernetes(target: LaunchTarget, progress: Progress) -> tuple[int, str]:
    """(Re)submit the training JobSet and follow it until it ends; the failed pod's exit code and log
    tail on failure. Gang restarts after a lost node happen inside the JobSet and are only logged."""
    logger = get_run_logger()
    jobset = target.manifests[-1]
    client.apply_manifests(target.manifests)
    restarts = 0
    while (status := client.jobset_status(jobset)).state == "running":
        if status.restarts > restarts:
            restarts = status.restarts
            logger.warning("JobSet %s restarted its pods (%d so far)", jobset["metadata"]["name"], restarts)
        progress.update()
        time.sleep(K8S_POLL_S)
    progress.update()
    return status.exit_code, status.log_tail


def run_local(target: LaunchTarget, progress: Progress) -> tuple[int, str]:
    """The local agents, node 0's output streamed into the run logger; exit code and log tail."""
    logger = get_run_logger()
    stopping = target.run.dir.stopping

    def echo(line: str) -> None:
        # Once tear-down is stopping the agents (a cancelled run), what torchrun prints is its own stop
        # traceback (SignalException), not news: the flow's log ends with the cancellation instead.
        if not stopping.exists():
            logger.info(line.rstrip())

    result = target.run.launch_local(target.local_commands(), echo=echo, poll=progress.update)
    return result.returncode, result.log_tail


@task(name="train")
def train_task(target: LaunchTarget) -> str | State[str]:
    """Train the run to ``train.steps``; return the URL of the final committed checkpoint.

    A run already trained to ``train.steps`` (continued with no more steps, or a flow retry after
    training) launches nothing: its state says that it trained 0 steps, rather than a plain Completed.
    """
    run = target.run
    job = run.job
    if (done := already_complete(run)) is not None:
        return done
    progress = Progress(
        run,
        mirror_of(run.dir.metrics, job.run_url) or run.dir.metrics,
        get_run_logger(),
        copy_to=run.dir.metrics if target.kind == "kubernetes" else None,  # locally the trainer writes it
    )
    if run.dir.stopping.exists():  # a retry that began as the flow was tearing down
        raise RunStopped(f"run {run.run_id} is being stopped by its flow's tear-down; not starting it again")
    record_launch(run.dir)
    with run.claim():
        code, tail = (
            run_local(target, progress) if target.kind == "local" else run_kubernetes(target, progress)
        )
    progress.update(final=True)
    if code and run.dir.stopping.exists():
        raise RunStopped(f"run {run.run_id} was stopped by its flow's tear-down; its checkpoints are kept")
    kind = classify_exit(code, tail)
    if kind != "ok":
        exit_code = worker_exit_code(code, tail)
        history = record_failure(run.dir, run.checkpoint_url, kind, exit_code)
        publish(history, key=artifact_key(run.run_id, "failures"))
        raise TrainingFailed(kind, exit_code, tail, summary(history))
    checkpoints = [m for m in list_checkpoints(run.checkpoint_url) if m.good]
    if not checkpoints:
        raise TrainingFailed(
            "user_error", 0, f"training exited 0 but left no checkpoint under {run.checkpoint_url}"
        )
    return checkpoints[-1].url
