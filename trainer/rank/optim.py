"""AdamW (or Muon with AdamW, ``trainer.rank.muon``) with linear warmup then cosine decay, one
optimizer per model part.

Pipeline stages are separate modules on a rank, so each part gets its own optimizer and scheduler;
they share one learning-rate rule and step together.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import OptimizerConfig
from trainer.rank.muon import MuonWithAdamW


def build_optimizer(part: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """Decay only matrices (≥2-D weights): decaying norms' gains and biases pulls them to zero for no gain."""
    params = [p for p in part.parameters() if p.requires_grad]
    if cfg.name == "muon":
        return MuonWithAdamW(part, cfg, fused=fused_on(params))
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused_on(params),
    )


def fused_on(params: list[nn.Parameter]) -> bool | None:
    """Fused AdamW where every parameter is on CUDA: one kernel reads p, g, m, v and writes p, m, v
    (28 B/param, the planner's figure), where torch's default there, foreach, makes several passes
    and holds an fp32 temporary as large as the parameters. Elsewhere torch's default (None): the
    per-tensor loop on CPU, as the parity tests and the planner's host model assume."""
    return True if params and all(p.device.type == "cuda" for p in params) else None


def lr_factor(step_index: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for the optimizer step ``step_index`` (0-based).

    Warmup reaches the peak at its last step, so step 0 never runs at lr=0 (a wasted step).
    """
    if step_index < warmup_steps:
        return (step_index + 1) / warmup_steps
    progress = min(1.0, (step_index - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int, steps_done: int = 0
) -> LambdaLR:
    """The schedule positioned for optimizer step ``steps_done`` (0 for a fresh run).

    The learning rate is a pure function of the step, so a resume needs only the checkpoint's step,
    and the peak lr comes from the current spec rather than whatever a checkpoint recorded.
    """
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr  # what LambdaLR scales; it requires it when not starting at step 0
    rule = partial(
        lr_factor, warmup_steps=cfg.warmup_steps, total_steps=total_steps, min_lr_ratio=cfg.min_lr_ratio
    )
    return LambdaLR(optimizer, rule, last_epoch=steps_done - 1)
