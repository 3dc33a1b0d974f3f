"""Step time from its parts, with an explicit model of what overlaps what.

Per micro-batch, the slowest pipeline stage runs its blocks' forward, backward and recompute
(``compute.py``), the first stage the embedding, the last the output head and loss; TP collectives
and pipeline sends sit on that critical path (no async TP); context parallelism's K/V hops show where
they outlast the ring step of attention they run behind (``context.py``). Across micro-batches:

- FSDP prefetches block i+1's all-gather while block i computes (FSDP2's implicit prefetch), so a
  gather shows only where it outlasts a block's forward; in backward, block i's reduce-scatter (and
  the HSDP all-reduce after it) runs behind block i−1's backward. The first gather and the last
  reduction have nothing to hide behind. The root unit (embedding, head) is gathered once per step.
  On a host nothing hides, and FSDP2's own work around each unit's collectives, measured by
  ``tessera calibrate``, adds per unit and sync (:func:`fsdp_host_seconds`).
- A pipeline adds the bubble: GPipe and 1F1B idle (p−1) stage-slots per step, interleaved 1F1B
  (p−1)/v (Narayanan et al. 2021, §2.2); with unequal stages, Σ stages − slowest, over v. Zero-bubble
  schedules leave a share of that set by the block's forward, input- and weight-gradient times
  (``bubble.py``, Qi et al. 2024).
- The optimizer step follows the last reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from trainer.plan.bubble import bubble_share
from trainer.plan.comms import (
    FP32,
    TP_BACKWARD,
    TP_FORWARD,
    DimPlacement,
    LayerComms,
    collective_seconds,
    fsdp_placement,
    gathers_per_sync,
    gradient_syncs,
    layer_comms,
    link_of,
    muon_gather_seconds,
    tp_backward_collectives,
)
from trainer.plan.compute import (
    BlockSeconds,
    block_attention_seconds,
    block_seconds,
    embedding_seconds,
    fsdp_copy_bytes,
    head_seconds,
    optimizer_seconds,
)
from trainer.plan.context import ring_exposed_seconds
from trainer.plan.kernels import memory_seconds
from trainer.plan.layout import Geometry
from trainer.plan.profile import HardwareProfile


@dataclass(frozen=True)
class Overlap:
    """What the training loop runs concurrently with compute. The defaults are tessera's trainer
    (FSDP2: per-block gradient reductions during backward; TP collectives synchronous); a published
    run from another framework states its own (Megatron-LM 2021 all-reduced gradients after backward)."""

    grads_in_backward: bool = True  # else the whole gradient sync follows the last backward, exposed
    async_tp: bool = False  # TP collectives hidden behind the block's matmuls (torchtitan's async TP)


class StepTime(BaseModel):
    """Where one optimizer step's seconds go, on the slowest chip. The parts sum to ``total_s``."""

    model_config = ConfigDict(frozen=True)

    compute_s: float  # forward + backward (+ recompute) of every micro-batch on the slowest stage
    recompute_s: float  # the part of compute_s activation checkpointing adds
    exposed_comm_s: dict[str, float]  # per mesh dimension: what compute does not hide
    bubble_s: float
    optimizer_s: float
    total_s: float


def stage_seconds(geo: Geometry, hw: HardwareProfile, block: BlockSeconds) -> list[float]:
    """One micro-batch's compute on each pipeline stage (first: + embedding, last: + head and loss)."""
    blocks = geo.layers_per_stage * (block.forward + block.backward + block.recompute)
    embedding, head = embedding_seconds(geo, hw), head_seconds(geo, hw)
    if geo.parallel.pp == 1:
        return [blocks + embedding + head]
    return [blocks + embedding] + [blocks] * (geo.parallel.pp - 2) + [blocks + head]


