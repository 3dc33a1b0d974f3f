"""Replica groups for ``faults.replica_fault_tolerance`` on the host: each group's command, and the
run's Lighthouse (torchft is imported only to host it). What a group is lives in ``trainer.replicas``;
what runs inside a replica is ``trainer.rank.replica_ft``.

On Kubernetes the Lighthouse is a pod of its own, serving until it is stopped::

    python -m trainer.runtime.replica_groups --job /etc/tessera/job.json --port 29510
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config import JobConfig
from trainer.replicas import LIGHTHOUSE_ENV, REPLICA_ENV, replica_run_dir

if TYPE_CHECKING:
    from torchft.coordination import LighthouseServer

# How long the Lighthouse waits for a replica's heartbeat before forming a quorum without it: the
# survivors' stall after a replica dies (its gloo peers usually see the closed socket sooner).
HEARTBEAT_TIMEOUT_S = 5.0


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
    from trainer.runtime.launch import torchrun_command  # the launcher imports this module, not the reverse

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
    parser = argparse.ArgumentParser(
        prog="python -m trainer.runtime.replica_groups", description=main.__doc__
    )
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
