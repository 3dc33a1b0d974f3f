"""torchrun worker (2 processes, gloo): several training runs in one launch, run by tests/test_train.py.

argv: JOB_JSON BASE_DIR RESULT_JSON. BASE_DIR/from4 already holds a 4-process run's step-4 checkpoint.
Runs, in order, each with ``trainer.train.train`` in these same processes, the job resolved for its
directory as a Run resolves it:

- ``a`` and ``b``: the same job into two directories (determinism);
- ``from4``: resumes the 4-process checkpoint on 2 processes (DCP resharding) and finishes;
- bad inputs, each expected to fail with a user error before touching any checkpoint: a NaN loss
  (fault hook), another model shape resuming ``a``, a spec for 4 processes, a checkpoint URL no
  filesystem serves.

Rank 0 writes {run: error message or null} to RESULT_JSON; the test reads the run directories.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from trainer.checkpoint import CheckpointError
from trainer.config import JobConfig
from trainer.failures import UserError
from trainer.job import resolve_job
from trainer.rundir import RunDir
from trainer.train import train


def train_in(job: JobConfig, run_dir: Path) -> None:
    """Train ``job`` resolved for ``run_dir``, as a Run would write it there."""
    train(resolve_job(job, RunDir(run_dir)), RunDir(run_dir))


def attempt(job: JobConfig, run_dir: Path) -> str | None:
    """The user-error message of a run that must fail, or None if it (wrongly) succeeded."""
    try:
        train_in(job, run_dir)
    except (UserError, CheckpointError) as exc:
        return str(exc)
    return None


def main() -> None:
    job = JobConfig.model_validate_json(Path(sys.argv[1]).read_text())
    base, result_path = Path(sys.argv[2]), Path(sys.argv[3])
    train_in(job, base / "a")
    train_in(job, base / "b")
    train_in(job, base / "from4")

    errors: dict[str, str | None] = {}
    os.environ["TESSERA_FAULT_NAN_AT_STEP"] = "5"
    errors["nan"] = attempt(job, base / "nan")
    del os.environ["TESSERA_FAULT_NAN_AT_STEP"]
    wider = job.model.model_dump() | {"dim": job.model.dim * 2}
    errors["other_model"] = attempt(job.model_copy(update={"model": type(job.model)(**wider)}), base / "a")
    four = job.model_dump() | {
        "parallel": job.parallel.model_dump() | {"dp_shard": 4},
        "hardware": job.hardware.model_dump() | {"chips_per_node": 4},
    }
    errors["world_size"] = attempt(JobConfig.model_validate(four), base / "four")
    unusable = job.checkpoint.model_copy(update={"url": "nosuch://bucket/ckpt"})
    errors["checkpoint_url"] = attempt(job.model_copy(update={"checkpoint": unusable}), base / "unusable")
    if dist.get_rank() == 0:
        result_path.write_text(json.dumps(errors))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
