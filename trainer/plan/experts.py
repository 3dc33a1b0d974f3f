"""Expert parallelism's all-to-alls: routing slots to their experts' ranks and back, every MoE layer.

Per MoE layer and micro-batch a chip dispatches T·k routing slots of d elements (e bytes each) and
gets as many back in the combine; with uniform routing (what the balancing loss aims at) (ep−1)/ep of
them cross to other ranks. Backward runs both transposed (4 in all); full recomputation repeats the
forward's 2. Under TP every tp rank dispatches the whole micro-batch (MoE layers are not tp-split).
As in torchtitan's default, they are not overlapped: each sits between the router and the experts on
the critical path. An ep group is tp·cp·ep consecutive ranks (the innermost part of dp_shard), placed
on the interconnect like a dp_shard of degree ep, so ep = 8 inside an 8-GPU node runs on NVLink even
when dp_shard spans nodes.
"""

from __future__ import annotations

from dataclasses import replace

from trainer.config import HardwareConfig
from trainer.plan.comms import DimPlacement, place
from trainer.plan.layout import Geometry
from trainer.plan.profile import HardwareProfile


def moe_layers_per_stage(geo: Geometry) -> float:
    return geo.model.moe_layer_count / geo.parallel.pp


def all_to_alls_per_layer(geo: Geometry) -> int:
    return 4 + (2 if geo.parallel.activation_checkpointing == "full" else 0)


def all_to_all_bytes(geo: Geometry) -> float:
    """Bytes one chip sends to other ranks in one dispatch (or combine) of one micro-batch."""
    ep, model = geo.parallel.ep, geo.model
    if ep == 1 or model.moe is None:
        return 0.0
    slots = geo.microbatch_tokens * model.moe.top_k
    return slots * model.dim * geo.compute_bytes * (ep - 1) / ep


def ep_placements(geo: Geometry, hw: HardwareProfile, hardware: HardwareConfig) -> list[DimPlacement]:
    """The ep group's row of the mesh placement (none when ep = 1), with its all-to-all bytes and time
    per step: α per peer plus bytes over the link, for every all-to-all (all exposed)."""
    par = geo.parallel
    if par.ep == 1:
        return []
    alone = par.model_copy(update=dict(dp_shard=par.ep, dp_replicate=1, pp=1))
    (link,) = [p for p in place(replace(geo, parallel=alone), hw, hardware) if p.dim == "dp_shard"]
    count = all_to_alls_per_layer(geo) * moe_layers_per_stage(geo) * geo.microbatches
    sent = all_to_all_bytes(geo)
    one = (par.ep - 1) * link.latency_s + sent / link.bandwidth
    return [link.model_copy(update=dict(dim="ep", bytes_per_step=count * sent, time_s=count * one))]
