"""Context-parallel checks run in tests/dist/parallel_layouts.py's torchrun launch (all its ranks).

Ring attention against plain causal attention: all ranks form one cp ring; each attends its zigzag
chunks, and the output and the q/k/v gradients, reassembled from the chunks, must equal those of full
causal attention over the whole sequence. Resharding: a CP layout's DCP checkpoint loads into another
layout with the same values.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from trainer.config import JobConfig
from trainer.models.llama.model import causal_attention
from trainer.parallel import build_parallel_model
from trainer.parallel.context import ring_attention, shard_sequence

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 32, 8


def ring_attention_max_error() -> dict[str, float]:
    """Largest absolute difference of output and gradients over all ranks (grouped-query, causal), for
    the fused (CPU flash) and the unfused per-step kernel."""
    return {name: max_error(fused) for name, fused in (("fused", True), ("unfused", False))}


def max_error(fused: bool) -> float:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    generator = torch.Generator().manual_seed(3)
    q, k, v, grad = (
        torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=generator)
        for heads in (HEADS, KV_HEADS, KV_HEADS, HEADS)
    )
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = causal_attention(*full)
    expected.backward(grad)

    local = [shard_sequence(t, mesh, dim=2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group=mesh.get_group(), fused=fused)
    out.backward(shard_sequence(grad, mesh, dim=2))
    pairs = [(out, expected)] + [(t.grad, f.grad) for t, f in zip(local, full, strict=True)]
    error = torch.tensor(max((a - shard_sequence(b, mesh, dim=2)).abs().max().item() for a, b in pairs))
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return error.item()


def reshard_max_error(saved: JobConfig, loaded: JobConfig, directory: Path) -> float:
    """Save ``saved``'s layout with DCP, load it into ``loaded``'s (initialized from another seed), and
    return the largest difference of any parameter, made whole, between the two."""
    source = build_parallel_model(saved, torch.device("cpu"))
    target = build_parallel_model(loaded.model_copy(update={"seed": saved.seed + 1}), torch.device("cpu"))
    (source_part,), (target_part,) = source.parts, target.parts
    dcp.save(get_model_state_dict(source_part), checkpoint_id=str(directory))
    state = get_model_state_dict(target_part)
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(target_part, state)
    expected, actual = get_model_state_dict(source_part), get_model_state_dict(target_part)
    assert expected.keys() == actual.keys()
    return max((_whole(actual[key]) - _whole(expected[key])).abs().max().item() for key in expected)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
