"""Exact parameter counts of Llama (``model.py``), from the model config alone (no torch).

Bias-free projections (but for q/k/v biases with ``qkv_bias``), two RMSNorm gains per block (and
q/k norm gains of head_dim with ``qk_norm``), a final norm, an input embedding and an output
projection (one matrix when ``tie_embeddings``). An MoE layer's FFN is a router (d·E) plus E routed
and S shared SwiGLU experts; a token uses only top_k of the routed ones, so FLOPs count *active*
parameters (Mixtral 8×7B: 46.7B in all, 12.9B active).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.models import ParamCounts

if TYPE_CHECKING:
    from trainer.config import ModelConfig


def count_params(model: ModelConfig) -> ParamCounts:
    d, hd = model.dim, model.head_dim
    attention = d * model.n_heads * hd * 2 + d * model.n_kv_heads * hd * 2  # wq, wo; wk, wv
    # Added, not multiplied: biases (q, k, v outputs) and the q/k norms' gains.
    extras = (model.n_heads + 2 * model.n_kv_heads) * hd * model.qkv_bias + 2 * hd * model.qk_norm
    return decoder_counts(model, attention=attention, attention_gains=extras)


def decoder_counts(model: ModelConfig, attention: int, attention_gains: int = 0) -> ParamCounts:
    """The decoder's counts given one block's attention weights (Llama: wq, wo; wk, wv) and what else
    it holds that no token multiplies (biases, norm gains); a family built on this decoder (DeepSeek)
    passes its own attention's."""
    d = model.dim
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
        per_layer=attention + attention_gains + 2 * d + ffn_total / model.n_layers,
        per_layer_matmul=attention + ffn_active / model.n_layers,
        n_layers=model.n_layers,
        final_norm=d,
        output=0 if model.tie_embeddings else vocab,
        routed=routed,
        inactive=inactive,
    )
