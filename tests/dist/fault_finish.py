"""torchrun worker for tests/test_faults.py: finish the faulted run, then train the reference.

argv: JOB_JSON RUN_DIR REFERENCE_DIR. The first ``train`` resumes RUN_DIR from its newest good
checkpoint after the injected faults; the second trains the same job uninterrupted in the same
processes (one launch instead of two), so the test compares the two loss curves bitwise.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch.distributed as dist

from trainer.rundir import RunDir
from trainer.train import load_job, train


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)  # "resumed from step N"
    job = load_job(Path(sys.argv[1]))
    train(job, RunDir(Path(sys.argv[2])))
    train(job, RunDir(Path(sys.argv[3])))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
