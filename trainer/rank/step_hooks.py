"""Once-per-step module state: what a module updates from the whole global batch after the optimizer steps.

A module with an ``after_optimizer_step(sum_over_data_ranks)`` method (today: an MoE router's balancing
bias) is called once per step, after the optimizer, with a function that sums a tensor in place over the
ranks holding the same module but seeing different tokens: data-parallel replicas and shards (ep ranks
are among them) and context-parallel ranks. Not tp ranks, which see the same tokens, nor pp ranks, which
hold other layers. So the loop needs no branch on the model, and the update is the same on every layout.
What such a module counts during the step it also lists in ``step_statistics()``, so that replica groups
outside the device mesh (``trainer.rank.replica_ft``) can sum it across replicas first.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

DATA_DIMS = ("dp_replicate", "dp_shard", "cp")


def after_optimizer_step(parts: Iterable[nn.Module], mesh: DeviceMesh | None = None) -> None:
    """Call every module's after_optimizer_step; mesh None: one process holding the whole batch."""

    def sum_over_data_ranks(tensor: Tensor) -> None:
        for dim in DATA_DIMS if mesh is not None else ():
            if mesh[dim].size() > 1:
                dist.all_reduce(tensor, group=mesh[dim].get_group())

    for part in parts:
        for module in part.modules():
            hook = getattr(module, "after_optimizer_step", None)
            if hook is not None:
                hook(sum_over_data_ranks)


def step_statistics(parts: Iterable[nn.Module]) -> list[Tensor]:
    """The tensors modules counted this step for their ``after_optimizer_step`` (e.g. expert loads)."""
    return [
        tensor
        for part in parts
        for module in part.modules()
        if hasattr(module, "step_statistics")
        for tensor in module.step_statistics()
    ]
