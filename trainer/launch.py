"""Launch ``python -m trainer.train`` under torchrun: the command, its environment, and a local run.

The same command serves every target: one agent per host, ``--standalone`` on one host, a shared
c10d rendezvous across hosts (or across several agents on 127.0.0.1 to simulate them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.backends import get_backend
from trainer.config import JobConfig
from trainer.failures import FailureKind, UserError, classify_exit, worker_exit_code

JOB_FILE = "job.json"
LOG_TAIL_LINES = 200  # enough to hold torchrun's root-cause block and the ranks' last words


def torchrun_command(
    job_json: Path,
    run_dir: Path,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    run_id: str = "tessera",
    entry: Sequence[str] | None = None,
) -> list[str]:
    """argv for one torchrun agent; ``rdzv_endpoint`` (host:port) is required when ``nnodes > 1``.

    ``entry`` replaces what the workers run (default: ``-m trainer.train --spec JOB --run-dir DIR``).
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
    ]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise UserError(f"nnodes={nnodes} needs rdzv_endpoint=host:port of the rendezvous (node 0)")
        # c10d assigns node ranks itself; node_rank only orders agents that share one host name.
        cmd += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={run_id}",
        ]
    if entry is None:
        entry = ["-m", "trainer.train", "--spec", str(job_json), "--run-dir", str(run_dir)]
    return [*cmd, *entry]


def launch_env(job: JobConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The workers' environment: the caller's, plus the backend's variables, plus unbuffered output
    so a rank's last words reach the log before it dies."""
    env = dict(os.environ if base is None else base)
    env.update(get_backend(job.hardware.accelerator).launch_env(job.hardware.chips_per_node))
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass(frozen=True)
class LaunchResult:
    returncode: int  # torchrun's own code (1 whenever a worker failed)
    worker_exit_code: int  # the first failed worker's code (the contract in trainer.failures)
    kind: FailureKind
    log_tail: str


def write_job(job: JobConfig, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / JOB_FILE
    path.write_text(job.model_dump_json(indent=2))
    return path


def run_local(job: JobConfig, run_dir: Path, nproc: int | None = None, echo: bool = True) -> LaunchResult:
    """Run the job on this host with one torchrun agent, streaming its output; never raises on failure.

    ``nproc`` defaults to the job's world size; any other value is refused up front, since the
    parallel degrees in the spec must multiply to the number of processes.
    """
    world = job.parallel.world_size
    nproc = world if nproc is None else nproc
    if nproc != world:
        raise UserError(
            f"--nproc {nproc} does not match the spec's world size {world} (dp_replicate×dp_shard×tp×pp); "
            f"pass --nproc {world} or change parallel/cluster in the spec"
        )
    cmd = torchrun_command(
        write_job(job, run_dir), run_dir, nproc, max_restarts=job.faults.max_restarts, run_id=job.name
    )
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    with subprocess.Popen(
        cmd, env=launch_env(job), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            if echo:
                sys.stdout.write(line)
    log_tail = "".join(tail)
    return LaunchResult(
        proc.returncode,
        worker_exit_code(proc.returncode, log_tail),
        classify_exit(proc.returncode, log_tail),
        log_tail,
    )
