"""Communication per step: mesh placement on the interconnect and an alpha–beta cost per collective.

Placement: the trainer builds its ``DeviceMesh`` as (pp, dp_replicate, dp_shard, tp), outer to inner
(torchtitan's order), and ranks are laid out node by node, so the innermost dimensions land in the
fast domain — NVLink/NVSwitch inside a GPU node, ICI inside a TPU slice, NeuronLink inside a Trainium
instance — and outer ones cross it (IB/EFA, DCN). The order is chosen by chattiness: TP talks every
layer on the critical path, FSDP every layer but overlapped, DP once per step, PP only point-to-point.

Costs (nccl-tests performance notes; B = one-direction bandwidth per chip, S = full buffer bytes,
n ranks, α per ring step): all-gather / reduce-scatter send S·(n−1)/n in S/B·(n−1)/n + (n−1)α;
all-reduce twice that. A dimension whose ring leaves the fast domain runs at the cross-domain
bandwidth (the slowest link of a ring sets its speed). On a torus (TPU ICI, NeuronLink) a mesh
dimension maps onto one torus axis, so its ring gets 1/axes of the chip's link bandwidth — a
conservative figure for dimensions that span several axes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from trainer.backends.chips import Chip
from trainer.config import HardwareConfig
from trainer.plan.layout import Geometry

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")  # outer → inner
FP32 = 4
# Torus dimensions of the scale-up fabric (cloud.google.com/tpu/docs; AWS Neuron trainium2 arch: 4×4).
TORUS_AXES = {"tpu-v5e": 2, "tpu-v6e": 2, "tpu-v5p": 3, "trainium1": 2, "trainium2": 2}


class DimPlacement(BaseModel):
    """Where one mesh dimension's collectives run, and what they cost per step on one chip."""

    model_config = ConfigDict(frozen=True)

    dim: str
    degree: int
    domain: Literal["intra", "inter", "local"]  # local: degree 1, no communication
    link: str
    bandwidth: float  # bytes/s, one direction per chip
    bytes_per_step: float = 0.0
    time_s: float = 0.0


def fast_domain_chips(chip: Chip, hardware: HardwareConfig) -> int:
    """Chips reachable over the scale-up link: the node, or a multi-host slice (TPU ICI)."""
    multi_host = chip.domain_chips > chip.chips_per_node
    return chip.domain_chips if multi_host else min(chip.domain_chips, hardware.chips_per_node)


def place(geo: Geometry, chip: Chip, hardware: HardwareConfig) -> list[DimPlacement]:
    """Each mesh dimension's domain and link, innermost (tp) first."""
    fast, stride, placed = fast_domain_chips(chip, hardware), 1, []
    fast_link, _, slow_link = chip.interconnect.partition(" + ")  # the catalog writes "scale-up + scale-out"
    slow_link = slow_link or fast_link
    for dim in reversed(MESH_ORDER):
        degree = getattr(geo.parallel, dim)
        stride *= degree
        if degree == 1:
            where = DimPlacement(dim=dim, degree=1, domain="local", link="-", bandwidth=0.0)
        elif stride <= fast:
            axis_bandwidth = chip.intra_bandwidth / TORUS_AXES.get(chip.name, 1)
            where = DimPlacement(
                dim=dim, degree=degree, domain="intra", link=fast_link, bandwidth=axis_bandwidth
            )
        else:
            where = DimPlacement(
                dim=dim, degree=degree, domain="inter", link=slow_link, bandwidth=chip.inter_bandwidth
            )
        placed.append(where)
    return placed


def _ring(size: float, n: int, count: float, bandwidth: float, latency: float) -> tuple[float, float]:
    """(bytes sent per chip, seconds) of `count` all-gathers or reduce-scatters of `size` bytes over n ranks."""
    sent = count * size * (n - 1) / n
    return sent, sent / bandwidth + count * (n - 1) * latency


def tp_collectives_per_layer(geo: Geometry) -> int:
    """All-gathers + reduce-scatters one block issues per micro-batch with sequence parallelism.

    Forward: gather before attention and MLP, reduce-scatter after each (4); backward mirrors it
    (4). Recomputation repeats the forward's 4: under full, and under selective too, because its
    policy saves only matmul/SDPA outputs, so the collectives feeding the recomputed norms run again.
    """
    return 8 if geo.parallel.activation_checkpointing == "none" else 12


def dim_traffic(
    geo: Geometry, dim: str, degree: int, bandwidth: float, latency: float
) -> tuple[float, float]:
    """(bytes sent per chip per step, seconds) for one mesh dimension."""
    if degree == 1:
        return 0.0, 0.0
    par, e, m = geo.parallel, geo.compute_bytes, geo.microbatches
    activation = geo.microbatch_tokens * geo.model.dim * e  # one micro-batch's hidden states, gathered
    stage_tp_params = geo.stage_params / par.tp
    if dim == "tp":
        count = tp_collectives_per_layer(geo) * geo.layers_per_stage * m
        return _ring(activation, degree, count, bandwidth, latency)
    if dim == "dp_shard":  # gather in fwd (and again in bwd after a reshard), reduce-scatter fp32 grads
        gathers = 2 if geo.reshard_after_forward else 1
        gathered = _ring(stage_tp_params * e, degree, gathers * m, bandwidth, latency)
        reduced = _ring(stage_tp_params * FP32, degree, m, bandwidth, latency)
        return gathered[0] + reduced[0], gathered[1] + reduced[1]
    if dim == "dp_replicate":  # HSDP: all-reduce (= reduce-scatter + all-gather) of the fp32 grad shards
        return _ring(stage_tp_params / par.dp_shard * FP32, degree, 2, bandwidth, latency)
    # pp: a middle stage sends one activation forward and one gradient back per micro-batch and chunk
    sends = 2 * m * par.pp_virtual_stages
    sent = sends * activation / par.tp
    return sent, sent / bandwidth + sends * latency


def estimate_comms(geo: Geometry, chip: Chip, hardware: HardwareConfig) -> list[DimPlacement]:
    placed = []
    for p in place(geo, chip, hardware):
        latency = chip.intra_latency_s if p.domain == "intra" else chip.inter_latency_s
        sent, time = dim_traffic(geo, p.dim, p.degree, p.bandwidth, latency)
        placed.append(p.model_copy(update={"bytes_per_step": sent, "time_s": time}))
    return placed
