"""torchrun worker (2 processes, gloo): resume the 4-rank checkpoint into FSDP2 over 2 ranks.

Run by tests/test_checkpoint.py after tests/dist/ckpt_save.py, with the same OUT_DIR as argv[1]:
loads the latest checkpoint of ``OUT_DIR/async``, and rank 0 writes its unsharded state to
``OUT_DIR/resharded.pt``; then trains one more step and saves it in async_process mode to
``OUT_DIR/process`` (the checkpoint process re-imports this module: hence the ``__main__`` guard).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.ckpt_common import JOB, TOKENS_PER_STEP, Trainee, init_distributed
from trainer.checkpoint import CheckpointManager
from trainer.config import CheckpointConfig


def main(out: Path) -> None:
    rank, world = init_distributed()
    trainee = Trainee(world, rank)
    state = trainee.state()
    resumed = CheckpointManager(
        str(out / "async"),
        CheckpointConfig(mode="async"),
        2,
        JOB.model_fingerprint(),
        world,
        rank,
        {"dp_shard": world},
    )
    manifest = resumed.latest()
    resumed.load(manifest, state)
    loaded = trainee.full_state()
    if rank == 0:
        torch.save({"step": manifest.step, **loaded}, out / "resharded.pt")

    step = manifest.step + 1
    trainee.step()
    process = CheckpointManager(
        str(out / "process"),
        CheckpointConfig(mode="async_process"),
        1,
        JOB.model_fingerprint(),
        world,
        rank,
        {"dp_shard": world},
    )
    process.maybe_save(step, state, {"tokens": step * TOKENS_PER_STEP})
    process.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
