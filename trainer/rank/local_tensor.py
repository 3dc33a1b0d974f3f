"""This rank's part of a tensor, whether or not a parallelism made it a DTensor.

One spelling for code that runs on every layout (FSDP's shards, TP's and EP's splits, and plain
tensors under DDP or one process) and needs the local values: a leaf module, so that the model
(``trainer/models/moe.py``) and the parallel wrappers around it can both import it.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor


def local_tensor(tensor: Tensor) -> Tensor:
    """``tensor``'s local values: a DTensor's shard on this rank (a replicated one's whole value), or
    the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
