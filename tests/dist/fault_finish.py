"""torchrun worker for tests/test_faults.py: finish the faulted run, then train the reference.

argv: JOB_JSON RUN_DIR REFERENCE_DIR. JOB_JSON is the job resolved for RUN_DIR, as the faulted launches
read it. The first ``train`` resumes RUN_DIR from its newest good checkpoint after the injected faults;
the second trains the same job uninterrupted in the same processes (one launch instead of two), with
checkpoints of its own in REFERENCE_DIR, so the test compares the two loss curves bitwise.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch.distributed as dist

from trainer.config import JobConfig
from trainer.rundir import RunDir
from trainer.train import load_job, train


def relocated(job: JobConfig, run_dir: RunDir) -> JobConfig:
    """``job`` with its checkpoints in ``run_dir``, where resolving it for that directory puts them."""
    checkpoint = job.checkpoint.model_copy(update={"url": str(run_dir.checkpoints.resolve())})
    return job.model_copy(update={"checkpoint": checkpoint})


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)  # "resumed from step N"
    job = load_job(Path(sys.argv[1]))
    train(job, RunDir(Path(sys.argv[2])))
    reference = RunDir(Path(sys.argv[3]))
    train(relocated(job, reference), reference)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
