"""What an elastic resize means for the checkpoint tiers: host-memory snapshots hold one layout's
local shards, so they restore only into that layout, and are freed for every other node count."""

from __future__ import annotations

import shutil
from typing import Any

import torch.distributed as dist

from trainer.backends.base import local_rank
from trainer.checkpoint import CheckpointManager
from trainer.checkpoint.ram_tier import memory_directory
from trainer.config import JobConfig
from trainer.elastic import resized_job


def same_layout(layout: dict[str, Any], world_size: int, job: JobConfig) -> bool:
    """Whether a checkpoint saved with ``layout`` on ``world_size`` processes is in ``job``'s layout."""
    return world_size == job.parallel.world_size and layout == job.parallel.model_dump()


def memory_tier_current(ckpt: CheckpointManager, job: JobConfig) -> bool:
    """Whether host-memory snapshots may be restored (on every rank alike, from rank 0's listing).

    They hold this layout's local shards, so they continue only a timeline whose newest stored checkpoint
    is in this layout too: after a resize the newest is in the other layout, and any snapshots of this
    layout predate it (an abandoned timeline), so the restore must come from storage.
    """
    latest = ckpt.latest() if ckpt.rank == 0 else None
    box = [latest is None or same_layout(latest.layout, latest.world_size, job)]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def discard_other_sizes(spec: JobConfig, running: JobConfig) -> None:
    """The run is done: free the host memory that snapshots taken at other node counts hold on this
    host (the tier itself frees only the layout it ran in). Once per host, by local rank 0."""
    if spec.faults.min_nodes is None or spec.memory_interval_steps is None or local_rank() != 0:
        return
    for nodes in range(spec.faults.min_nodes, spec.hardware.nodes + 1):
        if nodes != running.hardware.nodes:
            shutil.rmtree(memory_directory(resized_job(spec, nodes)), ignore_errors=True)
