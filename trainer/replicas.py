"""Replica groups as the job sees them (``faults.replica_fault_tolerance``): their environment, the
spec's checks, each group's job and run directory. Torch-free, so spec validation stays fast; the host
launches the groups (``trainer.runtime.replica_groups``) and each rank runs ``trainer.rank.replica_ft``.
"""

from __future__ import annotations

from pathlib import Path

from trainer.config import CheckpointConfig, FaultsConfig, HardwareConfig, JobConfig, ParallelConfig

# torchft's own names for the two things a replica group's workers must be told.
REPLICA_ENV = "REPLICA_GROUP_ID"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# Splits a replica group cannot have yet: FSDP, TP, PP and EP are tested under a replica's loss and heal.
UNSUPPORTED_SPLITS = ("cp",)


def replica_ft_errors(
    parallel: ParallelConfig, faults: FaultsConfig, checkpoint: CheckpointConfig, nodes: int
) -> list[str]:
    """Why the spec cannot run with replica fault tolerance, one message per problem naming the fix."""
    if not faults.replica_fault_tolerance:
        return []
    errors = []
    if parallel.dp_replicate < 2:
        errors.append(
            f"faults.replica_fault_tolerance needs parallel.dp_replicate > 1 (now {parallel.dp_replicate}): "
            "the replica groups fail over to each other; raise dp_replicate or turn it off"
        )
    elif nodes % parallel.dp_replicate:
        errors.append(
            f"faults.replica_fault_tolerance makes each replica group whole nodes, so that a lost node costs "
            f"one replica: cluster.nodes ({nodes}) must be a multiple of parallel.dp_replicate "
            f"({parallel.dp_replicate})"
        )
    splits = {name: getattr(parallel, name) for name in UNSUPPORTED_SPLITS}
    if any(degree > 1 for degree in splits.values()):
        now = ", ".join(f"{name}={degree}" for name, degree in splits.items())
        errors.append(
            "faults.replica_fault_tolerance supports FSDP, TP, PP and EP inside a replica group for now: set "
            f"parallel.{' and '.join(UNSUPPORTED_SPLITS)} to 1 (now {now}), or turn it off"
        )
    if faults.min_nodes is not None:
        errors.append(
            "faults.min_nodes (elastic) and faults.replica_fault_tolerance are two answers to a lost node; "
            "unset faults.min_nodes"
        )
    if checkpoint.memory_interval != "off":
        errors.append(
            "faults.replica_fault_tolerance heals from a live replica, not from host memory: set "
            "checkpoint.memory_interval to off"
        )
    return errors


def replica_job(job: JobConfig, replica: int) -> JobConfig:
    """What one replica group trains: the job without the replicate dimension, on its own chip, with its
    own checkpoints (replica 0 keeps the job's location, so the pipeline's watchers follow it)."""
    url, run_url = job.checkpoint.url, job.run_url
    if replica > 0:
        url = f"{url.rstrip('/')}-replica-{replica}" if url is not None else None
        run_url = f"{run_url.rstrip('/')}/replica-{replica}" if run_url is not None else None
    return job.model_copy(
        update={
            "run_url": run_url,
            "parallel": job.parallel.model_copy(update={"dp_replicate": 1}),
            "hardware": HardwareConfig(
                accelerator=job.hardware.accelerator,
                chip=job.hardware.chip,
                mtbf_hours=job.hardware.mtbf_hours,
            ),
            "checkpoint": job.checkpoint.model_copy(update={"url": url}),
        }
    )


def replica_run_dir(run_dir: Path, replica: int) -> Path:
    """Replica 0 writes the run's own metrics and status; the others, a directory of their own in it."""
    return run_dir if replica == 0 else run_dir / f"replica-{replica}"
