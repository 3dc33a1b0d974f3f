"""Exact parameter counts of our Llama-style decoder, from the model config alone (no torch).

Mirrors ``trainer/model.py``: bias-free projections, two RMSNorm gains per block, a final norm, an
input embedding and an output projection (one matrix when ``tie_embeddings``).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by where they live; pipeline stages and FLOP counts need the split, not just the sum."""

    embedding: int  # input table V·d (shared with the output projection when tied)
    per_layer: int
    per_layer_matmul: int  # per_layer minus the norm gains: the weights that do matmul FLOPs
    n_layers: int
    final_norm: int
    output: int  # V·d, or 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.embedding + self.n_layers * self.per_layer + self.final_norm + self.output

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
    feed_forward = 3 * d * model.ffn_dim  # SwiGLU: w1, w3 (d→f) and w2 (f→d)
    matmul = attention + feed_forward
    vocab = model.vocab_size * d
    return ParamCounts(
        embedding=vocab,
        per_layer=matmul + 2 * d,
        per_layer_matmul=matmul,
        n_layers=model.n_layers,
        final_norm=d,
        output=0 if model.tie_embeddings else vocab,
    )
