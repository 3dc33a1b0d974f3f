"""The plan: one layout's memory, FLOPs, communication, step time and checkpoint cadence."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from trainer.backends.chips import get_chip
from trainer.config import (
    CheckpointConfig,
    HardwareConfig,
    JobConfig,
    ModelConfig,
    OptimizerName,
    ParallelConfig,
    TrainConfig,
)
from trainer.plan import checkpointing
from trainer.plan.bubble import bubble_fraction as pipeline_bubble_fraction
from trainer.plan.comms import DimPlacement, place, traffic
from trainer.plan.experts import ep_placements
from trainer.plan.flops import model_flops_per_token, recompute_flops_per_token, tokens_per_step
from trainer.plan.hbm import MemoryBreakdown, estimate_memory
from trainer.plan.layout import Geometry
from trainer.plan.profile import HardwareProfile, catalog_profile
from trainer.plan.timing import Overlap, StepTime, step_time

# HBM the planner lets a layout use: the rest is runtime context, communicator buffers and allocator
# fragmentation (assumed 10%).
USABLE_HBM_FRACTION = 0.9


class Plan(BaseModel):
    """Everything the planner estimates for one layout; ``tessera plan --json`` prints it."""

    model_config = ConfigDict(frozen=True)

    chip: str
    chips: int
    parallel: ParallelConfig
    micro_batch_size: int
    microbatches: int
    params: int
    active_params: int  # what one token uses: params less the routed experts it skips (MoE)
    memory_per_chip_bytes: MemoryBreakdown
    hbm_bytes: float
    usable_hbm_bytes: float
    fits: bool
    tokens_per_step: int
    flops_per_token: float
    flops_per_step: float
    hardware_flops_per_step: float
    compute_time_s: float
    bubble_fraction: float
    comm_bytes_per_step: float
    comm_time_s: float
    exposed_comm_time_s: float
    step_time_s: float
    time_breakdown: StepTime
    sources: dict[str, str]  # each hardware figure the time model used: catalog default or calibrated
    mfu: float
    tokens_per_second: float
    checkpoint_bytes: float
    checkpoint_storage_bytes: float  # what the checkpoint location must hold at its fullest
    checkpoint_write_s: float
    checkpoint_blocking_s: float
    mtbf_hours: float
    checkpoint_interval_steps: int
    storage_mtbf_hours: float  # failures storage alone recovers (longer than mtbf_hours with the memory tier)
    memory_blocking_s: float
    peer_send_s: float
    memory_interval_steps: int  # the in-memory tier's Young/Daly optimum, used when memory_interval is 'auto'
    placement: list[DimPlacement]

    @property
    def layout(self) -> str:
        """Every searched knob, spec-style, so a suggestion can be applied as is.

        E.g. 'dp_replicate=1 dp_shard=8 cp=1 tp=1 pp=1 micro_batch_size=1 activation_checkpointing=full'.
        """
        p = self.parallel
        return (
            f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp} pp={p.pp} "
            f"micro_batch_size={self.micro_batch_size} activation_checkpointing={p.activation_checkpointing}"
        )


def bubble_fraction(geo: Geometry) -> float:
    """Idle fraction of a pipeline step at equal forward/backward passes, per schedule (``bubble.py``):
    (p−1)/m for 1F1B, (p−1)/(v·m) interleaved (Narayanan et al. 2021), a third of that for ZB1P, 0 for
    ZB-V and DualPipeV (Qi et al. 2024). The step time uses the modelled passes instead."""
    par = geo.parallel
    return pipeline_bubble_fraction(par.pp_schedule, par.pp, geo.microbatches, par.pp_virtual_stages)


def memory_fields(geo: Geometry, hw: HardwareProfile) -> dict[str, Any]:
    memory = estimate_memory(geo)
    usable = USABLE_HBM_FRACTION * hw.chip.hbm_bytes
    return dict(
        memory_per_chip_bytes=memory,
        hbm_bytes=hw.chip.hbm_bytes,
        usable_hbm_bytes=usable,
        fits=memory.total <= usable,
    )


def time_fields(
    geo: Geometry, hw: HardwareProfile, hardware: HardwareConfig, overlap: Overlap | None
) -> dict[str, Any]:
    """Step time from its parts (``timing.py``); MFU = model FLOPs / (step · chips · peak bf16)."""
    placement = traffic(geo, place(geo, hw, hardware)) + ep_placements(geo, hw, hardware)
    time = step_time(geo, hw, placement, overlap)
    tokens, flops_per_token = tokens_per_step(geo), model_flops_per_token(geo)
    return dict(
        tokens_per_step=tokens,
        flops_per_token=flops_per_token,
        flops_per_step=flops_per_token * tokens,
        hardware_flops_per_step=(flops_per_token + recompute_flops_per_token(geo)) * tokens,
        compute_time_s=time.compute_s,
        bubble_fraction=bubble_fraction(geo),
        comm_bytes_per_step=sum(p.bytes_per_step for p in placement),
        comm_time_s=sum(p.time_s for p in placement),
        exposed_comm_time_s=sum(time.exposed_comm_s.values()),
        step_time_s=time.total_s,
        time_breakdown=time,
        sources=hw.sources,
        mfu=flops_per_token * tokens / (time.total_s * hardware.world_size * hw.chip.peak_bf16_flops),
        tokens_per_second=tokens / time.total_s,
        placement=placement,
    )


def checkpoint_fields(
    geo: Geometry, hw: HardwareProfile, hardware: HardwareConfig, checkpoint: CheckpointConfig, step_s: float
) -> dict[str, Any]:
    """Both tiers' costs and intervals, each from Young/Daly over the failures it covers."""
    write_s = checkpointing.write_seconds(geo, hardware, checkpoint, hw.checkpoint_write_bandwidth)
    blocking_s = checkpointing.blocking_seconds(geo, hardware, checkpoint, hw.checkpoint_write_bandwidth)
    mtbf_s = checkpointing.mtbf_seconds(hw.chip, hardware)
    storage_mtbf_s = checkpointing.storage_mtbf_seconds(hw.chip, hardware, checkpoint)
    memory_s = checkpointing.memory_blocking_seconds(geo, hardware)
    send_s = checkpointing.peer_send_seconds(geo, hardware, hw.chip)
    return dict(
        checkpoint_bytes=checkpointing.checkpoint_bytes(geo),
        checkpoint_storage_bytes=checkpointing.storage_bytes(geo, checkpoint),
        checkpoint_write_s=write_s,
        checkpoint_blocking_s=blocking_s,
        mtbf_hours=mtbf_s / 3600,
        checkpoint_interval_steps=checkpointing.interval_steps(blocking_s, write_s, storage_mtbf_s, step_s),
        storage_mtbf_hours=storage_mtbf_s / 3600,
        memory_blocking_s=memory_s,
        peer_send_s=send_s,
        memory_interval_steps=checkpointing.interval_steps(memory_s, send_s, mtbf_s, step_s),
    )


