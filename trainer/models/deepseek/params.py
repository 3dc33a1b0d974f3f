"""Exact parameter counts of the DeepSeek decoder (``model.py``), from the model config alone (no torch).

A block is MLA (:func:`attention_params`) plus two RMSNorm gains plus a dense SwiGLU (the first
``moe.first_dense_layers`` layers) or an MoE layer (router, routed and shared SwiGLU experts), the
embedding and head as Llama's: ``trainer/models/llama/params.py`` counts all but the attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.models import ParamCounts
from trainer.models.llama.params import decoder_counts

if TYPE_CHECKING:
    from trainer.config import ModelConfig


def attention_params(model: ModelConfig) -> tuple[int, int]:
    """(matmul weights, norm gains) of one MLA layer: query (plain or low rank), the key/value latent
    with the shared RoPE key, the per-head key/value up-projection, and the output."""
    mla, d, heads = model.mla, model.dim, model.n_heads
    if mla.q_lora_rank is None:
        query, gains = d * heads * mla.qk_head_dim, 0
    else:
        query, gains = mla.q_lora_rank * (d + heads * mla.qk_head_dim), mla.q_lora_rank
    latent = d * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    up = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    out = heads * mla.v_head_dim * d
    return query + latent + up + out, gains + mla.kv_lora_rank


def count_params(model: ModelConfig) -> ParamCounts:
    matmul, gains = attention_params(model)
    return decoder_counts(model, attention=matmul, attention_gains=gains)
