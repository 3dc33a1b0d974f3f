"""DeepSeek-V2/V3 ``config.json`` files as ``model`` spec fields, for ``model.from_hf``: no torch here,
since spec validation runs it (``hf.py``, the weights' mapping, imports torch on use).

What tessera does not model is refused, never dropped: YaRN RoPE scaling (the released V3 extends its
context with it) and group-limited routing (V3 picks its top-k experts from the best 4 of 8 groups).
Training the released architecture without them from scratch is the ``deepseek-v3`` preset.
"""

from __future__ import annotations

from typing import Any

from trainer.failures import UserError

MODEL_TYPES = ("deepseek_v3", "deepseek_v2")


def _rope_theta(config: dict[str, Any]) -> float:
    """rope_theta at the top level (transformers 4) or inside rope_parameters (transformers 5)."""
    parameters = config.get("rope_parameters") or {}
    return float(config.get("rope_theta", parameters.get("rope_theta", 10000.0)))


def architecture(config: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` spec fields (preset deepseek-custom) of the dimensions and routing an HF DeepSeek-V2/V3
    ``config.json`` gives; what tessera does not model is not read here (see :func:`unmodelled`), nor is the
    multi-token-prediction module, which is not part of the trained model. Missing routing keys take
    transformers' defaults for the model type.
    """
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise UserError(
            f"config.json has model_type {kind!r}; the DeepSeek family reads {', '.join(MODEL_TYPES)}"
        )
    v3 = kind == "deepseek_v3"
    if config.get("moe_layer_freq", 1) != 1:
        raise UserError(
            f"config.json has moe_layer_freq={config['moe_layer_freq']}; tessera's DeepSeek takes MoE in every "
            "layer after first_k_dense_replace (moe_layer_freq 1)"
        )
    try:
        return {
            "preset": "deepseek-custom",
            "n_layers": config["num_hidden_layers"],
            "dim": config["hidden_size"],
            "n_heads": config["num_attention_heads"],
            "n_kv_heads": config["num_attention_heads"],  # MLA rebuilds keys and values for every head
            "ffn_dim": config["intermediate_size"],
            "vocab_size": config["vocab_size"],
            "rope_theta": _rope_theta(config),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "mla": {
                "q_lora_rank": config.get("q_lora_rank"),
                "kv_lora_rank": config["kv_lora_rank"],
                "qk_nope_head_dim": config["qk_nope_head_dim"],
                "qk_rope_head_dim": config["qk_rope_head_dim"],
                "v_head_dim": config["v_head_dim"],
            },
            "moe": {
                "n_experts": config["n_routed_experts"],
                "top_k": config["num_experts_per_tok"],
                "shared_experts": config.get("n_shared_experts") or 0,
                "expert_ffn_dim": config["moe_intermediate_size"],
                "first_dense_layers": config.get("first_k_dense_replace", 0),
                "score": config.get("scoring_func", "sigmoid" if v3 else "softmax"),
                "normalize_weights": bool(config.get("norm_topk_prob", v3)),
                "routed_scale": float(config.get("routed_scaling_factor", 1.0)),
                "balance": "bias"
                if config.get("topk_method", "noaux_tc" if v3 else "greedy") == "noaux_tc"
                else "aux_loss",
                "aux_loss_coef": float(config.get("aux_loss_alpha", 0.001)),
            },
        }
    except KeyError as missing:
        raise UserError(
            f"config.json of a {kind} model lacks {missing}; it is not a complete DeepSeek config"
        ) from None


def unmodelled(config: dict[str, Any]) -> list[str]:
    """What the HF model computes that tessera's DeepSeek does not, one phrase per config key."""
    found = []
    parameters = config.get("rope_parameters") or {}  # transformers 5 keeps the scaling here
    scaling = config.get("rope_scaling") or (
        parameters if parameters.get("rope_type", "default") != "default" else None
    )
    if scaling:
        found.append(f"rope_scaling={scaling} but tessera's RoPE has no scaling")
    groups = config.get("n_group") or 1
    if groups > 1 and (config.get("topk_group") or groups) < groups:
        found.append(
            f"n_group={groups}, topk_group={config.get('topk_group')}: group-limited routing, which tessera's "
            "router does not do (it picks the top-k of all experts)"
        )
    return found


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` spec fields of the model a DeepSeek ``config.json`` describes, refusing one tessera
    would compute differently (``model.from_hf``)."""
    if different := unmodelled(config):
        raise UserError(
            f"{'; '.join(different)}. tessera would train a different model: remove these keys from a copy "
            "of the config.json to train the architecture without them, or use model.preset: deepseek-v3 "
            "(the released V3 without them)"
        )
    return architecture(config)
