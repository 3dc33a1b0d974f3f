"""One way for tests to launch real torchrun jobs over gloo, and to show why one failed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from trainer.runtime.launch import through_shared_fork_server

REPO = Path(__file__).resolve().parents[1]


def run_torchrun(
    target: Sequence[str], nproc: int, env: Mapping[str, str] | None = None, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --standalone --nproc-per-node=N TARGET...`` from the repo root; assert it succeeded.

    ``target`` is what follows the launcher's own flags: ``["-m", "tests.dist.x", ARG]`` or a script path.
    Ranks get one intra-op thread each, since several share the 2 cores of a CI box. With the session's
    fork server (``tests/warm_workers.py``) they are forked from it, as ``run_agents`` forks a run's ranks.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *target,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    (cmd,), full_env = through_shared_fork_server([cmd], full_env)  # the session's, if any
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, (
        f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    )
    return proc
