"""Expert parallelism: each MoE layer's experts split over ``ep`` ranks; tokens travel by all-to-all.

As in torchtitan, the ep ranks are carved out of the FSDP shard ranks (dp_shard = dp_shard_mod_ep × ep,
ep innermost so the all-to-alls stay on the fastest links) instead of adding an outer mesh dim: every ep
rank still reads its own data, so EP adds no ranks and no replicated compute. Dense parameters stay
FSDP-sharded over all of dp_shard; the experts are a DTensor sharded on their expert dim over ``ep`` and
FSDP-sharded over the rest (dp_shard_mod_ep, plus dp_replicate under HSDP), so each expert is still
stored once across a replica and checkpoints reshard by name.

Per MoE layer and micro-batch: dispatch (routing slots to their expert's rank, then regrouped by local
expert), the local experts, combine (the inverse), each an uneven ``all_to_all_single`` with its
transpose in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.models.moe import GroupedExperts

EP_DIMS = ("dp_shard_mod_ep", "ep")


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single whose backward sends gradients back along the same routes."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: ProcessGroup,
    ) -> Tensor:
        ctx.routes = (in_splits, out_splits, group)
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        in_splits, out_splits, group = ctx.routes
        return _all_to_all(grad, in_splits, out_splits, group), None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by factor in backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


@dataclass
class _Dispatch:
    """Forward hooks around one GroupedExperts: tokens to their experts' ranks before, back after."""

    group: ProcessGroup
    pending: list[tuple[Tensor, list[int], list[int]]] = field(default_factory=list)

    def before(self, experts: nn.Module, args: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        tokens, counts = args  # sorted by global expert id; counts over all experts
        ranks = dist.get_world_size(self.group)
        send_counts = counts.view(ranks, -1)  # row r: my slots for rank r's experts
        recv_counts = _all_to_all(
            counts, [send_counts.shape[1]] * ranks, [send_counts.shape[1]] * ranks, self.group
        )
        recv_counts = recv_counts.view(ranks, -1)  # row s: rank s's slots for my experts
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        received = _AllToAll.apply(tokens, recv, send, self.group)  # (source rank, expert)-major
        order = _expert_major(recv_counts)
        self.pending.append((order, send, recv))
        # With after()'s 1/ranks: expert grads come out divided by ranks, token grads unchanged (see apply_ep).
        return _ScaleGrad.apply(received[order], ranks), recv_counts.sum(0)

    def after(self, experts: nn.Module, args: tuple[Tensor, Tensor], out: Tensor) -> Tensor:
        order, send, recv = self.pending.pop()
        out = _ScaleGrad.apply(out, 1 / dist.get_world_size(self.group))
        return _AllToAll.apply(out[order.argsort()], send, recv, self.group)


def _expert_major(counts: Tensor) -> Tensor:
    """Indices reordering rows laid out source-major ([source][expert] blocks of counts) to expert-major."""
    blocks = torch.arange(int(counts.sum())).split(counts.flatten().tolist())
    sources, experts = counts.shape
    return torch.cat([blocks[s * experts + e] for e in range(experts) for s in range(sources)])


def ep_meshes(mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(ep mesh, the mesh FSDP shards experts over): dp_shard split into (dp_shard_mod_ep, ep)."""
    split = mesh._unflatten("dp_shard", (mesh["dp_shard"].size() // ep, ep), EP_DIMS)
    expert_dp = ("dp_replicate", EP_DIMS[0]) if mesh["dp_replicate"].size() > 1 else (EP_DIMS[0],)
    return split["ep"], split[expert_dp]


def apply_ep(
    model: nn.Module, mesh: DeviceMesh, ep: int, policy: MixedPrecisionPolicy, reshard: bool
) -> None:
    """Shard every GroupedExperts of model over ep ranks and route its tokens there and back.

    The experts get their own FSDP unit (sharded over the rest of the dp ranks, on their hidden dim so
    few experts per rank still shard) before the block's FSDP claims the dense parameters. Their
    gradients sum contributions from the ep ranks' tokens, so the hooks divide them by ep on top of
    their FSDP group's average (FSDP2's set_gradient_divide_factor needs PREMUL_SUM, which gloo lacks).
    """
    ep_mesh, expert_dp = ep_meshes(mesh, ep)
    for experts in [m for m in model.modules() if isinstance(m, GroupedExperts)]:
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        dispatch = _Dispatch(ep_mesh.get_group())
        experts.register_forward_pre_hook(dispatch.before)
        experts.register_forward_hook(dispatch.after)
        fully_shard(
            experts,
            mesh=expert_dp,
            mp_policy=policy,
            reshard_after_forward=reshard,
            shard_placement_fn=lambda _: Shard(1),
        )
