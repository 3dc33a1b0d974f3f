"""Evaluate one checkpoint as a Job on the training pool, for a model the orchestrator pod cannot hold.

The Job (``deployments.kubernetes.render.render_eval_manifests``) runs ``python -m trainer.evaluate``
on one node of the pool and writes its record under the run URL; this applies it with the JobSet's client code, follows
its status, reads the record back and deletes the Job, however it ended.
"""

from __future__ import annotations

import json
import time
from typing import Any

from deployments.kubernetes import client, render
from deployments.run import Run
from trainer import storage

POLL_S = 10.0


class EvaluationJobFailed(RuntimeError):
    """The evaluation Job failed; the message has its exit code and the last line of its log."""


def run_eval_job(run: Run, step: int, step_url: str, poll_s: float = POLL_S) -> dict[str, Any]:
    """Evaluate ``step_url`` in a Job on ``run``'s training pool; the record ``trainer.evaluate`` wrote."""
    manifests = render.render_eval_manifests(run, step, step_url)
    render.validate_manifests(manifests)
    job = manifests[-1]
    client.apply_manifests(manifests)
    try:
        while (status := client.job_status(job)).state == "running":
            time.sleep(poll_s)
        if status.state == "failed":
            last = (status.log_tail.strip().splitlines() or ["no log"])[-1]
            raise EvaluationJobFailed(
                f"evaluation Job {job['metadata']['name']} failed with exit code {status.exit_code}: {last}"
            )
        return json.loads(storage.read(render.eval_record_url(run, step)))
    finally:
        client.delete_manifests(manifests, poll_s=poll_s)
