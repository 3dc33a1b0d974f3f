"""Checkpoint size, write time, and the Young/Daly interval that minimises expected lost work.

Young (1974): τ = sqrt(2·C·M); Daly (2006) higher order: τ = sqrt(2CM)·[1 + ⅓·sqrt(C/2M) + ⅑·(C/2M)] − C
for C < 2M, else τ = M. C is the time training is *blocked* per checkpoint: the whole write for sync
saves, only the device→host staging copy for async DCP (PyTorch's async-checkpointing blog: a 7B
model's downtime 148.8 s sync → 6.3 s async). M is the job's MTBF: ``hardware.mtbf_hours``, or
1 / (failures per chip-hour × chips) with the Llama 3 rate (``trainer.backends.chips``; 16,384
H100s → one interruption every ~3.1 h, matching Dubey et al. 2024). An async save must finish before
the next one starts, so the interval is never shorter than the full write.
"""

from __future__ import annotations

import math

from trainer.backends.chips import Chip
from trainer.config import CheckpointConfig, HardwareConfig
from trainer.plan.layout import Geometry

CHECKPOINT_BYTES_PER_PARAM = 4 + 8  # fp32 weights + AdamW m, v (gradients are not saved)
# Device→host staging copy for async saves (assumed: PCIe Gen4 x16 effective ~25 GB/s per chip).
HOST_STAGING_BANDWIDTH = 25e9


def checkpoint_bytes(geo: Geometry) -> float:
    """DCP writes each shard once: replicas (dp_replicate) dedupe, so the size is the model's, not ×dp."""
    return CHECKPOINT_BYTES_PER_PARAM * geo.counts.total


def write_seconds(geo: Geometry, hardware: HardwareConfig, checkpoint: CheckpointConfig) -> float:
    """Every node writes its shards in parallel at ``write_bandwidth_gbps`` GB/s."""
    return checkpoint_bytes(geo) / (hardware.nodes * checkpoint.write_bandwidth_gbps * 1e9)


def blocking_seconds(geo: Geometry, hardware: HardwareConfig, checkpoint: CheckpointConfig) -> float:
    """C in Young/Daly: what training waits for per checkpoint."""
    if checkpoint.mode == "sync":
        return write_seconds(geo, hardware, checkpoint)
    per_chip = checkpoint_bytes(geo) / hardware.world_size
    return per_chip / HOST_STAGING_BANDWIDTH


def mtbf_seconds(chip: Chip, hardware: HardwareConfig) -> float:
    hours = hardware.mtbf_hours or 1 / (chip.failures_per_chip_hour * hardware.world_size)
    return hours * 3600


def daly_interval_seconds(blocking_s: float, mtbf_s: float) -> float:
    """Daly's optimum compute time between checkpoints (reduces to Young's sqrt(2CM) for C ≪ M)."""
    if blocking_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = blocking_s / (2 * mtbf_s)
    return math.sqrt(2 * blocking_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - blocking_s


def interval_steps(blocking_s: float, write_s: float, mtbf_s: float, step_s: float) -> int:
    seconds = max(daly_interval_seconds(blocking_s, mtbf_s), write_s)
    return max(1, round(seconds / step_s))
