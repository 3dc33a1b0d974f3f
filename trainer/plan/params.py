"""Exact parameter counts of our Llama-style decoder, from the model config alone (no torch).

Mirrors ``trainer/model.py``: bias-free projections, two RMSNorm gains per block, a final norm, an
input embedding and an output projection (one matrix when ``tie_embeddings``). An MoE layer's FFN is a
router (d·E) plus E routed and S shared SwiGLU experts; a token uses only top_k of the routed ones, so
FLOPs count *active* parameters (Mixtral 8×7B: 46.7B in all, 12.9B active).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by where they live; pipeline stages and FLOP counts need the split, not just the sum."""

    embedding: int  # input table V·d (shared with the output projection when tied)
    per_layer: float  # mean over blocks (MoE and dense blocks differ when MoE is every n-th layer)
    per_layer_matmul: float  # a block's weights one token multiplies (active experts only; no norm gains)
    n_layers: int
    final_norm: int
    output: int  # V·d, or 0 when tied to the embedding
    routed: int = 0  # routed-expert weights, over all MoE layers (what expert parallelism splits)
    inactive: int = 0  # the part of them a token skips

    @property
    def total(self) -> int:
        return round(self.embedding + self.n_layers * self.per_layer + self.final_norm + self.output)

    @property
    def active(self) -> int:
        """Parameters one token uses (the published "active" count of an MoE model; total when dense)."""
        return self.total - self.inactive

    @property
    def matmul(self) -> int:
        """N in 6N: weights every token multiplies (the embedding lookup does no FLOPs; the output does)."""
        return self.n_layers * self.per_layer_matmul + self.output_matrix

    @property
    def output_matrix(self) -> int:
        """V·d: the output projection's size, tied or not."""
        return self.output or self.embedding


def count_params(model: ModelConfig) -> ParamCounts:
    d, hd = model.dim, model.head_dim
    attention = d * model.n_heads * hd * 2 + d * model.n_kv_heads * hd * 2  # wq, wo; wk, wv
    swiglu = 3 * d  # per unit of hidden width: w1, w3 (d→f) and w2 (f→d)
    # Per layer kind, not per layer: validation plans every spec, whatever its n_layers.
    moe_layers = model.moe_layer_count
    dense_ffn = (model.n_layers - moe_layers) * swiglu * model.ffn_dim
    ffn_total = ffn_active = dense_ffn
    routed = inactive = 0
    if moe_layers:
        moe, expert = model.moe, swiglu * model.expert_ffn_dim
        router = d * moe.n_experts
        ffn_total += moe_layers * (router + (moe.n_experts + moe.shared_experts) * expert)
        ffn_active += moe_layers * (router + (moe.top_k + moe.shared_experts) * expert)
        routed = moe_layers * moe.n_experts * expert
        inactive = moe_layers * (moe.n_experts - moe.top_k) * expert
    vocab = model.vocab_size * d
    return ParamCounts(
        embedding=vocab,
        per_layer=attention + 2 * d + ffn_total / model.n_layers,
        per_layer_matmul=attention + ffn_active / model.n_layers,
        n_layers=model.n_layers,
        final_norm=d,
        output=0 if model.tie_embeddings else vocab,
        routed=routed,
        inactive=inactive,
    )


def active_ffn_dim(model: ModelConfig) -> float:
    """SwiGLU hidden width one token goes through, averaged over blocks (top_k + shared experts in an
    MoE block): what its FFN matmuls and activations scale with."""
    moe_layers = model.moe_layer_count
    dense = (model.n_layers - moe_layers) * model.ffn_dim
    moe = (
        moe_layers * (model.moe.top_k + model.moe.shared_experts) * model.expert_ffn_dim if moe_layers else 0
    )
    return (dense + moe) / model.n_layers
