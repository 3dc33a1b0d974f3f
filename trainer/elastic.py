"""Elastic shrink-and-continue: the job at the node count torchrun actually gave it.

A job with ``faults.min_nodes`` runs on any node count from ``min_nodes`` to ``hardware.nodes``
(torchrun ``--nnodes=MIN:MAX``). Chips per node, tp, cp, pp and ep stay as specified; the data-parallel
degree across nodes flexes with the node count: ``dp_replicate`` when the spec has replicas (HSDP puts
them across nodes), else ``dp_shard``. The global batch stays, so a shrunk run accumulates more
micro-batches and trains the same samples in the same order: the loader's cursor counts samples and
resumes across a change of dp degree, and DCP reshards the checkpoint onto the new layout.

No torch here: the spec checks these layouts before anything is launched. What a resize means for
the checkpoint tiers is :mod:`trainer.checkpoint.resize`.
"""

from __future__ import annotations

from math import gcd
from typing import Literal

from trainer.config import (
    FaultsConfig,
    HardwareConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from trainer.failures import UserError
from trainer.layout_checks import layout_errors

FlexingDegree = Literal["dp_replicate", "dp_shard"]


def flexing_degree(parallel: ParallelConfig) -> FlexingDegree:
    """The degree that follows the node count: replicas when there are any, else FSDP shards."""
    return "dp_replicate" if parallel.dp_replicate > 1 else "dp_shard"


def resized_layout(
    parallel: ParallelConfig, hardware: HardwareConfig, nodes: int
) -> tuple[ParallelConfig, HardwareConfig]:
    """The spec's layout on ``nodes`` nodes (the flexing degree scaled); assumes it divides evenly."""
    degree = flexing_degree(parallel)
    size = getattr(parallel, degree) * nodes // hardware.nodes
    return parallel.model_copy(update={degree: size}), hardware.model_copy(update={"nodes": nodes})


def elastic_errors(
    model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hw: HardwareConfig, faults: FaultsConfig
) -> list[str]:
    """Whether the layout is derivable at every node count from ``faults.min_nodes`` to ``nodes``;
    each message names the field and the fix."""
    low = faults.min_nodes
    if low is None:
        return []
    if low > hw.nodes:
        return [f"faults.min_nodes={low} exceeds cluster.nodes={hw.nodes}; set min_nodes ≤ nodes"]
    errors = []
    if low < hw.nodes and faults.max_restarts < 1:
        errors.append(
            f"faults.min_nodes={low} needs faults.max_restarts ≥ 1: the survivors of a lost node restart "
            "once to continue without it"
        )
    degree = flexing_degree(parallel)
    size = getattr(parallel, degree)
    for nodes in range(low, hw.nodes):
        if size * nodes % hw.nodes:
            step = hw.nodes // gcd(nodes, hw.nodes)
            errors.append(
                f"faults.min_nodes={low}: at {nodes} of {hw.nodes} nodes parallel.{degree}={size} would become "
                f"{size}×{nodes}/{hw.nodes}, not a whole number (only dp_replicate, when > 1, else dp_shard "
                f"flexes with the node count); make parallel.{degree} a multiple of {step} or raise "
                "faults.min_nodes"
            )
            continue
        at = resized_layout(parallel, hw, nodes)
        errors += [
            f"faults.min_nodes={low}: at {nodes} of {hw.nodes} nodes ({degree}={getattr(at[0], degree)}): {e}"
            for e in layout_errors(model, at[0], train, at[1])
        ]
    return errors


def fit_to_world(job: JobConfig, world_size: int) -> JobConfig:
    """``job`` as it runs on ``world_size`` processes: itself at full size, resized when an elastic job
    was started on fewer nodes; a world no node count in range explains is refused."""
    if world_size == job.parallel.world_size or job.faults.min_nodes is None:
        return job  # a non-elastic mismatch is build_mesh's to refuse, with its own message
    chips, spec_nodes = job.hardware.chips_per_node, job.hardware.nodes
    nodes, extra = divmod(world_size, chips)
    if extra or not job.faults.min_nodes <= nodes <= spec_nodes:
        raise UserError(
            f"torchrun started {world_size} processes, but this elastic job runs on faults.min_nodes="
            f"{job.faults.min_nodes} to cluster.nodes={spec_nodes} nodes of {chips} processes; launch with "
            f"--nnodes={job.faults.min_nodes}:{spec_nodes} --nproc-per-node={chips}"
        )
    return resized_job(job, nodes)


def resized_job(job: JobConfig, nodes: int) -> JobConfig:
    """``job`` on ``nodes`` of its nodes (see :func:`resized_layout`)."""
    parallel, hardware = resized_layout(job.parallel, job.hardware, nodes)
    return job.model_copy(update={"parallel": parallel, "hardware": hardware})


def describe_resize(spec: JobConfig, running: JobConfig) -> str:
    """One loud line for the log: what a shrunk run changed to keep the global batch."""
    degree = flexing_degree(spec.parallel)
    return (
        f"running on {running.hardware.nodes} of {spec.hardware.nodes} nodes: {degree} "
        f"{getattr(running.parallel, degree)} (spec {getattr(spec.parallel, degree)}), "
        f"{micro_batches(running)} micro-batches (spec {micro_batches(spec)}), global batch "
        f"{spec.train.global_batch_size} kept"
    )


def micro_batches(job: JobConfig) -> int:
    """Micro-batches accumulated per step on each data-parallel rank."""
    return job.train.global_batch_size // (job.parallel.dp * job.train.micro_batch_size)
