"""Plan the job before anything is launched: memory, step time, MFU, checkpoint cadence."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from deployments.spec import SpecError, TrainingSpec
from tasks.curves import inline_png
from tasks.paths import run_dir
from trainer.config import JobConfig
from trainer.plan import Plan, plan_for_job, resolve_checkpoint_interval
from trainer.plan.chart import plot_memory_breakdown

GiB = 2**30


class PlanDoesNotFit(SpecError):
    """The planner estimates the job exceeds the chips' memory; retrying cannot help."""


def job_for(spec: TrainingSpec, data_url: str | None) -> JobConfig:
    """The trainer's job: the checkpoint interval resolved (Young/Daly for 'auto'), checkpoints by default
    under ``runs/<name>/checkpoints`` (absolute, so every process and task agrees on it)."""
    job = spec.job_config(data_url)
    checkpoint = job.checkpoint
    if checkpoint.url is None:
        checkpoint = checkpoint.model_copy(update={"url": str(run_dir(spec) / "checkpoints")})
    return job.model_copy(
        update={"checkpoint": checkpoint, "checkpoint_interval_steps": resolve_checkpoint_interval(job)}
    )


@task(name="plan", tags=["plan"])
def plan_task(spec: TrainingSpec, data_url: str | None) -> Plan:
    """Plan ``spec``; publish it as a table and a memory chart (also ``memory.png`` in the run dir).

    Refuses a job that will not fit unless the spec allows oversubscription.
    """
    job = job_for(spec, data_url)
    plan = plan_for_job(job)
    create_table_artifact(
        [
            {"quantity": "memory per chip", "value": f"{plan.memory_per_chip_bytes.total / GiB:.2f} GiB"},
            {"quantity": "fits in HBM", "value": "yes" if plan.fits else "NO"},
            {"quantity": "step time", "value": f"{plan.step_time_s:.3f} s"},
            {"quantity": "MFU", "value": f"{plan.mfu:.1%}"},
            {"quantity": "checkpoint interval", "value": f"{job.checkpoint_interval_steps} steps"},
        ],
        key=f"{spec.name}-plan",
        description=f"Plan for {spec.name}: {spec.model.preset} on {spec.cluster.world_size} × {spec.cluster.chip}",
    )
    chart = plot_memory_breakdown(plan, run_dir(spec) / "memory.png")
    create_markdown_artifact(
        inline_png(chart, "memory per chip"),
        key=f"{spec.name}-memory",
        description=f"Planned memory per chip vs {spec.cluster.chip} HBM",
    )
    if not plan.fits:
        message = (
            f"{spec.name}: the planner estimates {plan.memory_per_chip_bytes.total / GiB:.1f} GiB per chip, more "
            f"than a {spec.cluster.chip} holds"
        )
        if not spec.allow_oversubscribe:
            raise PlanDoesNotFit(
                f"{message}; add chips, raise parallel.dp_shard/tp/pp, enable parallel.activation_checkpointing, "
                "or set allow_oversubscribe: true"
            )
        get_run_logger().warning("%s; launching anyway because allow_oversubscribe is set", message)
    return plan
