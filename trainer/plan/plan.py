"""The plan: one layout's memory, FLOPs, communication, step time and checkpoint cadence."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from trainer.backends.chips import get_chip
from trainer.config import (
    CheckpointConfig,
    HardwareConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from trainer.plan import checkpointing
from trainer.plan.comms import DimPlacement, estimate_comms
from trainer.plan.flops import model_flops_per_token, recompute_flops_per_token, tokens_per_step
from trainer.plan.layout import Geometry
from trainer.plan.memory import MemoryBreakdown, estimate_memory

# Fraction of peak the matmuls reach when not waiting for communication (assumed; large dense
# transformer training reaches 40-55% MFU end to end, e.g. Llama 3 405B at 38-43% on H100).
ASSUMED_MFU = 0.5
# HBM the planner lets a layout use: the rest is runtime context, communicator buffers and allocator
# fragmentation (assumed 10%).
USABLE_HBM_FRACTION = 0.9
# fp32 matmuls run at about half the bf16 rate (TF32 tensor cores on NVIDIA; assumed elsewhere).
FP32_SLOWDOWN = 2.0


class Plan(BaseModel):
    """Everything the planner estimates for one layout; ``to_json`` is ``tessera plan --json``."""

    model_config = ConfigDict(frozen=True)

    chip: str
    chips: int
    parallel: ParallelConfig
    micro_batch_size: int
    microbatches: int
    params: int
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
    assumed_mfu: float
    mfu: float
    tokens_per_second: float
    checkpoint_bytes: float
    checkpoint_write_s: float
    checkpoint_blocking_s: float
    mtbf_hours: float
    checkpoint_interval_steps: int
    placement: list[DimPlacement]

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @property
    def layout(self) -> str:
        """Every searched knob, spec-style, so a suggestion can be applied as is.

        E.g. 'dp_replicate=1 dp_shard=8 tp=1 pp=1 micro_batch_size=1 activation_checkpointing=full'.
        """
        p = self.parallel
        return (
            f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp} pp={p.pp} "
            f"micro_batch_size={self.micro_batch_size} activation_checkpointing={p.activation_checkpointing}"
        )


def bubble_fraction(geo: Geometry) -> float:
    """Idle fraction of a pipeline step: (p−1)/m, or (p−1)/(v·m) interleaved (Narayanan et al. 2021)."""
    p, m = geo.parallel.pp, geo.microbatches
    return (p - 1) / (geo.parallel.pp_virtual_stages * m)


def make_plan(
    model: ModelConfig,
    parallel: ParallelConfig,
    train: TrainConfig,
    hardware: HardwareConfig,
    checkpoint: CheckpointConfig,
    assumed_mfu: float = ASSUMED_MFU,
) -> Plan:
    """Estimate one layout. Inputs must already satisfy ``trainer.config.layout_errors``.

    Step time = compute · (1 + bubble) + exposed communication. Compute runs the hardware FLOPs at
    ``assumed_mfu`` of peak. TP and PP transfers sit on the critical path (no async TP); FSDP's
    prefetched all-gathers/reduce-scatters and HSDP's all-reduce overlap compute and show only where
    they outlast it. Estimated MFU = model FLOPs / (step time × chips × peak bf16).
    """
    chip = get_chip(hardware.chip)
    geo = Geometry(model, parallel, train, hardware.accelerator)
    chips = hardware.world_size
    memory = estimate_memory(geo)
    usable = USABLE_HBM_FRACTION * chip.hbm_bytes

    tokens = tokens_per_step(geo)
    flops_per_token = model_flops_per_token(geo)
    hardware_flops = (flops_per_token + recompute_flops_per_token(geo)) * tokens
    slowdown = FP32_SLOWDOWN if parallel.mixed_precision == "fp32" else 1.0
    compute = hardware_flops / chips / (chip.peak_bf16_flops * assumed_mfu) * slowdown
    bubble = bubble_fraction(geo)

    placement = estimate_comms(geo, chip, hardware)
    times = {p.dim: p.time_s for p in placement}
    overlapped = times["dp_shard"] + times["dp_replicate"]
    exposed = times["tp"] + times["pp"] + max(0.0, overlapped - compute)
    step = compute * (1 + bubble) + exposed
    mfu = flops_per_token * tokens / (step * chips * chip.peak_bf16_flops)

    write_s = checkpointing.write_seconds(geo, hardware, checkpoint)
    blocking_s = checkpointing.blocking_seconds(geo, hardware, checkpoint)
    mtbf_s = checkpointing.mtbf_seconds(chip, hardware)
    return Plan(
        chip=chip.name,
        chips=chips,
        parallel=parallel,
        micro_batch_size=train.micro_batch_size,
        microbatches=geo.microbatches,
        params=geo.counts.total,
        memory_per_chip_bytes=memory,
        hbm_bytes=chip.hbm_bytes,
        usable_hbm_bytes=usable,
        fits=memory.total <= usable,
        tokens_per_step=tokens,
        flops_per_token=flops_per_token,
        flops_per_step=flops_per_token * tokens,
        hardware_flops_per_step=hardware_flops,
        compute_time_s=compute,
        bubble_fraction=bubble,
        comm_bytes_per_step=sum(p.bytes_per_step for p in placement),
        comm_time_s=sum(times.values()),
        exposed_comm_time_s=exposed,
        step_time_s=step,
        assumed_mfu=assumed_mfu,
        mfu=mfu,
        tokens_per_second=tokens / step,
        checkpoint_bytes=checkpointing.checkpoint_bytes(geo),
        checkpoint_write_s=write_s,
        checkpoint_blocking_s=blocking_s,
        mtbf_hours=mtbf_s / 3600,
        checkpoint_interval_steps=checkpointing.interval_steps(blocking_s, write_s, mtbf_s, step),
        placement=placement,
    )


def plan_for_job(job: JobConfig) -> Plan:
    return make_plan(job.model, job.parallel, job.train, job.hardware, job.checkpoint)


def resolve_checkpoint_interval(job: JobConfig) -> int:
    """Steps between checkpoints: the fixed interval, or the planner's Young/Daly optimum for 'auto'."""
    if job.checkpoint.interval != "auto":
        return job.checkpoint.interval
    return plan_for_job(job).checkpoint_interval_steps
