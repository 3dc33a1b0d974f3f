"""A training pod's entry point: run its torchrun agent and exit with the worker's contract code.

torchrun exits 1 whenever a worker fails, whatever the reason. Kubernetes decides a pod's fate from
its container's exit code alone (the Job's pod failure policy), so the pod runs its agent under this
wrapper, which exits with the code of :mod:`trainer.failures` instead: :data:`EXIT_USER_ERROR` for a
failure a restart cannot fix (the JobSet then fails at once), :data:`EXIT_HANG` or
:data:`EXIT_INFRA` for a node failure (the JobSet restarts the gang)::

    python -m trainer.runtime.pod --run-dir /var/run/tessera -- python -m torch.distributed.run ... -m trainer.train ...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainer.failures import EXIT_HANG, EXIT_INFRA, EXIT_OK, EXIT_USER_ERROR
from trainer.rundir import RunDir
from trainer.runtime.launch import LaunchResult, run_agents


def pod_exit_code(result: LaunchResult) -> int:
    """The agent's outcome as one exit code of the contract (0, 3, 4 or 5)."""
    if result.kind == "ok":
        return EXIT_OK
    if result.kind == "user_error":
        return EXIT_USER_ERROR
    return EXIT_HANG if result.worker_exit_code == EXIT_HANG else EXIT_INFRA


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.runtime.pod", description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True, help="The pod's scratch run directory.")
    parser.add_argument("agent", nargs=argparse.REMAINDER, help="-- then the torchrun agent's argv.")
    args = parser.parse_args(argv)
    agent = args.agent[1:] if args.agent[:1] == ["--"] else args.agent
    if not agent:
        parser.error("give the torchrun command after --")
    result = run_agents([agent], dict(os.environ), RunDir(args.run_dir), echo=sys.stdout.write)
    code = pod_exit_code(result)
    if code:
        print(
            f"tessera: the attempt failed ({result.kind}), pod exit code {code}", file=sys.stderr, flush=True
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
