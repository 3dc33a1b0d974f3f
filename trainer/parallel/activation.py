"""Activation checkpointing per transformer block.

full: keep only each block's input, recompute the whole block in backward (least memory).
selective: keep the outputs of matmuls and attention, recompute the memory-bound ops between them
(norms, RoPE, SwiGLU gating): most of full's memory saving for a fraction of its recompute FLOPs.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainer.config import ActivationCheckpointing

aten = torch.ops.aten
SAVED_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: ActivationCheckpointing) -> nn.Module:
    """Wrap every block in place; FQNs are unchanged for checkpoints (DCP strips the wrapper prefix)."""
    if mode == "none":
        return model
    # No dropout in this model, so recomputation is deterministic without saving/restoring RNG state.
    options: dict[str, Any] = {"preserve_rng_state": False}
    if mode == "selective":
        options["context_fn"] = partial(create_selective_checkpoint_contexts, _keep_matmuls)
    for key, block in model.layers.items():
        model.layers[key] = checkpoint_wrapper(block, **options)
    return model
