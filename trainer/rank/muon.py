"""Muon for the blocks' weight matrices, AdamW for everything else, as one optimizer per model part.

Muon (Keller Jordan, 2024) replaces a matrix's update by its momentum orthogonalised with a few
Newton-Schulz iterations. Like its authors, Moonshot ("Muon is scalable", 2025) and torchtitan, only the
hidden 2-D matrices get it: embeddings, norm gains and the output layer stay on AdamW. The update is scaled
by 0.2·sqrt(max(rows, cols)) (Moonshot's match of AdamW's update RMS), so the spec's lr and weight_decay
serve both. The Newton-Schulz math and that scale are torch's own ``torch.optim.Muon`` (a test holds the
two bitwise equal in one process); torch's class itself cannot serve, because it orthogonalises
whatever local tensor it is handed, and under FSDP that is a row shard of the matrix.

Under FSDP each rank gathers the whole momentum matrix (``full_tensor``, in bf16 where Newton-Schulz
runs anyway), orthogonalises it, and keeps its own rows (Replicate → Shard is a local slice): Moonshot's
Distributed Muon. Every rank repeats the same Newton-Schulz work, which costs dp_shard× the FLOPs of
orthogonalising on one owning rank and scattering, but needs one all-gather and no scatter, no per-matrix
owner bookkeeping, and gives every rank bit-identical updates, so resume and layout parity stay exact.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)
from torch.optim.adam import adam

from trainer.config import OptimizerConfig

MOMENTUM = 0.95  # torch's and Keller Jordan's default, Nesterov-style
NS_STEPS = DEFAULT_NS_STEPS  # 5: what the planner prices (trainer.plan.compute.MUON_NS_STEPS)
# A family's transformer blocks live under ``layers.`` (the pipeline splitter and HF mapping rely on it);
# everything outside them is the embedding, the final norm and the output layer.
HIDDEN_PREFIX = "layers."


def is_hidden_matrix(name: str, param: nn.Parameter) -> bool:
    """Muon's share of a model: the blocks' 2-D weights (norm gains are 1-D)."""
    return param.ndim == 2 and name.startswith(HIDDEN_PREFIX)


class MuonWithAdamW(torch.optim.AdamW):
    """Groups flagged ``muon`` take Muon steps; the others torch's AdamW, unchanged (its state, kernels)."""

    def __init__(self, part: nn.Module, cfg: OptimizerConfig, fused: bool | None) -> None:
        named = [(n, p) for n, p in part.named_parameters() if p.requires_grad]
        hidden = [p for n, p in named if is_hidden_matrix(n, p)]
        rest = [p for n, p in named if not is_hidden_matrix(n, p)]
        groups = [
            {"params": hidden, "weight_decay": cfg.weight_decay, "muon": True},
            {"params": [p for p in rest if p.ndim >= 2], "weight_decay": cfg.weight_decay, "muon": False},
            {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0, "muon": False},
        ]
        super().__init__(
            [g for g in groups if g["params"]],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            fused=fused,
        )

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One step of every group; no closure (the trainer computes its loss before stepping)."""
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)

    def _muon_step(self, group: dict) -> None:
        lr, decay = group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                # AdamW's load_state_dict (Adam.__setstate__) reads a "step" from every non-empty state.
                state["step"] = torch.tensor(0.0)
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - MOMENTUM)
            update = orthogonalise(p.grad.lerp(buf, MOMENTUM))
            p.mul_(1 - lr * decay)
            p.add_(update, alpha=-_adjust_lr(lr, "match_rms_adamw", p.shape))

    def _adamw_step(self, group: dict) -> None:
        """torch.optim.Adam.step's body for one group (AdamW: decoupled decay)."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            has_complex=has_complex,
            decoupled_weight_decay=True,
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )


def orthogonalise(update: Tensor) -> Tensor:
    """Newton-Schulz of the whole matrix; for a DTensor, gathered, then sliced back to this rank's shard."""
    if not isinstance(update, DTensor):
        return newton_schulz(update)
    whole = newton_schulz(update.bfloat16().full_tensor())
    mesh = update.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, update.placements)


def newton_schulz(matrix: Tensor) -> Tensor:
    """torch.optim.Muon's quintic iteration (bf16 result)."""
    return _zeropower_via_newtonschulz(matrix, (DEFAULT_A, DEFAULT_B, DEFAULT_C), NS_STEPS, EPS)
