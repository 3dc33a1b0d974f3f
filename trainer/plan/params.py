"""Parameter counts for the planner, from the model config alone: each family counts its own
(``trainer/models/<family>/``); ``active_ffn_dim`` is the SwiGLU width the planner's block model uses,
``attention_shape`` the attention's (grouped-query, or DeepSeek's multi-head latent attention).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ModelConfig
from trainer.models import ParamCounts, family_of


def count_params(model: ModelConfig) -> ParamCounts:
    return family_of(model).count_params(model)


def active_ffn_dim(model: ModelConfig) -> float:
    """SwiGLU hidden width one token goes through, averaged over blocks (top_k + shared experts in an
    MoE block): what its FFN matmuls and activations scale with."""
    moe_layers = model.moe_layer_count
    dense = (model.n_layers - moe_layers) * model.ffn_dim
    moe = (
        moe_layers * (model.moe.top_k + model.moe.shared_experts) * model.expert_ffn_dim if moe_layers else 0
    )
    return (dense + moe) / model.n_layers


@dataclass(frozen=True)
class AttentionShape:
    """One block's attention as the planner prices it, per token (widths in elements).

    projections: (out, in, row_parallel) of each matmul in forward order; TP splits out (column) or in
    (row). score_width: heads·(query/key width) that SDPA's kernel computes with (MLA's values are
    padded to it). useful_width: heads·(qk + v), what model FLOPs count (Llama: 2d). saved / saved_fp32:
    what attention keeps for backward beyond the block's norm, in compute dtype and in fp32;
    saved_in_fp32_only: what it keeps only when the compute dtype is fp32 (an fp32 norm input that is a
    view of a wider tensor keeps all of it). rope_width: query and key channels RoPE rotates.
    """

    projections: tuple[tuple[int, int, bool], ...]
    score_width: int
    useful_width: int
    saved: int
    saved_fp32: int
    rope_width: int
    saved_in_fp32_only: int = 0


def attention_shape(model: ModelConfig) -> AttentionShape:
    """Grouped-query attention (Llama), or multi-head latent attention (``model.mla``, DeepSeek)."""
    d, heads = model.dim, model.n_heads
    if model.mla is None:
        q, kv = heads * model.head_dim, model.n_kv_heads * model.head_dim
        # SDPA saves q, k, v and its output (the wo input).
        return AttentionShape(
            ((q, d, False), (kv, d, False), (kv, d, False), (d, q, True)),
            score_width=q,
            useful_width=2 * q,
            saved=2 * q + 2 * kv,
            saved_fp32=0,
            rope_width=q + kv,
        )
    mla = model.mla
    qk, v, rope = heads * mla.qk_head_dim, heads * mla.v_head_dim, mla.qk_rope_head_dim
    q_rank, kv_rank = mla.q_lora_rank, mla.kv_lora_rank
    query = ((qk, d, False),) if q_rank is None else ((q_rank, d, False), (qk, q_rank, False))
    latent = ((kv_rank + rope, d, False), (heads * (mla.qk_nope_head_dim + mla.v_head_dim), kv_rank, False))
    norms = kv_rank + (q_rank or 0)
    # SDPA saves q, k, the padded v and its padded output and log-sum-exp; wo saves the sliced output.
    # Each latent RMSNorm saves its fp32 input, normalised copy and rstd, and the up-projection after it
    # its output (counted on tiny shapes, tests/test_deepseek.py). In fp32 the KV norm's input is a view
    # of wkv_a's whole output, so its RoPE columns stay too.
    return AttentionShape(
        (*query, *latent, (d, v, True)),
        score_width=qk,
        useful_width=qk + v,
        saved=4 * qk + v + norms,
        saved_fp32=2 * norms + (1 if q_rank is None else 2),
        rope_width=heads * rope + rope,
        saved_in_fp32_only=rope,
    )
