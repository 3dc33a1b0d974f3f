"""Mixture-of-experts feed-forward: a router, routed SwiGLU experts and optional shared experts.

Top-k token choice (Mixtral): each token goes to the k experts with the highest router probability and
mixes their outputs with those probabilities renormalized over the k. DeepSeek's variants are options of
``model.moe``: sigmoid scores (V3), weights left unnormalized (V2-Lite), and a routed_scale on the mixing
weights (V3's routed_scaling_factor). Dropless: every expert processes every token routed to it (no
capacity factor), so the result does not depend on how a batch is split.

Load balancing, both DeepSeek-V3's (``model.moe.balance``):

- ``aux_loss``: the sequence-wise auxiliary loss, coef · Σ_e f_e · P_e per sequence, averaged over
  sequences (f_e: the fraction of the sequence's routing slots that chose e, times n_experts; P_e: its
  mean router probability). Being a mean over sequences, it splits over data-parallel ranks and
  micro-batches exactly like the token loss. It is added in backward only (Megatron's "aux loss
  auto-scaler"), so the model still returns logits and the reported loss stays the language-model loss.
- ``bias`` (auxiliary-loss-free, §2.1.2): a per-expert bias b is added to the router probabilities to
  pick the top k; the mixing weights still come from the unbiased probabilities, so b steers tokens but
  never scales an output or takes a gradient. After each optimizer step, b_e += γ · sign(mean load −
  load_e), load_e being the routing slots that chose e over the whole global batch (all micro-batches,
  summed over the data-parallel ranks), so every layout makes the same update. b is a persistent buffer:
  checkpointed with the weights, a resumed run routes exactly as the uninterrupted one.

Loads are counted in backward, once per micro-batch: activation checkpointing's recomputed forwards and
no-grad forwards (evaluation) have no backward, so they count nothing.

Architecture only: expert parallelism (``trainer.parallel.expert``) intercepts :class:`GroupedExperts`'
forward to send tokens to the rank holding their expert and back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.config import MoEConfig
from trainer.rank.local_tensor import local_tensor

# How much one forward's auxiliary loss weighs in the step's gradient: 1/micro-batches under gradient
# accumulation (each micro-batch's token loss is scaled so), 1 when a pipeline schedule scales grads itself.
_aux_loss_scale = [1.0]


@contextlib.contextmanager
def auxiliary_loss_scale(scale: float) -> Iterator[None]:
    """Forwards run inside weigh their auxiliary losses by scale, like the token loss they go with."""
    _aux_loss_scale.append(scale)
    try:
        yield
    finally:
        _aux_loss_scale.pop()


class _BalanceInBackward(torch.autograd.Function):
    """Identity on out. In backward: gradient `scale` into aux (as if it were added to the loss), and the
    micro-batch's routing counts into the router's step load (see the module docstring for why there)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        out: Tensor,
        aux: Tensor,
        scale: float,
        counts: Tensor,
        router: Router,
    ) -> Tensor:
        # Attributes, not saved tensors: activation checkpointing keeps them as they are.
        ctx.scale, ctx.counts, ctx.router = scale, counts, router
        return out.view_as(out)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: Tensor
    ) -> tuple[Tensor, Tensor, None, None, None]:
        if ctx.router.expert_load is not None:
            ctx.router.expert_load += ctx.counts
        return grad, torch.full((), ctx.scale, device=grad.device), None, None, None


