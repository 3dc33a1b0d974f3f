"""Replica groups for ``faults.replica_fault_tolerance``: the spec's checks, each group's job and
command, and the run's Lighthouse. Torch-free, so spec validation stays fast (torchft is imported only
to host the Lighthouse); what runs inside a replica is ``trainer.replica_ft``.

On Kubernetes the Lighthouse is a pod of its own, serving until it is stopped::

    python -m trainer.replica_groups --job /etc/tessera/job.json --port 29510
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config import CheckpointConfig, FaultsConfig, HardwareConfig, JobConfig, ParallelConfig

if TYPE_CHECKING:
    from torchft.coordination import LighthouseServer

# torchft's own names for the two things a replica group's workers must be told.
REPLICA_ENV = "REPLICA_GROUP_ID"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# How long the Lighthouse waits for a replica's heartbeat before forming a quorum without it: the
# survivors' stall after a replica dies (its gloo peers usually see the closed socket sooner).
HEARTBEAT_TIMEOUT_S = 5.0
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


def start_lighthouse(
    job: JobConfig, bind: str = "[::]:0", heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
) -> LighthouseServer:
    """The Lighthouse the replica groups form quorums at (one per run; the launcher holds it).

    min_replicas=1: a single survivor keeps training. A heartbeat missed for ``heartbeat_timeout_s``
    (at most the collective timeout) drops a replica from the next quorum.
    """
    from torchft.coordination import LighthouseServer

    heartbeat = min(heartbeat_timeout_s, job.faults.collective_timeout_s)
    return LighthouseServer(
        bind=bind,
        min_replicas=1,
        join_timeout_ms=int(job.faults.collective_timeout_s * 1000),
        heartbeat_timeout_ms=int(heartbeat * 1000),
    )


def replica_commands(job: JobConfig, job_json: Path, run_dir: Path, lighthouse: str) -> list[list[str]]:
    """argv of one standalone torchrun per replica group (all its ranks on this host), each with its
    own ``faults.max_restarts``; the replica id and the Lighthouse's address reach the workers through
    ``env``."""
    from trainer.launch import torchrun_command  # the launcher imports this module, not the reverse

    return [
        [
            "env",
            f"{REPLICA_ENV}={replica}",
            f"{LIGHTHOUSE_ENV}={lighthouse}",
            *torchrun_command(
                job_json,
                replica_run_dir(run_dir, replica),
                nproc_per_node=job.parallel.world_size // job.parallel.dp_replicate,
                max_restarts=job.faults.max_restarts,
                warm_restart=job.faults.warm_restart,
            ),
        ]
        for replica in range(job.parallel.dp_replicate)
    ]


def lighthouse_address(server: LighthouseServer, host: str = "127.0.0.1") -> str:
    """The server's address with a host the replicas can resolve (torchft advertises the host name)."""
    port = server.address().rsplit(":", 1)[1]
    return f"http://{host}:{port}"


@contextmanager
def replica_groups(
    job: JobConfig, job_json: Path, run_dir: Path, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
) -> Iterator[list[list[str]]]:
    """The run's Lighthouse, up for as long as the block runs, and one torchrun command per replica
    group (for ``run_agents``), their run directories made; the Lighthouse listens on this host, on a
    free port."""
    for replica in range(1, job.parallel.dp_replicate):
        replica_run_dir(run_dir, replica).mkdir(parents=True, exist_ok=True)
    server = start_lighthouse(job, heartbeat_timeout_s=heartbeat_timeout_s)
    try:
        yield replica_commands(job, job_json, run_dir, lighthouse_address(server))
    finally:
        server.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Serve the run's Lighthouse on ``--port`` until SIGTERM or SIGINT (its pod's whole life)."""
    parser = argparse.ArgumentParser(prog="python -m trainer.replica_groups", description=main.__doc__)
    parser.add_argument("--job", type=Path, required=True, help="The run's job.json (its faults settings).")
    parser.add_argument("--port", type=int, required=True, help="The port the replica groups reach it on.")
    args = parser.parse_args(argv)
    job = JobConfig.model_validate_json(args.job.read_text())
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # before the server's threads start: they inherit it
    server = start_lighthouse(job, bind=f"[::]:{args.port}")
    print(
        f"tessera: Lighthouse for {job.parallel.dp_replicate} replica groups on port {args.port}", flush=True
    )
    signal.sigwait(stop)
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
