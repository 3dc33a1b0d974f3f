"""Communication: mesh placement on the interconnect, and an α–β cost for every collective per layer.

Placement: the trainer builds its ``DeviceMesh`` as (pp, dp_replicate, dp_shard, cp, tp), outer to inner
(torchtitan's order), and ranks are laid out node by node, so the innermost dimensions land in the
fast domain — NVLink/NVSwitch inside a GPU node, ICI inside a TPU slice, NeuronLink inside a Trainium
instance — and outer ones cross it (IB/EFA, DCN). The order is chosen by chattiness: TP talks every
layer on the critical path, FSDP every layer but overlapped, DP once per layer per sync, PP only
point-to-point. On a torus (TPU ICI, NeuronLink) a mesh dimension maps onto one torus axis, so its
ring gets 1/axes of the chip's link bandwidth — conservative for dimensions that span several axes.

Costs (nccl-tests performance notes; B = one-direction bandwidth per chip, S = full buffer bytes,
n ranks): all-gather and reduce-scatter move S·(n−1)/n per chip, all-reduce twice that (a ring); the
latency term is α per step, (n−1) steps for a ring, or 2⌈log₂ n⌉ for NCCL's tree all-reduce, which it
picks for small messages at scale — we charge the smaller. A dimension whose ring leaves the fast
domain runs at the cross-domain bandwidth (the slowest link of a ring sets its speed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from trainer.backends.chips import Chip
from trainer.config import HardwareConfig
from trainer.plan.context import ring_bytes, ring_seconds
from trainer.plan.layout import Geometry
from trainer.plan.profile import HardwareProfile, Link

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outer → inner
FP32 = 4
# Torus dimensions of the scale-up fabric (cloud.google.com/tpu/docs; AWS Neuron trainium2 arch: 4×4).
TORUS_AXES = {"tpu-v4": 3, "tpu-v5e": 2, "tpu-v6e": 2, "tpu-v5p": 3, "trainium1": 2, "trainium2": 2}
# TP collectives per block per micro-batch with sequence parallelism: forward all-gathers before
# attention and MLP and reduce-scatters after each (4); backward mirrors them (4); recomputation
# repeats the forward's 4 — under selective too, because its policy saves only matmul/SDPA outputs,
# so the collectives feeding the recomputed norms run again.
TP_FORWARD, TP_BACKWARD = 4, 4

Collective = Literal["all_gather", "reduce_scatter", "all_reduce"]


class DimPlacement(BaseModel):
    """Where one mesh dimension's collectives run, and what they cost per step on one chip."""

    model_config = ConfigDict(frozen=True)

    dim: str
    degree: int
    domain: Literal["intra", "inter", "local"]  # local: degree 1, no communication
    link: str
    bandwidth: float  # bytes/s, one direction per chip
    latency_s: float = 0.0
    reduce_scatter_factor: float = 1.0  # see profile.Link
    all_reduce_factor: float = 1.0
    bytes_per_step: float = 0.0
    time_s: float = 0.0  # every collective of the dimension, before any overlap


def fast_domain_chips(chip: Chip, hardware: HardwareConfig) -> int:
    """Chips reachable over the scale-up link: the node, or a multi-host slice (TPU ICI)."""
    multi_host = chip.domain_chips > chip.chips_per_node
    return chip.domain_chips if multi_host else min(chip.domain_chips, hardware.chips_per_node)


def place(geo: Geometry, hw: HardwareProfile, hardware: HardwareConfig) -> list[DimPlacement]:
    """Each mesh dimension's domain and link, innermost (tp) first."""
    fast, stride, placed = fast_domain_chips(hw.chip, hardware), 1, []
    fast_link, _, slow_link = hw.chip.interconnect.partition(" + ")  # "scale-up + scale-out"
    slow_link = slow_link or fast_link
    for dim in reversed(MESH_ORDER):
        degree = getattr(geo.parallel, dim)
        stride *= degree
        if degree == 1:
            placed.append(DimPlacement(dim=dim, degree=1, domain="local", link="-", bandwidth=0.0))
            continue
        domain: Literal["intra", "inter"] = "intra" if stride <= fast else "inter"
        link = hw.link(domain, degree)
        axes = TORUS_AXES.get(hw.chip.name, 1) if domain == "intra" else 1
        placed.append(
            DimPlacement(
                dim=dim,
                degree=degree,
                domain=domain,
                link=fast_link if domain == "intra" else slow_link,
                bandwidth=link.bandwidth / axes,
                latency_s=link.latency_s,
                reduce_scatter_factor=link.reduce_scatter_factor,
                all_reduce_factor=link.all_reduce_factor,
            )
        )
    return placed


def collective_seconds(kind: Collective, size: float, n: int, link: Link) -> float:
    """α–β time of one collective over n ranks of an S-byte buffer (see the module docstring)."""
    if n == 1:
        return 0.0
    moved = sent_bytes(kind, size, n)
    factor = {
        "all_gather": 1.0,
        "reduce_scatter": link.reduce_scatter_factor,
        "all_reduce": link.all_reduce_factor,
    }
    steps = n - 1
    if kind == "all_reduce":
        steps = min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    return factor[kind] * moved / link.bandwidth + steps * link.latency_s


def sent_bytes(kind: Collective, size: float, n: int) -> float:
    return size * (n - 1) / n * (2 if kind == "all_reduce" else 1)


@dataclass(frozen=True)
class LayerComms:
    """Seconds of one block's collectives for one micro-batch (TP, PP) or one gradient sync (FSDP, HSDP)."""

    tp_forward: float
    tp_backward: float  # backward's, plus the recomputed forward's under checkpointing
    fsdp_gather: float  # one all-gather of the block's e-byte parameters
    fsdp_reduce: float  # reduce-scatter of its fp32 gradients
    replicate_reduce: float  # HSDP all-reduce of the gradient shard across replicas
    pp_send: float  # one stage-boundary activation (or gradient) send