def make_plan(
    model: ModelConfig,
    parallel: ParallelConfig,
    train: TrainConfig,
    hardware: HardwareConfig,
    checkpoint: CheckpointConfig,
    profile: HardwareProfile | None = None,
    overlap: Overlap | None = None,
    optimizer: OptimizerName = "adamw",
) -> Plan:
    """Estimate one layout. Inputs must already satisfy ``trainer.layout_checks.layout_errors``.

    ``profile`` holds the hardware figures (``tessera calibrate``'s, via ``profile.load_profile``);
    default: the chip catalog's. ``overlap`` says what the training loop overlaps; default: tessera's.
    ``optimizer`` prices Muon's momentum, Newton-Schulz matmuls and gathers (``optimizer.name``).
    """
    hw = (profile or catalog_profile(get_chip(hardware.chip))).on_node(hardware.chips_per_node)
    geo = Geometry(model, parallel, train, hardware.accelerator, optimizer)
    times = time_fields(geo, hw, hardware, overlap)
    return Plan(
        chip=hw.chip.name,
        chips=hardware.world_size,
        parallel=parallel,
        micro_batch_size=train.micro_batch_size,
        microbatches=geo.microbatches,
        params=geo.counts.total,
        active_params=geo.counts.active,
        **memory_fields(geo, hw),
        **times,
        **checkpoint_fields(geo, hw, hardware, checkpoint, times["step_time_s"]),
    )


def plan_for_job(job: JobConfig) -> Plan:
    return make_plan(
        job.model, job.parallel, job.train, job.hardware, job.checkpoint, optimizer=job.optimizer.name
    )


def resolve_checkpoint_interval(job: JobConfig, plan: Plan | None = None) -> int:
    """Steps between checkpoints: the fixed interval, or the planner's Young/Daly optimum for 'auto'
    (from ``plan``, the job's plan, when the caller has built it)."""
    if job.checkpoint.interval != "auto":
        return job.checkpoint.interval
    return (plan or plan_for_job(job)).checkpoint_interval_steps


def resolve_memory_interval(job: JobConfig, plan: Plan | None = None) -> int | None:
    """Steps between in-memory snapshots: None when the tier is off, else fixed or the planner's optimum
    (from ``plan``, the job's plan, when the caller has built it)."""
    memory = job.checkpoint.memory_interval
    if memory == "off":
        return None
    return (plan or plan_for_job(job)).memory_interval_steps if memory == "auto" else memory
