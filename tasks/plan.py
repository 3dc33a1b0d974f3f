"""Plan the job before anything is launched: memory, step time, MFU, checkpoint cadence."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from deployments.eval_placement import eval_placement
from deployments.run import Run
from tasks.curves import inline_png
from tasks.keys import artifact_key
from trainer.plan import Plan
from trainer.plan.measured import planned_vs_measured
from trainer.report.plan_chart import plot_memory_breakdown
from trainer.units import GiB


@task(name="plan")
def plan_task(run: Run) -> Plan:
    """Plan the run; publish it as a table and a memory chart (also ``memory.png`` in the run dir).

    The spec has already refused a layout that does not fit, unless it allows oversubscription; then
    this warns instead.
    """
    plan, spec = run.plan, run.spec
    publish_plan(run, [])
    chart = plot_memory_breakdown(plan, run.dir.memory_chart)
    create_markdown_artifact(
        inline_png(chart, "memory per chip"),
        key=artifact_key(run.run_id, "memory"),
        description=f"Planned memory per chip vs {spec.cluster.chip} HBM",
    )
    if not plan.fits:
        get_run_logger().warning(
            "%s: the planner estimates %.1f GiB per chip, more than a %s holds; launching anyway because "
            "allow_oversubscribe is set",
            run.run_id,
            plan.memory_per_chip_bytes.total / GiB,
            spec.cluster.chip,
        )
    return plan


def plan_rows(run: Run, records: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The plan's figures beside the run's measured ones (``-`` until it has logged steps)."""
    blank = {"measured": "-", "measured / planned": "-"}
    return [
        *(figure.cells() for figure in planned_vs_measured(run.plan, records)),
        {"quantity": "fits in HBM", "planned": "yes" if run.plan.fits else "NO", **blank},
        {"quantity": "checkpoint interval", "planned": f"{run.job.checkpoint_interval_steps} steps", **blank},
        {"quantity": "evaluation", "planned": eval_placement(run.spec).line, **blank},
    ]


def publish_plan(run: Run, records: list[dict[str, Any]]) -> None:
    """The plan artifact; the report publishes it again once the run has measured figures."""
    spec = run.spec
    create_table_artifact(
        plan_rows(run, records),
        key=artifact_key(run.run_id, "plan"),
        description=f"Plan{' vs measured' if records else ''} for {run.run_id}: {spec.model.preset} on "
        f"{spec.cluster.world_size} × {spec.cluster.chip}",
    )
