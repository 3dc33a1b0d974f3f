"""The run's failure history across Prefect retries: what failed, how many steps it cost, where it resumes.

Each failed attempt appends one line to the run's ``attempts.jsonl``; the train task puts the whole
history into its error message and a markdown artifact, so the attempt that exhausts
``faults.node_failure_retries`` fails with a summary instead of a bare exit code.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from prefect.artifacts import create_markdown_artifact

from trainer.checkpoint.commit import list_checkpoints
from trainer.failures import FailureKind
from trainer.metrics import read_metrics
from trainer.rundir import RunDir


@dataclass(frozen=True)
class FailedAttempt:
    kind: FailureKind
    exit_code: int
    last_step: int  # the last step in metrics.jsonl when the attempt died
    checkpoint_step: int  # the newest good checkpoint: where the next attempt resumes
    checkpoint_url: str | None
    at: float

    @property
    def steps_lost(self) -> int:
        return max(0, self.last_step - self.checkpoint_step)


def record_failure(
    run_dir: RunDir, checkpoint_url: str, kind: FailureKind, exit_code: int
) -> list[FailedAttempt]:
    """Append this attempt to the run's history; return the whole history, oldest first."""
    records = read_metrics(run_dir.metrics)
    good = [m for m in list_checkpoints(checkpoint_url) if m.good]
    attempt = FailedAttempt(
        kind,
        exit_code,
        records[-1]["step"] if records else 0,
        good[-1].step if good else 0,
        good[-1].url if good else None,
        time.time(),
    )
    with run_dir.attempts.open("a") as history:
        history.write(json.dumps(asdict(attempt)) + "\n")
    return [FailedAttempt(**json.loads(line)) for line in run_dir.attempts.read_text().splitlines()]


def summary(history: list[FailedAttempt]) -> str:
    """One line: faults seen, steps lost in all, and the checkpoint a new run would resume from."""
    kinds = ", ".join(f"{a.kind} (exit {a.exit_code}) at step {a.last_step}" for a in history)
    last = history[-1]
    resume = f"step {last.checkpoint_step} ({last.checkpoint_url})" if last.checkpoint_url else "none"
    return (
        f"{len(history)} failed attempt(s): {kinds}; {sum(a.steps_lost for a in history)} step(s) lost; "
        f"last good checkpoint: {resume}"
    )


def publish(history: list[FailedAttempt], key: str) -> None:
    """The history as a markdown table artifact (one row per failed attempt)."""
    rows = "\n".join(
        f"| {i} | {a.kind} | {a.exit_code} | {a.last_step} | {a.steps_lost} | {a.checkpoint_step} |"
        for i, a in enumerate(history, 1)
    )
    create_markdown_artifact(
        "| attempt | failure | exit code | last step | steps lost | resumes from |\n|---|---|---|---|---|---|\n"
        + rows
        + f"\n\n{summary(history)}",
        key=key,
        description="failed training attempts",
    )
