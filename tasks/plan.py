"""Plan the job before anything is launched: memory, step time, MFU, checkpoint cadence."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from deployments.run import Run
from tasks.curves import inline_png
from trainer.plan import Plan
from trainer.plan.chart import plot_memory_breakdown
from trainer.units import GiB


@task(name="plan", tags=["plan"])
def plan_task(run: Run) -> Plan:
    """Plan the run; publish it as a table and a memory chart (also ``memory.png`` in the run dir).

    The spec has already refused a layout that does not fit, unless it allows oversubscription; then
    this warns instead.
    """
    plan, spec = run.plan, run.spec
    create_table_artifact(
        [
            {"quantity": "memory per chip", "value": f"{plan.memory_per_chip_bytes.total / GiB:.2f} GiB"},
            {"quantity": "fits in HBM", "value": "yes" if plan.fits else "NO"},
            {"quantity": "step time", "value": f"{plan.step_time_s:.3f} s"},
            {"quantity": "MFU", "value": f"{plan.mfu:.1%}"},
            {"quantity": "checkpoint interval", "value": f"{run.job.checkpoint_interval_steps} steps"},
        ],
        key=f"{spec.name}-plan",
        description=f"Plan for {run.run_id}: {spec.model.preset} on {spec.cluster.world_size} × {spec.cluster.chip}",
    )
    chart = plot_memory_breakdown(plan, run.dir.memory_chart)
    create_markdown_artifact(
        inline_png(chart, "memory per chip"),
        key=f"{spec.name}-memory",
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