def fsdp_exposed(
    geo: Geometry, hw: HardwareProfile, block: BlockSeconds, comms: LayerComms, overlap: Overlap
) -> tuple[float, float]:
    """(dp_shard, dp_replicate) seconds per gradient sync that the blocks' compute does not hide.

    Nothing hides on CPU: gloo's collectives are copies on the same cores the compute saturates.
    """
    layers, gather = geo.layers_per_stage, comms.fsdp_gather
    reduce = comms.fsdp_reduce + comms.replicate_reduce
    overlaps = not hw.host_bound
    forward = gather + (layers - 1) * max(0.0, gather - block.forward * overlaps)
    backward_comm = (gather if gathers_per_sync(geo) == 2 else 0.0) + reduce
    hidden = block.backward + block.recompute if overlap.grads_in_backward and overlaps else 0.0
    backward = reduce + (layers - 1) * max(0.0, backward_comm - hidden)
    replicate_share = comms.replicate_reduce / backward_comm if backward_comm else 0.0
    return forward + backward * (1 - replicate_share), backward * replicate_share


def root_exposed(geo: Geometry, placement: dict[str, DimPlacement]) -> tuple[float, float, float]:
    """(gather per step, reduce-scatter per sync, all-reduce per sync) of FSDP's root unit: exposed,
    since the embedding's gather starts the step and the head's reduction ends it."""
    shard, rep = fsdp_placement(placement), placement["dp_replicate"]
    root = geo.root_params_tp
    return (
        collective_seconds("all_gather", root * geo.compute_bytes, shard.degree, link_of(shard)),
        collective_seconds("reduce_scatter", root * FP32, shard.degree, link_of(shard)),
        collective_seconds("all_reduce", root * FP32 / shard.degree, rep.degree, link_of(rep)),
    )


def fsdp_host_seconds(geo: Geometry, hw: HardwareProfile, shard: DimPlacement, params: float) -> float:
    """FSDP2's own work on a host per sync for a unit of ``params`` (one TP rank's), beyond what the
    plan prices elsewhere: allocating and first-touching the gathered and gradient buffers, its hooks
    and per-parameter views, gradient division and accumulation, and the ranks waiting for each other at
    each collective (wall time, on two sequences of a training length).

    ``tessera calibrate`` times FSDP2's round trip of a transformer block (fp32, resharded: two
    all-gathers and a reduce-scatter, with everything around them; per block of a stack of them under a
    root unit, so each gather is prefetched while the previous block computes, as in training) as
    t = λ + 4P·r over its parameter bytes; the part priced already (those collectives' α–β, and the
    copies of ``fsdp_copy_bytes`` at memory bandwidth) is taken off, and the rest scales with the layout's traffic, gathers·e + 4 bytes
    per parameter against the measured 2·4 + 4. Zero where nothing was measured: an accelerator's host
    runs this work ahead of the device queue.
    """
    if geo.replicated:  # DDP holds the parameters: no FSDP at all
        return 0.0
    latency, per_byte = hw.fsdp_round_trip(shard.degree)  # degree 1: FSDP on a one-process mesh
    if not latency and not per_byte:
        return 0.0
    size, link, n = FP32 * params, link_of(shard), shard.degree
    collectives = 2 * collective_seconds("all_gather", size, n, link)
    collectives += collective_seconds("reduce_scatter", size, n, link)
    copies = memory_seconds(fsdp_copy_bytes(geo) * params / geo.layer_params_tp, hw)
    rest = max(0.0, latency + per_byte * size - collectives - copies)
    return rest * (gathers_per_sync(geo) * geo.compute_bytes + FP32) / (3 * FP32)


def fsdp_rounds(geo: Geometry) -> int:
    """FSDP round trips per step: one per micro-batch (each gathers the blocks, also on a one-process
    mesh, where the gradients wait for the last one), or one for a pipeline stage, which stays gathered
    across its micro-batches."""
    return geo.microbatches if geo.parallel.pp == 1 else 1


