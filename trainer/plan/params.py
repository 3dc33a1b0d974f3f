"""Parameter counts for the planner, from the model config alone: each family counts its own
(``trainer/models/<family>/``); ``active_ffn_dim`` is the SwiGLU width the planner's block model uses.
"""

from __future__ import annotations

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
