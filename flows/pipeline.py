"""The training pipeline and its two standalone parts, as Prefect flows that only wire tasks.

``train_pipeline``: prepare data → plan → provision → train, and while training runs, validate then
evaluate every newly committed checkpoint concurrently; finally a report. ``prepare_data`` and
``evaluate_checkpoints`` are the data and evaluation stages deployable on their own (the latter on
an interval schedule, to catch up on checkpoints no pipeline evaluated).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.futures import PrefectFuture, wait

from deployments.spec import EvalSpec, TrainingSpec
from tasks.checkpoints import eval_path, evaluate_task, validate_checkpoint_task
from tasks.data import prepare_dataset_task
from tasks.lineage import submit_produced_by
from tasks.paths import run_dir
from tasks.plan import job_for, plan_task
from tasks.provision import provisioned
from tasks.report import report_task
from tasks.train import retry_on_node_failure, train_task
from trainer.checkpoint.manifest import list_checkpoints
from trainer.config import JobConfig

EvalFuture = PrefectFuture[dict[str, Any] | None]


@flow(name="prepare-data", flow_run_name="prepare-data-{spec.name}")
def prepare_data(spec: TrainingSpec) -> str:
    """Tokenize, pack and shard the spec's corpus (cached); returns the dataset manifest URL."""
    return prepare_dataset_task(spec.data, spec.model.vocab_size, spec.train.seq_len, spec.seed)


def submit_evaluations(
    job: JobConfig,
    spec: EvalSpec,
    directory: Path,
    skip: set[int],
    training: PrefectFuture[str] | None = None,
) -> list[EvalFuture]:
    """validate → evaluate for each committed checkpoint not in ``skip`` (which it extends).

    ``training``, the (possibly still running) train task that wrote the checkpoints, becomes
    validate's upstream in the run graph without being waited for.
    """
    futures = []
    for manifest in list_checkpoints(job.checkpoint.url):
        if manifest.step in skip or not manifest.good:
            continue
        skip.add(manifest.step)
        if training is None:
            validated = validate_checkpoint_task.submit(manifest.url, job)
        else:
            validated = submit_produced_by(
                validate_checkpoint_task, training, "step_url", step_url=manifest.url, job=job
            )
        futures.append(evaluate_task.submit(validated, job, spec, directory))
    return futures


def completed(futures: list[EvalFuture]) -> list[dict[str, Any]]:
    """Results of the evaluations that finished (a checkpoint retention deleted mid-way is skipped)."""
    wait(futures)
    results = [f.result() for f in futures if f.state.is_completed()]
    return sorted((r for r in results if r is not None), key=lambda r: r["step"])


@flow(name="train-pipeline", flow_run_name="train-{spec.name}")
def train_pipeline(spec: TrainingSpec) -> str:
    """Train ``spec`` end to end; returns the final checkpoint URL."""
    data_url = prepare_dataset_task(spec.data, spec.model.vocab_size, spec.train.seq_len, spec.seed)
    plan = plan_task(spec, data_url)
    job = job_for(spec, data_url)
    train = train_task.with_options(
        retries=spec.faults.node_failure_retries,
        retry_delay_seconds=spec.faults.retry_delay_s,
        retry_condition_fn=retry_on_node_failure,
    )
    directory = run_dir(spec)
    seen: set[int] = set()
    evaluations: list[EvalFuture] = []
    with provisioned(spec, job, after=plan) as cluster:
        training = train.submit(cluster, job)
        while spec.eval.enabled and not training.state.is_final():
            evaluations += submit_evaluations(job, spec.eval, directory, seen, training)
            time.sleep(spec.eval.poll_interval_s)
        final_url = training.result()
    if spec.eval.enabled:
        evaluations += submit_evaluations(job, spec.eval, directory, seen, training)  # the final checkpoint
    report_task(spec, plan, job, final_url, directory, completed(evaluations))
    return final_url


@flow(name="evaluate-checkpoints", flow_run_name="evaluate-{spec.name}")
def evaluate_checkpoints(spec: TrainingSpec) -> list[dict[str, Any]]:
    """Validate and evaluate the run's checkpoints that have no stored evaluation yet."""
    data_url = prepare_dataset_task(spec.data, spec.model.vocab_size, spec.train.seq_len, spec.seed)
    job, directory = job_for(spec, data_url), run_dir(spec)
    done = {m.step for m in list_checkpoints(job.checkpoint.url) if eval_path(directory, m.step).exists()}
    return completed(submit_evaluations(job, spec.eval, directory, done))