def tp_host_seconds(geo: Geometry, hw: HardwareProfile, tp: DimPlacement, comms: LayerComms) -> float:
    """A TP block's cost on a host per micro-batch beyond its collectives' α–β: DTensor's dispatch and
    redistributes around every op, and the ranks waiting for each other at each of its synchronous
    collectives (on shared cores their segments end apart).

    ``tessera calibrate`` times the probe block under TP less its unsplit twin (the same local matmuls)
    as t = λ + A·r over the fp32 bytes A of the activation one collective assembles; here A is the
    layout's micro-batch (T·d·4), with the collectives priced in ``comms`` taken off, and a recomputing
    layout's extra forward at the forward's share of it. Zero where nothing was measured.
    """
    latency, per_byte = hw.tp_round_trip(tp.degree)
    if not latency and not per_byte:
        return 0.0
    measured = latency + per_byte * geo.microbatch_tokens * geo.model.dim * FP32
    collectives = TP_FORWARD + tp_backward_collectives(geo)
    measured *= collectives / (TP_FORWARD + TP_BACKWARD)  # recompute repeats the forward's collectives
    return max(0.0, measured - comms.tp_forward - comms.tp_backward)


def tp_exposed(
    geo: Geometry,
    hw: HardwareProfile,
    block: BlockSeconds,
    comms: LayerComms,
    tp: DimPlacement,
    overlap: Overlap,
) -> float:
    """One micro-batch's TP collectives on the critical path: all of them, or with async TP only what
    outlasts the blocks' compute (the collectives are decomposed and pipelined with the matmuls); on a
    host, plus what TP costs there beyond them (:func:`tp_host_seconds`)."""
    collectives = comms.tp_forward + comms.tp_backward
    if overlap.async_tp:
        collectives = max(0.0, collectives - block.forward - block.backward - block.recompute)
    return geo.layers_per_stage * (collectives + tp_host_seconds(geo, hw, tp, comms))


def step_time(
    geo: Geometry, hw: HardwareProfile, placement: list[DimPlacement], overlap: Overlap | None = None
) -> StepTime:
    """The step's parts on the slowest chip, by the overlap rules of the module docstring."""
    overlap = overlap or Overlap()
    by_dim = {p.dim: p for p in placement}
    block, comms = block_seconds(geo, hw), layer_comms(geo, by_dim)
    m, v = geo.microbatches, geo.parallel.pp_virtual_stages
    syncs = gradient_syncs(geo) if overlap.grads_in_backward else 1  # else one sync after the last backward
    stages = stage_seconds(geo, hw, block)
    tp = tp_exposed(geo, hw, block, comms, by_dim["tp"], overlap)
    ring = ring_exposed_seconds(geo, by_dim["cp"], block_attention_seconds(geo, hw), not hw.host_bound)
    pp = 2 * v * comms.pp_send if geo.parallel.pp > 1 else 0.0
    slowest = max(stages)
    share = bubble_share(
        geo.parallel.pp_schedule,
        block.forward,
        block.backward - block.weight_grad + block.recompute,
        block.weight_grad,
    )
    bubble = share * (sum(stages) - slowest + (len(stages) - 1) * (tp + pp)) / v
    shard, replicate = fsdp_exposed(geo, hw, block, comms, overlap)
    root_gather, root_reduce, root_all_reduce = root_exposed(geo, by_dim)
    fsdp_placed = fsdp_placement(by_dim)
    fsdp_host = geo.layers_per_stage * fsdp_host_seconds(geo, hw, fsdp_placed, geo.layer_params_tp)
    fsdp_host += fsdp_host_seconds(geo, hw, fsdp_placed, geo.root_params_tp)
    exposed = {
        "tp": m * tp,
        "cp": m * geo.layers_per_stage * ring,
        "dp_shard": syncs * (shard + root_reduce)
        + fsdp_rounds(geo) * fsdp_host
        + root_gather
        + muon_gather_seconds(geo, fsdp_placed),
        "dp_replicate": syncs * (replicate + root_all_reduce),
        "pp": m * pp,
        "ep": by_dim["ep"].time_s if "ep" in by_dim else 0.0,  # see experts.py: nothing hides it
    }
    optimizer = optimizer_seconds(geo, hw)
    return StepTime(
        compute_s=m * slowest,
        recompute_s=m * geo.layers_per_stage * block.recompute,
        exposed_comm_s=exposed,
        bubble_s=bubble,
        optimizer_s=optimizer,
        total_s=m * slowest + sum(exposed.values()) + bubble + optimizer,
    )
