"""Global gradient-norm clipping across pipeline stages, tensor shards and FSDP shards.

Gradients are grouped by the mesh their DTensor lives on (plain tensors form their own group), each
group's norm is made whole with ``full_tensor()``, the squares are summed, and pipeline stages (which
hold disjoint parameters) are summed over the pp group. Grouping keeps this correct even if some
parameters end up on another mesh (the "same mesh" pitfall of ``torch.nn.utils.clip_grad_norm_``).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def clip_grad_norm_(parts: list[nn.Module], max_norm: float, pp_group: ProcessGroup | None) -> Tensor:
    """Total L2 norm of all gradients (same on every rank); scales them down to max_norm if above it.

    max_norm 0 or inf only measures.
    """
    groups: dict[DeviceMesh | None, list[nn.Parameter]] = defaultdict(list)
    for part in parts:
        for param in part.parameters():
            if param.grad is not None:
                groups[param.device_mesh if isinstance(param, DTensor) else None].append(param)
    squares = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.float() ** 2)
    device = next(p.device for part in parts for p in part.parameters())
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if 0 < max_norm < math.inf:
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
