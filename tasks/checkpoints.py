"""Checkpoint validation and evaluation tasks, run while training goes on and on a schedule.

Evaluation runs where ``deployments.eval_placement`` puts it: in this process, or as a Job on the
training pool for a model the orchestrator pod cannot hold. Validation is streamed (bounded memory),
so it always runs here. Each evaluation is stored in the run directory's ``evals/step-N.json`` (so
the scheduled flow skips finished ones and the loss curve can be redrawn) and published as a table
plus the train-vs-eval loss curve.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import task_run

from deployments.eval_job import run_eval_job
from deployments.eval_placement import eval_placement
from deployments.run import Run
from tasks.curves import inline_png, plot_loss_curve
from tasks.keys import artifact_key
from trainer.checkpoint.commit import CommitRecord, list_checkpoints
from trainer.checkpoint.pins import pin, unpin
from trainer.checkpoint.validate import ValidationResult, validate_checkpoint
from trainer.config import JobConfig
from trainer.evaluate import evaluation_record
from trainer.metrics import read_metrics
from trainer.rundir import RunDir


def read_evals(run_dir: RunDir) -> list[dict[str, Any]]:
    """Every stored evaluation of the run, by step."""
    return [json.loads(p.read_text()) for p in sorted(run_dir.evals.glob("step-*.json"))]


def waiting_checkpoints(run: Run, skip: set[int]) -> list[CommitRecord]:
    """The run's committed checkpoints not in ``skip``, oldest first: what the pipeline evaluates next."""
    return [m for m in list_checkpoints(run.checkpoint_url) if m.step not in skip and m.good]


def evaluated_steps(run: Run) -> set[int]:
    """The run's checkpoints that have a stored evaluation: what catch-up evaluation skips."""
    return {m.step for m in list_checkpoints(run.checkpoint_url) if run.dir.eval_record(m.step).exists()}


def pin_for_evaluation(run: Run, step: int) -> str:
    """Keep retention off checkpoint ``step`` until its evaluation is over; the pin's URL, for :func:`unpin`."""
    return pin(run.checkpoint_url, step, run.run_id)


def _validate_run_name() -> str:
    """Name validation runs after their checkpoint, e.g. ``validate-step-000040``."""
    return "validate-" + task_run.parameters["step_url"].rstrip("/").rsplit("/", 1)[-1]


@task(name="validate-checkpoint", task_run_name=_validate_run_name)
def validate_checkpoint_task(step_url: str, job: JobConfig) -> ValidationResult:
    """Prove the checkpoint loads on another world size; marks its manifest validated or corrupt."""
    result = validate_checkpoint(step_url, job)
    if not result.ok:
        get_run_logger().warning("checkpoint step %d is corrupt: %s", result.step, result.reason)
    return result


@task(name="evaluate")
def evaluate_task(validation: ValidationResult, run: Run, pin_url: str) -> dict[str, Any] | None:
    """Held-out loss, perplexity and a greedy sample of a validated checkpoint; None for a corrupt one.

    Unpins the checkpoint when done (``pin_url``, taken when it was queued), so retention may delete it.
    """
    try:
        return _evaluate(validation, run) if validation.ok else None
    finally:
        unpin(pin_url)


def _evaluate(validation: ValidationResult, run: Run) -> dict[str, Any]:
    job, spec = run.job, run.spec.eval
    placement = eval_placement(run.spec)
    get_run_logger().info("evaluating step %d %s", validation.step, placement.line)
    if placement.where == "flow":
        record = evaluation_record(
            validation.step_url, job, spec.batches, spec.sample_prompt, spec.sample_tokens
        )
    else:
        record = run_eval_job(run, validation.step, validation.step_url)
    path = run.dir.eval_record(record["step"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    create_table_artifact(
        [
            {
                "step": record["step"],
                "loss": round(record["loss"], 4),
                "perplexity": round(record["perplexity"], 2),
                "tokens": record["tokens"],
                "documents": record["documents"],
                "sample": record["sample"],
            }
        ],
        key=artifact_key(run.run_id, "eval"),
        description=f"Evaluation of {validation.step_url}",
    )
    publish_loss_curve(run.dir)
    return record


def publish_loss_curve(run_dir: RunDir) -> Path:
    """Redraw ``loss.png`` from the metrics and stored evaluations, and publish it inline."""
    path = plot_loss_curve(read_metrics(run_dir.metrics), read_evals(run_dir), run_dir.loss_curve)
    create_markdown_artifact(
        inline_png(path, "loss curve"),
        key=artifact_key(run_dir.run_id, "loss-curve"),
        description="Training loss vs held-out loss per checkpoint",
    )
    return path
