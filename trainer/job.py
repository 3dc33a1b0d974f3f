"""A job made ready to train: its checkpoint location and cadence decided, once.

``deployments.run.Run`` resolves the job when it opens a run and writes it to ``job.json``; the
torchrun entry point resolves what it reads again only so that a hand-written ``job.json`` (the
``python -m trainer.train`` docstring) works too. For a job the Run wrote, that is a no-op.
"""

from __future__ import annotations

from trainer.config import JobConfig
from trainer.plan import Plan, resolve_checkpoint_interval, resolve_memory_interval
from trainer.rundir import RunDir


def resolve_job(job: JobConfig, run_dir: RunDir, plan: Plan | None = None) -> JobConfig:
    """``job`` with ``checkpoint.url`` defaulted to the run's (absolute, so every process agrees on it)
    and both tiers' intervals fixed (the planner's Young/Daly optima for ``auto``; see trainer.plan).
    ``plan``: the job's plan, which a Run has built once; without it one is built for an ``auto`` tier."""
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
        }
    )
