"""Context parallelism: each sequence is split over the cp ranks, and attention runs as a ring.

Load balancing for the causal mask (the "zigzag" layout of Megatron-CP and torchtitan): the sequence
is cut into 2·cp equal chunks and rank i holds chunks i and 2·cp−1−i, so every rank owns as many
early (cheap) as late (expensive) queries and does the same attention work. The data path cuts
tokens and targets with :func:`shard_sequence`, and every attention layer cuts the RoPE table the
same way, so positions follow the chunks.

Ring attention is built here from point-to-point sends (``dist.batch_isend_irecv``) rather than
torch's ``context_parallel``: that public API fails on CPU (no sharding strategy for the CPU flash
op), and its templated ring path is private, was only reported for non-causal masks with load
balancing off on gloo, and changes between torch releases. Ours is ~150 lines of plain torch with an
explicit backward, uses only ops every torch backend has (point-to-point sends, matmuls), and is
checked against full causal attention with and without its fused kernel. Each step passes the key/value chunks one rank along the ring while this rank attends to
the ones it holds, so the transfer overlaps the compute; the partial results merge by their
log-sum-exp (online softmax). With the zigzag layout every step after the first is exactly half a
block: against chunks from a lower rank all local queries see the first key chunk only, against a
higher rank only the second query chunk sees all keys, so no step needs a mask.

Each ring step runs a fused flash kernel that returns the log-sum-exp where the device has one we
could check (CPU's ``_scaled_dot_product_flash_attention_for_cpu``: memory linear in the chunk), and
otherwise matmuls with an explicit softmax, which materialize one step's scores.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

KV_TAG, GRAD_TAG = 1, 2  # both passes go to the same neighbour in backward; tags keep them apart
# Fused flash kernels that also return the log-sum-exp the ring merges by. The CUDA/XLA/Neuron ones have
# other signatures and no device here to check them on, so those devices run the unfused kernel.
FUSED_DEVICES = ("cpu",)
FUSED_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def shard_sequence(tensor: Tensor, cp_mesh: DeviceMesh, dim: int = 1) -> Tensor:
    """This rank's chunks i and 2·cp−1−i of ``tensor`` along dim (the whole tensor when cp = 1)."""
    cp = cp_mesh.size()
    if cp == 1:
        return tensor
    if tensor.shape[dim] % (2 * cp):
        raise ValueError(
            f"a sequence of {tensor.shape[dim]} does not split into 2·cp = {2 * cp} equal chunks"
        )
    rank = cp_mesh.get_local_rank()
    chunks = tensor.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Ring attention over cp_mesh in every block, with RoPE at the positions of this rank's chunks.

    The inputs must already be this rank's chunks (:func:`shard_sequence` on tokens and targets).
    """
    group = cp_mesh.get_group()
    for block in model.layers.values():
        block.attention.attend = partial(ring_attention, group=group)
        block.attention.register_forward_pre_hook(partial(_local_rope, cp_mesh=cp_mesh))
    return model


def _local_rope(
    module: torch.nn.Module, args: tuple[Tensor, Tensor, None], cp_mesh: DeviceMesh
) -> tuple[Tensor, Tensor, None]:
    """Attention's forward pre-hook: the RoPE table's rows at this rank's positions (no documents: the
    spec refuses document attention with cp > 1)."""
    x, rope, docs = args
    return x, shard_sequence(rope, cp_mesh, dim=0), docs


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, fused: bool | None = None) -> Tensor:
    """Causal attention of this rank's zigzag chunks: q [B, H, S, hd], k, v [B, H_kv, S, hd], S = T/cp.

    fused: run each ring step with the device's fused flash kernel (default where there is one that
    returns the log-sum-exp: CPU's) rather than the unfused matmul-and-softmax one.
    """
    return _RingAttention.apply(q, k, v, group, q.device.type in FUSED_DEVICES if fused is None else fused)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, fused: bool) -> Tensor:  # type: ignore[override]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        # K and V travel together, in the compute dtype; each block's math is fp32.
        qf, kv = q.float(), torch.stack((k, v)).contiguous()
        out = torch.empty_like(qf)
        lse = torch.empty(qf.shape[:-1], dtype=torch.float32, device=q.device)
        for step in range(size):
            pending = _pass_along(kv, group, KV_TAG) if step < size - 1 else None
            rows, cols, causal = _block(step, rank, size, q.shape[2])
            block_out, block_lse = _block_forward(qf[:, :, rows], *_columns(kv, cols), causal, fused)
            if step == 0:
                out[:, :, rows], lse[:, :, rows] = block_out, block_lse
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if pending is not None:
                kv = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.fused = group, fused
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        qf, dout = q.float(), grad_out.float()
        kv = torch.stack((k, v)).contiguous()
        dq = torch.zeros_like(qf)
        grads: _Pending | None = None
        for step in range(size):
            pending = _pass_along(kv, group, KV_TAG) if step < size - 1 else None
            rows, cols, causal = _block(step, rank, size, q.shape[2])
            dq_rows, dk, dv = _block_backward(
                qf[:, :, rows],
                *_columns(kv, cols),
                out[:, :, rows],
                dout[:, :, rows],
                lse[:, :, rows],
                causal,
                ctx.fused,
            )
            dq[:, :, rows] += dq_rows
            # The key/value gradients travel with their chunks and arrive home after a full turn.
            dkv = torch.zeros_like(kv, dtype=torch.float32) if grads is None else grads.wait()
            dkv[0][:, :, cols] += dk
            dkv[1][:, :, cols] += dv
            grads = _pass_along(dkv, group, GRAD_TAG)
            if pending is not None:
                kv = pending.wait()
        dkv = grads.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _block(step: int, rank: int, size: int, local_len: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) this rank attends to at ring step ``step``.

    The chunks held then come from rank (rank − step) mod size; see the module docstring.
    """
    half, source = local_len // 2, (rank - step) % size
    if source == rank:
        return slice(None), slice(None), True  # own chunks: local positions increase, a plain causal mask
    if source < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _columns(kv: Tensor, cols: slice) -> tuple[Tensor, Tensor]:
    """The held keys and values at the block's columns, in fp32."""
    return kv[0][:, :, cols].float(), kv[1][:, :, cols].float()


