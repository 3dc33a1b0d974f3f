"""Checkpoint size, write time, and the Young/Daly interval that minimises expected lost work.

Young (1974): τ = sqrt(2·C·M); Daly (2006) higher order: τ = sqrt(2CM)·[1 + ⅓·sqrt(C/2M) + ⅑·(C/2M)] − C
for C < 2M, else τ = M. C is the time training is *blocked* per checkpoint: the whole write for sync
saves, only the device→host staging copy for async DCP (PyTorch's async-checkpointing blog: a 7B
model's downtime 148.8 s sync → 6.3 s async). M is the job's MTBF: ``hardware.mtbf_hours``, or
1 / (failures per chip-hour × chips) with the Llama 3 rate (``trainer.backends.chips``; 16,384
H100s → one interruption every ~3.1 h, matching Dubey et al. 2024). An async save must finish before
the next one starts, so the interval is never shorter than the full write.

Two tiers, each priced against the failures it must cover. The in-memory tier (every rank's shard
copied to host memory and sent to a peer node) recovers every interruption that leaves a host or its
peer alive, so its interval uses the job's MTBF and its own cost: the device→host copy. Storage is
then only needed for the rest (``STORAGE_ONLY_FAILURE_FRACTION``), so its MTBF is that much longer.
"""

from __future__ import annotations

import math

from trainer.backends.chips import Chip
from trainer.config import MAX_COUNT, CheckpointConfig, HardwareConfig
from trainer.plan.layout import Geometry

CHECKPOINT_BYTES_PER_PARAM = 4 + 8  # fp32 weights + AdamW m, v (gradients are not saved)
# Device→host staging copy for async saves (assumed: PCIe Gen4 x16 effective ~25 GB/s per chip).
HOST_STAGING_BANDWIDTH = 25e9
# Interruptions that take both in-memory copies of some rank with them: a node and its ring peer lost
# together, or the whole job moved to other hosts. Most interruptions (Llama 3: one GPU, one host, a
# link) leave every other host's memory intact. Assumed 5%: storage is priced against these alone.
STORAGE_ONLY_FAILURE_FRACTION = 0.05


def checkpoint_bytes(geo: Geometry) -> float:
    """DCP writes each shard once: replicas (dp_replicate) dedupe, so the size is the model's, not ×dp."""
    return CHECKPOINT_BYTES_PER_PARAM * geo.counts.total


def storage_bytes(geo: Geometry, checkpoint: CheckpointConfig) -> float:
    """Room the checkpoint location needs at its fullest: ``keep_last + 1`` checkpoints.

    Retention deletes old checkpoints only after a new one commits, so the newest ``keep_last`` and
    the one being written coexist (``keep_every`` and pinned checkpoints come on top).
    """
    return (checkpoint.keep_last + 1) * checkpoint_bytes(geo)


def write_seconds(
    geo: Geometry, hardware: HardwareConfig, checkpoint: CheckpointConfig, measured_bandwidth: float | None
) -> float:
    """Every node writes its shards in parallel, at the bandwidth calibration measured for the
    checkpoint directory's disk where a profile has one, else the spec's ``write_bandwidth_gbps``."""
    bandwidth = measured_bandwidth or checkpoint.write_bandwidth_gbps * 1e9
    return checkpoint_bytes(geo) / (hardware.nodes * bandwidth)


def blocking_seconds(
    geo: Geometry, hardware: HardwareConfig, checkpoint: CheckpointConfig, measured_bandwidth: float | None
) -> float:
    """C in Young/Daly: what training waits for per checkpoint."""
    if checkpoint.mode == "sync":
        return write_seconds(geo, hardware, checkpoint, measured_bandwidth)
    per_chip = checkpoint_bytes(geo) / hardware.world_size
    return per_chip / HOST_STAGING_BANDWIDTH


def mtbf_seconds(chip: Chip, hardware: HardwareConfig) -> float:
    hours = hardware.mtbf_hours or 1 / (chip.failures_per_chip_hour * hardware.world_size)
    return hours * 3600


def storage_mtbf_seconds(chip: Chip, hardware: HardwareConfig, checkpoint: CheckpointConfig) -> float:
    """Mean time between the failures storage must recover: all of them, or with the in-memory tier
    on, only those that lose both copies of some rank's memory."""
    mtbf_s = mtbf_seconds(chip, hardware)
    return mtbf_s if checkpoint.memory_interval == "off" else mtbf_s / STORAGE_ONLY_FAILURE_FRACTION


def snapshot_bytes_per_chip(geo: Geometry, hardware: HardwareConfig) -> float:
    """One chip's shard of the state, what it keeps in host memory (each data-parallel replica has one)."""
    return checkpoint_bytes(geo) * geo.parallel.dp_replicate / hardware.world_size


def memory_blocking_seconds(geo: Geometry, hardware: HardwareConfig) -> float:
    """C of the in-memory tier: the device→host copy of the chip's shard (the peer send is overlapped)."""
    return snapshot_bytes_per_chip(geo, hardware) / HOST_STAGING_BANDWIDTH


def peer_send_seconds(geo: Geometry, hardware: HardwareConfig, chip: Chip) -> float:
    """Sending the shard to the peer node over the chip's share of the inter-node links; one send is in
    flight at a time, so this bounds the in-memory interval from below as the write bounds storage's."""
    return snapshot_bytes_per_chip(geo, hardware) / chip.inter_bandwidth


def daly_interval_seconds(blocking_s: float, mtbf_s: float) -> float:
    """Daly's optimum compute time between checkpoints (reduces to Young's sqrt(2CM) for C ≪ M)."""
    if blocking_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = blocking_s / (2 * mtbf_s)
    return math.sqrt(2 * blocking_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - blocking_s


def interval_steps(blocking_s: float, write_s: float, mtbf_s: float, step_s: float) -> int:
    """Steps between checkpoints, at most ``MAX_COUNT`` (what a job's interval field holds): a
    years-long MTBF or a very slow store gives "never" in effect, not an interval no job accepts."""
    steps = max(daly_interval_seconds(blocking_s, mtbf_s), write_s) / step_s
    return MAX_COUNT if steps >= MAX_COUNT else max(1, round(steps))
