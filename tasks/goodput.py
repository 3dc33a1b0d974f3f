"""The run's goodput (:mod:`trainer.report.goodput`): each launch noted, the breakdown published as an artifact.

The trainer writes its own intervals; all the orchestrator adds is when it launched each attempt, so
the time from launch to the first training process (pods scheduled, images pulled, agents started)
counts as waiting for capacity: Google's scheduling goodput.
"""

from __future__ import annotations

import time

from prefect.artifacts import create_markdown_artifact

from deployments.run import Run
from tasks.keys import artifact_key
from trainer.goodput_log import append_event
from trainer.report.goodput import account_run, format_markdown
from trainer.rundir import RunDir


def record_launch(run_dir: RunDir) -> None:
    append_event(run_dir.goodput, {"kind": "launch", "t": time.time()})


def publish_goodput(run: Run) -> str:
    """The breakdown of the run's wall time as a markdown artifact; the markdown, for ``report.md``."""
    markdown = format_markdown(account_run(run.dir.goodput, run.dir.metrics))
    create_markdown_artifact(
        markdown,
        key=artifact_key(run.run_id, "goodput"),
        description=f"Where run {run.run_id}'s wall time went",
    )
    return markdown
