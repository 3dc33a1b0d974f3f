"""A job made ready to train: its checkpoint location, cadences and FLOPs per step decided, once.

``deployments.run.Run`` resolves the job when it opens a run and writes it to ``job.json``; the
torchrun entry point trusts what it reads and plans nothing (:func:`require_resolved` refuses a job
that was not resolved). A library caller or a test resolves its job here before training it.
"""

from __future__ import annotations

from trainer.config import JobConfig
from trainer.failures import UserError
from trainer.plan import Plan, plan_for_job, resolve_checkpoint_interval, resolve_memory_interval
from trainer.rundir import RunDir


def resolve_job(job: JobConfig, run_dir: RunDir, plan: Plan | None = None) -> JobConfig:
    """``job`` with ``checkpoint.url`` defaulted to the run's (absolute, so every process agrees on it),
    both tiers' intervals fixed (the planner's Young/Daly optima for ``auto``; see trainer.plan) and the
    model FLOPs per step that MFU is measured against. ``plan``: the job's plan, which a Run has built
    once; a library caller without one gets it built here."""
    plan = plan if plan is not None else plan_for_job(job)
    checkpoint = job.checkpoint
    if checkpoint.url is None:
        checkpoint = checkpoint.model_copy(update={"url": str(run_dir.checkpoints.resolve())})
    interval = job.checkpoint_interval_steps or resolve_checkpoint_interval(job, plan)
    memory = job.memory_interval_steps or resolve_memory_interval(job, plan)
    return job.model_copy(
        update={
            "checkpoint": checkpoint,
            "checkpoint_interval_steps": interval,
            "memory_interval_steps": memory,
            "flops_per_step": job.flops_per_step or plan.flops_per_step,
        }
    )


def require_resolved(job: JobConfig) -> None:
    """Refuse a job :func:`resolve_job` has not seen, naming what it lacks: a rank reads these from the
    job rather than plan them itself."""
    missing = [
        name
        for name, value in (
            ("checkpoint.url", job.checkpoint.url),
            ("checkpoint_interval_steps", job.checkpoint_interval_steps),
            ("flops_per_step", job.flops_per_step),
        )
        if value is None
    ]
    if job.checkpoint.memory_interval != "off" and job.memory_interval_steps is None:
        missing.append("memory_interval_steps")
    if missing:
        raise UserError(
            f"the job is not resolved ({', '.join(missing)} unset): write job.json with "
            "`tessera train SPEC --run-dir DIR`, or pass the job through trainer.job.resolve_job"
        )