def _block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, fused: bool) -> tuple[Tensor, Tensor]:
    """Softmax attention of one block in fp32: (output, log-sum-exp of each query's scores)."""
    k, v = _repeat_heads(k, q), _repeat_heads(v, q)
    if fused:
        return FUSED_FORWARD(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=causal)
    scores = _scores(q, k, causal)
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _block_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor, causal: bool, fused: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block from the *final* output and log-sum-exp (FlashAttention-2's backward)."""
    k_full, v_full = _repeat_heads(k, q), _repeat_heads(v, q)
    if fused:
        blocks = (t.contiguous() for t in (dout, q, k_full, v_full, out, lse))
        dq, dk, dv = FUSED_BACKWARD(*blocks, 0.0, causal)
    else:
        probs = torch.exp(_scores(q, k_full, causal) - lse.unsqueeze(-1))
        dv = probs.transpose(-2, -1) @ dout
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO ∘ O), the softmax-backward correction
        dscores = probs * (dout @ v_full.transpose(-2, -1) - delta)
        scale = q.shape[-1] ** -0.5
        dq, dk = dscores @ k_full * scale, dscores.transpose(-2, -1) @ q * scale
    return dq, _sum_heads(dk, k), _sum_heads(dv, v)


def _scores(q: Tensor, k: Tensor, causal: bool) -> Tensor:
    """Scaled q·kᵀ of a block (k with the query's head count), the future masked out when causal."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, -math.inf)
    return scores


def _repeat_heads(kv: Tensor, q: Tensor) -> Tensor:
    """Grouped-query attention: each key/value head serves H / H_kv consecutive query heads."""
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], dim=1)


def _sum_heads(grad: Tensor, kv: Tensor) -> Tensor:
    """The gradient of a repeated head is the sum over the query heads it served."""
    batch, heads, seq, dim = grad.shape
    return grad.view(batch, kv.shape[1], heads // kv.shape[1], seq, dim).sum(2)


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's (output, log-sum-exp) into the running ones, in place (online softmax)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(
        block_out * torch.exp(block_lse - merged).unsqueeze(-1)
    )
    lse.copy_(merged)


class _Pending:
    """A tensor on its way from the previous rank of the ring, and this rank's send to the next."""

    def __init__(self, works: list[dist.Work], received: Tensor) -> None:
        self.works, self.received = works, received

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        return self.received


def _pass_along(tensor: Tensor, group: ProcessGroup, tag: int) -> _Pending:
    """Start sending ``tensor`` to the next rank of the ring and receiving the previous rank's."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group, tag),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % size), group, tag),
    ]
    return _Pending(dist.batch_isend_irecv(ops), received)
