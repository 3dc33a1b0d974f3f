"""Checkpoint validation and evaluation tasks, run while training goes on and on a schedule.

Each evaluation is stored in the run directory's ``evals/step-N.json`` (so the scheduled flow skips finished
ones and the loss curve can be redrawn) and published as a table plus the train-vs-eval loss curve.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import task_run

from deployments.run import Run
from tasks.curves import inline_png, plot_loss_curve
from trainer.checkpoint.pins import unpin
from trainer.checkpoint.validate import ValidationResult, validate_checkpoint
from trainer.config import JobConfig
from trainer.data.loader import load_tokenizer, validation_batches
from trainer.evaluate import evaluate_checkpoint
from trainer.metrics import read_metrics
from trainer.rundir import RunDir


def read_evals(run_dir: RunDir) -> list[dict[str, Any]]:
    """Every stored evaluation of the run, by step."""
    return [json.loads(p.read_text()) for p in sorted(run_dir.evals.glob("step-*.json"))]


def _validate_run_name() -> str:
    """Name validation runs after their checkpoint, e.g. ``validate-step-000040``."""
    return "validate-" + task_run.parameters["step_url"].rstrip("/").rsplit("/", 1)[-1]


@task(name="validate-checkpoint", task_run_name=_validate_run_name, tags=["checkpoint"])
def validate_checkpoint_task(step_url: str, job: JobConfig) -> ValidationResult:
    """Prove the checkpoint loads on another world size; marks its manifest validated or corrupt."""
    result = validate_checkpoint(step_url, job)
    if not result.ok:
        get_run_logger().warning("checkpoint step %d is corrupt: %s", result.step, result.reason)
    return result


@task(name="evaluate", tags=["eval"])
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
    assert job.data_url is not None, "evaluation reads the prepared dataset's validation split"
    tokenizer = load_tokenizer(job.data_url)
    result = evaluate_checkpoint(
        validation.step_url,
        job,
        validation_batches(job.data_url, job.train.micro_batch_size, spec.batches),
        tokenizer.encode(spec.sample_prompt).ids,
        spec.sample_tokens,
    )
    record = {
        **asdict(result),
        "sample": spec.sample_prompt + tokenizer.decode(result.sample_ids),
        "url": validation.step_url,
    }
    path = run.dir.eval_record(result.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    create_table_artifact(
        [
            {
                "step": result.step,
                "loss": round(result.loss, 4),
                "perplexity": round(result.perplexity, 2),
                "sample": record["sample"],
            }
        ],
        key=f"{job.name}-eval",
        description=f"Evaluation of {validation.step_url}",
    )
    publish_loss_curve(run.dir, job.name)
    return record


def publish_loss_curve(run_dir: RunDir, name: str) -> Path:
    """Redraw ``loss.png`` from the metrics and stored evaluations, and publish it inline."""
    path = plot_loss_curve(read_metrics(run_dir.metrics), read_evals(run_dir), run_dir.loss_curve)
    create_markdown_artifact(
        inline_png(path, "loss curve"),
        key=f"{name}-loss-curve",
        description="Training loss vs held-out loss per checkpoint",
    )
    return path
