"""Compose the parallelisms on one model (or pipeline stage), in torchtitan's order.

TP first (it rewrites parameters into tp-sharded DTensors), CP (ring attention and the local RoPE
positions, inside the blocks), EP (experts sharded over ep ranks, with their own FSDP units), then
activation checkpointing and compile
(they wrap the already-parallel blocks), FSDP last (it shards whatever parameters it finds over dp).
A layout that splits nothing in fp32 (pure data parallelism, or one process) gets DDP instead
(``replicate.py``): FSDP with one shard per replica pays gathers and DTensors for no memory saving.
Every other layout gets FSDP even when dp = 1, for the same parameter types and mixed precision.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from trainer.config import ParallelConfig
from trainer.model import Transformer
from trainer.parallel.activation import apply_ac
from trainer.parallel.compile import apply_compile
from trainer.parallel.context import apply_cp
from trainer.parallel.expert import apply_ep
from trainer.parallel.float8 import apply_float8
from trainer.parallel.fsdp import apply_fsdp, precision_policy
from trainer.parallel.mesh import check_mesh, dp_mesh
from trainer.parallel.replicate import apply_ddp, replicates
from trainer.parallel.tensor import apply_tp


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig) -> Transformer:
    check_mesh(mesh)
    if cfg.tp > 1:
        apply_tp(model, mesh["tp"])
    if cfg.cp > 1:
        apply_cp(model, mesh["cp"])
    reshard = (
        cfg.reshard_after_forward and cfg.pp == 1
    )  # a pipeline stage stays gathered across micro-batches
    if cfg.ep > 1:  # the experts' own FSDP units, before the blocks' claim the dense parameters
        apply_ep(model, mesh, cfg.ep, precision_policy(cfg.mixed_precision), reshard)
    apply_float8(model, cfg.float8)  # swaps nn.Linear modules: before AC/compile/FSDP wrap them
    apply_ac(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    if replicates(cfg):
        return apply_ddp(model, mesh)
    return apply_fsdp(model, dp_mesh(mesh), cfg.mixed_precision, reshard_after_forward=reshard)
