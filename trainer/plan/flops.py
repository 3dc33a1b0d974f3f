"""Training FLOPs: model FLOPs for MFU, hardware FLOPs (with recomputation) for step time.

Definition (PaLM, Chowdhery et al. 2022, Appendix B): model FLOPs per token = 6N + 12·L·s·d, where
N counts the weights every token multiplies (all projections and the output layer; not the
embedding lookup or norm gains) and 12·L·s·d is the attention score/value matmuls forward and
backward over the full s×s square (6·L·s·H·(d_qk + d_v) in general: MLA's query/key heads are wider
than its value heads, ``attention_shape``) — causal masking is not discounted, as in PaLM and Megatron, and
neither is document masking (model.attention=document), so MFU stays comparable across the two.
MFU uses model FLOPs only, so recomputation never inflates it; hardware FLOPs add the recomputed
forward passes (2N' + 4·L·s·d per recomputed part), which is what Megatron-LM's 96·B·s·l·h² formula
(Narayanan et al. 2021, full recomputation) counts.
"""

from __future__ import annotations

from trainer.plan.layout import Geometry
from trainer.plan.params import attention_shape


def model_flops_per_token(geo: Geometry) -> float:
    model = geo.model
    attention = 6 * model.n_layers * geo.train.seq_len * attention_shape(model).useful_width
    return 6 * geo.counts.matmul + attention


def recompute_flops_per_token(geo: Geometry) -> float:
    """Extra forward FLOPs per token from activation checkpointing.

    full re-runs each block's forward (2N_layer + 4sd); selective keeps matmul and attention outputs
    and recomputes only element-wise ops, whose FLOPs are negligible.
    """
    if geo.parallel.activation_checkpointing != "full":
        return 0.0
    model, width = geo.model, attention_shape(geo.model).useful_width
    return model.n_layers * (2 * geo.train.seq_len * width + 2 * geo.counts.per_layer_matmul)


def tokens_per_step(geo: Geometry) -> int:
    return geo.train.global_batch_size * geo.train.seq_len
