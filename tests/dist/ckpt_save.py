"""torchrun worker (4 processes, gloo): train 8 steps of FSDP2 over 4 ranks, checkpointing two ways.

Run by tests/test_checkpoint.py with OUT_DIR as argv[1]:
- ``OUT_DIR/async``: async thread mode, every 2 steps, keep_last=2, keep_every=4 (so 4, 6, 8 remain).
  A partial ``step-000003`` (a killed earlier write: shards, no manifest) is planted first; retention
  must remove it.
- ``OUT_DIR/sync``: sync mode, every 3 steps plus a forced save at the last step, keep_last=2 (6, 8 remain).
Rank 0 then writes the unsharded state after step 8 to ``OUT_DIR/reference.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.ckpt_common import JOB, TOKENS_PER_STEP, Trainee, init_distributed
from trainer.checkpoint import CheckpointManager
from trainer.config import CheckpointConfig

STEPS = 8


def main(out: Path) -> None:
    rank, world = init_distributed()
    if rank == 0:
        (out / "async" / "step-000003").mkdir(parents=True)
        (out / "async" / "step-000003" / "__0_0.distcp").write_bytes(b"torn write")
    dist.barrier()
    trainee = Trainee(world, rank)
    managers = [
        CheckpointManager(
            str(out / "async"),
            CheckpointConfig(mode="async", keep_last=2, keep_every=4),
            2,
            JOB.model_fingerprint(),
            world,
            rank,
            {"dp_shard": world},
        ),
        CheckpointManager(
            str(out / "sync"),
            CheckpointConfig(mode="sync", keep_last=2),
            3,
            JOB.model_fingerprint(),
            world,
            rank,
            {"dp_shard": world},
        ),
    ]
    state = trainee.state()
    for step in range(1, STEPS + 1):
        trainee.step()
        for manager in managers:
            manager.maybe_save(step, state, {"tokens": step * TOKENS_PER_STEP}, force=step == STEPS)
    for manager in managers:
        manager.close()
    reference = trainee.full_state()
    if rank == 0:
        torch.save(reference, out / "reference.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
