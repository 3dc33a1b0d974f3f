"""DDP for layouts that split nothing: pure data parallelism over dp_replicate (or a single process).

With one shard per replica FSDP2 would still copy every block's parameters into a gathered buffer and
free it each micro-batch, and AdamW would step over DTensors. torch's composable ``replicate`` (DDP
without a wrapper module, so parameter FQNs stay the model's and checkpoints reshard by name) keeps
plain tensors and all-reduces gradients in buckets during backward, as torchtitan does for pure DP.

fp32 only: under ``mixed_precision: bf16`` the layout stays on FSDP2, whose policy (bf16 parameters in
every op, fp32 master weights, fp32 gradient reduction) defines what bf16 means on every layout. DDP has
no public equivalent, and autocast casts only some ops (matmuls; norms, softmax and residuals stay
fp32), so a bf16 run's loss curve would depend on whether its layout shards. With one shard, FSDP's
gather is the fp32→bf16 cast that bf16 compute needs anyway.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate import DDP, replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from trainer.config import ParallelConfig


def replicates(cfg: ParallelConfig) -> bool:
    """Whether cfg is pure fp32 data parallelism (dp_shard = cp = tp = pp = ep = 1): DDP instead of FSDP."""
    splits = (cfg.dp_shard, cfg.cp, cfg.tp, cfg.pp, cfg.ep)
    return all(degree == 1 for degree in splits) and cfg.mixed_precision == "fp32"


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Replicate model in place over the dp_replicate ranks; gradients are averaged over them in backward.

    DDP itself is built at the first forward (and broadcasts rank 0's parameters then), so the model may
    still be initialized or loaded from a checkpoint after this call. Passing the process group rather
    than the sliced mesh avoids DDP's DTensor conversion hooks, which would walk all parameters twice
    per forward for nothing (pure DP has no DTensors).
    """
    replicate(model, process_group=mesh["dp_replicate"].get_group())
    return model


def sync_gradients_on_last(model: nn.Module, last: bool, whole: bool) -> None:
    """Reduce gradients only on the step's last micro-batch when every rank holds them whole.

    whole: one shard per replica (DDP, or FSDP over dp_replicate alone). As DDP's ``no_sync``: the local
    gradients are whole either way, so waiting for the last micro-batch costs no memory. Sharded models
    keep reducing per micro-batch: holding whole gradients for the step would undo the sharding.
    """
    if whole and isinstance(model, DDP | FSDPModule):
        model.set_requires_gradient_sync(last)
