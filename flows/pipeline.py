"""The training pipeline and its two standalone parts, as Prefect flows that only wire tasks.

``train_pipeline``: prepare data → plan → provision → train, and while training runs, validate then
evaluate newly committed checkpoints concurrently (``eval.max_concurrent`` at a time, newest first);
finally a report. ``prepare_data`` and
``evaluate_checkpoints`` are the data and evaluation stages deployable on their own (the latter on
an interval schedule, to catch up on checkpoints of the spec's runs that no pipeline evaluated).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prefect import flow
from prefect.futures import PrefectFuture, wait
from prefect.runtime import flow_run
from prefect.states import Completed, State

from deployments.run import Run, TrainedRun, flow_run_name
from deployments.spec import TrainingSpec
from tasks.cancellation import engine_owned_cancellation
from tasks.checkpoints import (
    evaluate_task,
    evaluated_steps,
    pin_for_evaluation,
    unpin,
    validate_checkpoint_task,
    waiting_checkpoints,
)
from tasks.data import prepare_dataset_task
from tasks.lineage import submit_produced_by
from tasks.logs import one_line_spec_refusals
from tasks.plan import plan_task
from tasks.provision import provisioned
from tasks.report import report_task
from tasks.run import open_run_task
from tasks.train import retry_on_node_failure, train_task

EvalFuture = PrefectFuture[dict[str, Any] | None]
one_line_spec_refusals()  # a spec the server accepted but the flow refuses: one line in the run's log
engine_owned_cancellation()  # a cancelled run is Cancelled right after its tear-down, and its log says so


@flow(name="prepare-data", flow_run_name="prepare-data-{spec.name}")
def prepare_data(spec: TrainingSpec) -> str:
    """Tokenize, pack and shard the spec's corpus (cached); returns the dataset manifest URL."""
    return prepare_dataset_task(spec.data, spec.model.vocab_size, spec.train.seq_len, spec.seed)


@dataclass(frozen=True)
class Evaluation:
    """One checkpoint's validate → evaluate, and the pin that keeps retention off it meanwhile."""

    step: int
    pin_url: str
    future: EvalFuture


def in_flight(evaluation: Evaluation) -> bool:
    """Still validating or evaluating. An evaluation whose validation failed stays ``NotReady`` (a
    pending state, never final): that one is over."""
    state = evaluation.future.state
    return not state.is_final() and state.name != "NotReady"


def submit_evaluations(
    run: Run,
    skip: set[int],
    training: PrefectFuture[str] | None = None,
    running: list[Evaluation] | None = None,
) -> list[Evaluation]:
    """validate → evaluate for each committed checkpoint not in ``skip`` (which it extends), each
    pinned against retention until its evaluation is over.

    ``training``, the (possibly still running) train task that wrote the checkpoints, becomes
    validate's upstream in the run graph without being waited for. With ``running``, the evaluations
    submitted before, at most ``eval.max_concurrent`` run at once and the newest checkpoints go first:
    the others wait for a later call (unpinned meanwhile, so retention may delete them first).
    """
    chosen = waiting_checkpoints(run, skip)
    if running is not None:
        free = max(0, run.spec.eval.max_concurrent - sum(map(in_flight, running)))
        chosen = chosen[::-1][:free]
    evaluations = []
    for manifest in chosen:
        skip.add(manifest.step)
        pin_url = pin_for_evaluation(run, manifest.step)
        if training is None:
            validated = validate_checkpoint_task.submit(manifest.url, run.job)
        else:
            validated = submit_produced_by(
                validate_checkpoint_task, training, "step_url", step_url=manifest.url, job=run.job
            )
        evaluations.append(Evaluation(manifest.step, pin_url, evaluate_task.submit(validated, run, pin_url)))
    return evaluations


def completed(evaluations: list[Evaluation]) -> tuple[list[dict[str, Any]], list[str]]:
    """The evaluations that ran, by step, and one line for each that could not (e.g. its checkpoint was
    unreadable), so the report and the flow's final state show them rather than drop them."""
    wait([e.future for e in evaluations])
    results, missed = [], []
    for evaluation in evaluations:
        unpin(evaluation.pin_url)  # already done by the task, unless it never ran
        if evaluation.future.state.is_completed():
            if (result := evaluation.future.result()) is not None:
                results.append(result)
        else:
            missed.append(f"step {evaluation.step}: {evaluation.future.state.message}")
    return sorted(results, key=lambda r: r["step"]), missed


def train_run_name() -> str:
    """The flow run's name, after the run it opens (``deployments.run.flow_run_name``)."""
    return flow_run_name(flow_run.parameters["spec"], flow_run.get_id())


@flow(name="train-pipeline", flow_run_name=train_run_name)
def train_pipeline(spec: TrainingSpec) -> TrainedRun | State[TrainedRun]:
    """Train ``spec`` end to end as a new run (or the one ``spec.resume_from`` names); returns which run
    that was and its final checkpoint URL."""
    data_url = prepare_dataset_task(spec.data, spec.model.vocab_size, spec.train.seq_len, spec.seed)
    run = open_run_task(spec, data_url)
    plan = plan_task(run)
    train_with_retries = train_task.with_options(
        retries=spec.faults.node_failure_retries,
        retry_delay_seconds=spec.faults.retry_delay_s,
        retry_condition_fn=retry_on_node_failure,
    )
    seen: set[int] = set()
    evaluations: list[Evaluation] = []
    with provisioned(run, after=plan) as target:
        training = train_with_retries.submit(target)
        while spec.eval.enabled and not training.state.is_final():
            evaluations += submit_evaluations(run, seen, training, running=evaluations)
            time.sleep(spec.eval.poll_interval_s)
        final_url = training.result()
    # The checkpoints still waiting, the final one first, as few at once as beside training.
    while spec.eval.enabled and waiting_checkpoints(run, seen):
        evaluations += submit_evaluations(run, seen, training, running=evaluations)
        time.sleep(spec.eval.poll_interval_s)
    results, missed = completed(evaluations)
    report_task(run, final_url, results, missed)
    trained = TrainedRun(run.run_id, str(run.dir.path), final_url)
    # Trained nothing (already complete), or not every checkpoint was evaluated: say so in the final state.
    notes = [training.state.message] if training.state.message else []
    if missed:
        notes.append(f"{len(missed)} evaluation(s) could not run: {'; '.join(missed)}")
    if notes:
        return Completed(message="; ".join(notes), data=trained)
    return trained


@flow(name="evaluate-checkpoints", flow_run_name="evaluate-{spec.name}")
def evaluate_checkpoints(spec: TrainingSpec) -> list[dict[str, Any]]:
    """Validate and evaluate the checkpoints of every run of ``spec`` that have no stored evaluation yet."""
    evaluations: list[Evaluation] = []
    for run_dir in Run.of_spec(spec.name):
        run = Run.load(run_dir)
        evaluations += submit_evaluations(run, evaluated_steps(run))
    return completed(evaluations)[0]