def link_of(p: DimPlacement) -> Link:
    return Link(p.latency_s, p.bandwidth or 1.0, p.reduce_scatter_factor, p.all_reduce_factor)


def tp_activation_bytes(geo: Geometry) -> float:
    """The gathered activation of one micro-batch: T·d·e (what a TP all-gather assembles)."""
    return geo.microbatch_tokens * geo.model.dim * geo.compute_bytes


def tp_backward_collectives(geo: Geometry) -> int:
    recomputes = geo.parallel.activation_checkpointing != "none"
    return TP_BACKWARD + (TP_FORWARD if recomputes else 0)


def fsdp_placement(placement: dict[str, DimPlacement]) -> DimPlacement:
    """FSDP's group: dp_shard×cp flattened (CP ranks hold the same parameters), on the slower link of
    the two, which is dp_shard's whenever it spans more than one rank (it is the outer dimension).
    Its traffic and exposed time are reported under dp_shard; the cp row is ring attention's."""
    shard, cp = placement["dp_shard"], placement["cp"]
    if cp.degree == 1:
        return shard
    outer = shard if shard.degree > 1 else cp
    return outer.model_copy(update={"degree": shard.degree * cp.degree})


def layer_comms(geo: Geometry, placement: dict[str, DimPlacement]) -> LayerComms:
    tp, rep, pp = (placement[d] for d in ("tp", "dp_replicate", "pp"))
    shard = fsdp_placement(placement)
    activation, layer = tp_activation_bytes(geo), geo.layer_params_tp
    one_tp = collective_seconds("all_gather", activation, tp.degree, link_of(tp))  # = a reduce-scatter's
    return LayerComms(
        tp_forward=TP_FORWARD * one_tp,
        tp_backward=tp_backward_collectives(geo) * one_tp,
        fsdp_gather=collective_seconds("all_gather", layer * geo.compute_bytes, shard.degree, link_of(shard)),
        fsdp_reduce=collective_seconds("reduce_scatter", layer * FP32, shard.degree, link_of(shard)),
        replicate_reduce=collective_seconds(
            "all_reduce", layer * FP32 / shard.degree, rep.degree, link_of(rep)
        ),
        pp_send=0.0 if pp.degree == 1 else pp.latency_s + activation / geo.parallel.tp / pp.bandwidth,
    )


def muon_gather_seconds(geo: Geometry, shard: DimPlacement) -> float:
    """Muon's all-gather of each whole matrix in bf16 before Newton-Schulz (``trainer.rank.muon``), once
    per step inside the optimizer step, where no compute hides it."""
    link = link_of(shard)
    return sum(collective_seconds("all_gather", 2 * r * c, shard.degree, link) for r, c in geo.muon_matrices)


def gradient_syncs(geo: Geometry) -> int:
    """Gradient reductions (and FSDP gathers) per step: every micro-batch when FSDP shards (the
    trainer's accumulation loop reduce-scatters each one), else once: under a pipeline
    (torch.distributed.pipelining defers the FSDP sync to the last micro-batch's backward), and when
    each rank holds whole gradients (DDP, or one FSDP shard per replica), which the trainer reduces
    only after the last micro-batch, as DDP's ``no_sync``."""
    return geo.microbatches if geo.parallel.pp == 1 and geo.fsdp_degree > 1 else 1


def gathers_per_sync(geo: Geometry) -> int:
    """All-gathers of each block per sync: forward, and backward again after a reshard (ZeRO-3)."""
    return 2 if geo.reshard_after_forward else 1


def traffic(geo: Geometry, placement: list[DimPlacement]) -> list[DimPlacement]:
    """Fill each dimension's bytes sent and collective time per step (before overlap)."""
    by_dim = {p.dim: p for p in placement}
    comms, m, syncs = layer_comms(geo, by_dim), geo.microbatches, gradient_syncs(geo)
    layers, units = geo.layers_per_stage, geo.stage_params / geo.parallel.tp
    activation, par = tp_activation_bytes(geo), geo.parallel
    tp_per_mb = TP_FORWARD + tp_backward_collectives(geo)  # collectives per block and micro-batch
    shard_n, rep_n = fsdp_placement(by_dim).degree, by_dim["dp_replicate"].degree
    gathers = gathers_per_sync(geo)
    bytes_and_time = {
        "tp": (
            sent_bytes("all_gather", activation, par.tp) * tp_per_mb * layers * m,
            (comms.tp_forward + comms.tp_backward) * layers * m,
        ),
        "dp_shard": (
            syncs * units * (gathers * geo.compute_bytes + FP32) * (shard_n - 1) / shard_n,
            syncs * layers * (gathers * comms.fsdp_gather + comms.fsdp_reduce),
        ),
        "dp_replicate": (
            syncs * sent_bytes("all_reduce", units * FP32 / shard_n, rep_n),
            syncs * layers * comms.replicate_reduce,
        ),
        "cp": (
            ring_bytes(geo) * layers * m,
            ring_seconds(geo, by_dim["cp"]) * layers * m,
        ),
        "pp": (
            2 * m * par.pp_virtual_stages * activation / par.tp if par.pp > 1 else 0.0,
            2 * m * par.pp_virtual_stages * comms.pp_send,
        ),
    }
    return [
        p.model_copy(update={"bytes_per_step": bytes_and_time[p.dim][0], "time_s": bytes_and_time[p.dim][1]})
        for p in placement
    ]
