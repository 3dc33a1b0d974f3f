"""FSDP2 (``fully_shard``): ZeRO-3 sharding over dp_shard, HSDP when there are dp_replicate replicas.

Each block is its own FSDP unit, so only one block's parameters are unsharded at a time; the root unit
holds the embedding, final norm and output projection.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.config import Precision

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def precision_policy(mixed_precision: Precision) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[mixed_precision], reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, mixed_precision: Precision, reshard_after_forward: bool
) -> nn.Module:
    """Shard model in place over dp_mesh (1-D: FSDP, 2-D (replicate, shard): HSDP).

    Gradients are always reduced in fp32, so bf16 compute never loses precision in the dp average.
    reshard_after_forward=False suits pipelining, where each micro-batch would otherwise re-gather.
    """
    policy = precision_policy(mixed_precision)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model