class GroupedExperts(nn.Module):
    """n SwiGLU experts stacked into [n, d, h] / [n, h, d] weights, so sharding dim 0 splits experts."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, tokens: Tensor, counts: Tensor) -> Tensor:
        """tokens [N, d] sorted by expert, counts[e] of them for expert e -> outputs [N, d], same order.

        A loop over experts rather than ``F.grouped_mm``: grouped_mm failed on torch 2.13 CPU (fp32 and
        bf16) for these shapes, and the loop is exact in fp32, which the parity tests need.
        """
        # unbind, not w[e]: indexing's backward writes each expert's gradient into a zeroed copy of the
        # whole stacked weight (E full-size copies per step); unbind's stacks them once.
        # This rank's experts: under expert parallelism the stacked weights are DTensors sharded on experts.
        w1, w2, w3 = (local_tensor(w).unbind(0) for w in (self.w1, self.w2, self.w3))
        outputs = [
            (F.silu(chunk @ w1[e]) * (chunk @ w3[e])) @ w2[e]
            for e, chunk in enumerate(tokens.split(counts.tolist()))
        ]
        return torch.cat(outputs)


class Router(nn.Module):
    """Token-choice top-k gate with its load balancing (see the module docstring)."""

    expert_bias: Tensor | None
    expert_load: Tensor | None

    def __init__(self, dim: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, cfg.n_experts, bias=False)
        self.top_k = cfg.top_k
        self.score, self.normalize_weights, self.routed_scale = (
            cfg.score,
            cfg.normalize_weights,
            cfg.routed_scale,
        )
        self.aux_loss_coef = cfg.aux_loss_coef
        self.bias_update_rate = cfg.bias_update_rate
        biased = cfg.balance == "bias"  # otherwise no buffers: checkpoints keep only the weights
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts) if biased else None)
        # This step's routing slots per expert; always zero between steps, so never checkpointed.
        load = torch.zeros(cfg.n_experts, dtype=torch.long) if biased else None
        self.register_buffer("expert_load", load, persistent=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, d] -> (weights [B·T, k], experts [B·T, k], auxiliary loss []); routing in fp32."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        if self.expert_bias is None:
            top_scores, experts = scores.topk(self.top_k, dim=-1)
        else:  # the bias picks the experts; their weights are still the unbiased scores
            experts = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
            top_scores = scores.gather(-1, experts)
        weights = top_scores / top_scores.sum(dim=-1, keepdim=True) if self.normalize_weights else top_scores
        weights = weights * self.routed_scale if self.routed_scale != 1.0 else weights
        # The balance loss's P_e is a distribution over experts (DeepSeek-V3 normalises its sigmoid scores).
        probs = scores if self.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        n_experts = probs.shape[-1]
        with torch.no_grad():
            chosen = torch.zeros_like(probs).scatter_(-1, experts, 1.0)
            load = chosen.mean(dim=1) * n_experts / self.top_k  # [B, E]; 1 everywhere when balanced
        aux = self.aux_loss_coef * (load * probs.mean(dim=1)).sum(dim=-1).mean()
        return weights.flatten(0, 1), experts.flatten(0, 1), aux

    def step_statistics(self) -> list[Tensor]:
        """What this step counted for :meth:`after_optimizer_step`: the expert loads (none without a bias)."""
        return [self.expert_load] if self.expert_load is not None else []

    @torch.no_grad()
    def after_optimizer_step(self, sum_over_data_ranks: Callable[[Tensor], None]) -> None:
        """b_e += γ · sign(mean load − load_e) from the step's global loads (a no-op without a bias)."""
        if self.expert_bias is None or self.expert_load is None:
            return
        sum_over_data_ranks(self.expert_load)
        load = self.expert_load.double()
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load).to(self.expert_bias.dtype)
        self.expert_load.zero_()


class MoE(nn.Module):
    """Drop-in for the dense FeedForward: [B, T, d] -> [B, T, d]."""

    def __init__(self, dim: int, hidden: int, cfg: MoEConfig, shared: nn.Module | None) -> None:
        super().__init__()
        self.router = Router(dim, cfg)
        self.experts = GroupedExperts(cfg.n_experts, dim, hidden)
        self.shared = shared

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, experts, aux = self.router(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # routing slots grouped by expert
        source = order // experts.shape[1]  # the token each slot came from
        counts = torch.bincount(flat, minlength=self.experts.w1.shape[0])
        routed = self.experts(tokens[source], counts) * weights.flatten()[order, None].to(x.dtype)
        out = torch.zeros_like(tokens).index_add_(0, source, routed)
        if self.shared is not None:
            out = out + self.shared(tokens)
        scale = _aux_loss_scale[-1]
        return _BalanceInBackward.apply(out.view(batch, seq, dim), aux, scale, counts, self.router)
