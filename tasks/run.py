"""Open the flow run's training run: its identity, directory and resolved job (``deployments.run``)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.runtime import flow_run

from deployments.run import Run
from deployments.spec import TrainingSpec


@task(name="open-run")
def open_run_task(spec: TrainingSpec, data_url: str) -> Run:
    """A new run named after this flow run, or the one ``spec.resume_from`` continues.

    A retry of the flow run has the same flow run id, so it reopens the same run and resumes.
    """
    run = Run.open(spec, data_url=data_url, token=flow_run.get_id())
    get_run_logger().info("run %s in %s", run.run_id, run.dir.path)
    return run
