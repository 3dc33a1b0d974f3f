"""DeepSeek's Hugging Face format: transformers' ``DeepseekV3ForCausalLM`` (sigmoid router scores) or
``DeepseekV2ForCausalLM`` (softmax scores), the released checkpoints' names and config.json keys.

Names only, no permutation: tessera's MLA keeps the released shapes and splits (``model.py``), and its
RoPE rotates adjacent channel pairs as DeepSeek's own code does (transformers' ``rope_interleave``).
Stacked experts ([E, d, h]) split into ``mlp.experts.{j}.gate_proj/up_proj/down_proj`` ([out, in]
``nn.Linear`` weights, hence transposed); the shared experts are ``mlp.shared_experts`` (one SwiGLU
``n_shared_experts`` experts wide, as in transformers); the router is ``mlp.gate``, and the
auxiliary-loss-free routing bias is V3's ``mlp.gate.e_score_correction_bias`` (zeros when trained
without it: the same routing).

Refused, because the HF model would compute something else: MoE every n-th layer (transformers' rule
is ``layer % moe_layer_freq == 0``, tessera's the last of every n), a model without MoE, a bias with
softmax scores (V2 has no place for it), and on import or ``model.from_hf`` group-limited routing
(n_group, topk_group) and RoPE scaling (YaRN), which tessera does not model (``hf_config.py`` reads
config.json files, without torch: spec validation runs it; this module imports torch on use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.config import ModelConfig
from trainer.failures import UserError
from trainer.models.deepseek.hf_config import (  # noqa: F401 (model_fields: this mapping's, for from_hf)
    architecture,
    model_fields,
    unmodelled,
)

if TYPE_CHECKING:
    import torch
    from torch import Tensor

TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
PER_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
PLAIN_QUERY = {"attention.wq.weight": "self_attn.q_proj.weight"}
LOW_RANK_QUERY = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
}
SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
DENSE_MLP = {f"feed_forward.{w}.weight": f"mlp.{hf}.weight" for w, hf in SWIGLU.items()}
SHARED = {f"feed_forward.shared.{w}.weight": f"mlp.shared_experts.{hf}.weight" for w, hf in SWIGLU.items()}
ROUTER = {"feed_forward.router.gate.weight": "mlp.gate.weight"}
BIAS = {"feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias"}
EXPERTS = {f"feed_forward.experts.{w}": f"mlp.experts.{{}}.{hf}.weight" for w, hf in SWIGLU.items()}


def model_type(cfg: ModelConfig) -> str:
    return "deepseek_v3" if cfg.moe.score == "sigmoid" else "deepseek_v2"


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Every tessera FQN (parameters, and the routing bias) stored as one HF tensor, and its HF name."""
    names = {fqn: hf for fqn, hf in TOP_LEVEL.items() if not (cfg.tie_embeddings and fqn == "output.weight")}
    query = PLAIN_QUERY if cfg.mla.q_lora_rank is None else LOW_RANK_QUERY
    for layer in range(cfg.n_layers):
        ffn = DENSE_MLP
        if cfg.is_moe_layer(layer):
            ffn = {**ROUTER, **(SHARED if cfg.moe.shared_experts else {})}
            ffn |= BIAS if model_type(cfg) == "deepseek_v3" else {}
        for fqn, hf in {**PER_LAYER, **query, **ffn}.items():
            names[f"layers.{layer}.{fqn}"] = f"model.layers.{layer}.{hf}"
    return names


def expert_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """Each stacked expert weight's FQN and the HF names of its experts' slices, in expert order."""
    return {
        f"layers.{layer}.{fqn}": [f"model.layers.{layer}.{hf.format(e)}" for e in range(cfg.moe.n_experts)]
        for layer in range(cfg.n_layers)
        if cfg.is_moe_layer(layer)
        for fqn, hf in EXPERTS.items()
    }


def to_hf(state: dict[str, Tensor], cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """tessera's model state dict as HF tensors. A model trained without the routing bias exports
    V3's as zeros (the same routing); the bias stays fp32, as DeepSeek ships it."""
    import torch

    out = {}
    for fqn, hf in hf_names(cfg).items():
        tensor = state.get(fqn)
        if fqn.endswith("router.expert_bias"):
            out[hf] = (tensor if tensor is not None else torch.zeros(cfg.moe.n_experts)).float().contiguous()
        else:
            out[hf] = tensor.to(dtype).contiguous()
    for fqn, names in expert_names(cfg).items():
        for hf, weight in zip(names, state[fqn].unbind(0), strict=True):
            out[hf] = weight.T.to(dtype).contiguous()
    return out


def from_hf(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF tensors as tessera's model state dict (a V3 routing bias only where balance is bias)."""
    import torch

    biased = cfg.moe.balance == "bias"
    out = {
        fqn: state[hf].contiguous()
        for fqn, hf in hf_names(cfg).items()
        if biased or not fqn.endswith("router.expert_bias")
    }
    for fqn, names in expert_names(cfg).items():
        out[fqn] = torch.stack([state[hf].T for hf in names])
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def check_convertible(cfg: ModelConfig) -> None:
    """Refuse what transformers' DeepSeek models cannot hold (see the module docstring)."""
    if cfg.moe is None:
        raise UserError(
            "model.moe is unset: transformers' DeepSeek models always have experts; set model.moe"
        )
    if cfg.moe.every_n_layers != 1:
        raise UserError(
            f"model.moe.every_n_layers={cfg.moe.every_n_layers}: DeepSeek's format makes every layer after "
            "first_dense_layers MoE; set every_n_layers: 1"
        )
    if cfg.moe.balance == "bias" and cfg.moe.score == "softmax":
        raise UserError(
            "model.moe.balance='bias' with score='softmax': DeepSeek-V2's format has no routing bias; set "
            "score: sigmoid (DeepSeek-V3's format) or balance: aux_loss"
        )


def check_exportable(cfg: ModelConfig) -> None:
    check_convertible(cfg)


def hf_config(cfg: ModelConfig, max_seq_len: int, torch_dtype: str) -> dict[str, Any]:
    """config.json of transformers' DeepseekV3Config / DeepseekV2Config: every layer's top-k over all
    experts (one group), no RoPE scaling, no multi-token prediction."""
    kind = model_type(cfg)
    mla, moe = cfg.mla, cfg.moe
    return {
        "architectures": ["DeepseekV3ForCausalLM" if kind == "deepseek_v3" else "DeepseekV2ForCausalLM"],
        "model_type": kind,
        "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.dim,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "head_dim": mla.qk_rope_head_dim,  # transformers' DeepSeek: the rotary width
        "rope_interleave": True,
        "n_routed_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.shared_experts,
        "moe_intermediate_size": cfg.expert_ffn_dim,
        "first_k_dense_replace": moe.first_dense_layers,
        "moe_layer_freq": 1,
        "scoring_func": moe.score,
        "norm_topk_prob": moe.normalize_weights,
        "routed_scaling_factor": moe.routed_scale,
        "topk_method": "noaux_tc" if kind == "deepseek_v3" else "greedy",
        "n_group": 1,
        "topk_group": 1,
        "aux_loss_alpha": moe.aux_loss_coef,
        "seq_aux": True,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "max_position_embeddings": max_seq_len,
        "attention_bias": False,
        "rope_scaling": None,
        "torch_dtype": torch_dtype,
    }


def check_hf_config(config: dict[str, Any], cfg: ModelConfig) -> None:
    """Refuse an HF model whose architecture differs from the spec's, naming each field."""
    if config.get("model_type") != model_type(cfg):
        raise UserError(
            f"config.json has model_type {config.get('model_type')!r} but the spec's model is "
            f"{model_type(cfg)} (model.moe.score={cfg.moe.score}); set the spec's score to match"
        )
    theirs = architecture(config)
    ours = cfg.model_dump()
    wrong = [
        f"model.{name}={ours[name]} but config.json gives {value}"
        for name, value in theirs.items()
        if name not in ("preset", "mla", "moe") and ours[name] != value
    ]
    for section in ("mla", "moe"):
        wrong += [
            f"model.{section}.{name}={ours[section][name]} but config.json gives {value}"
            for name, value in theirs[section].items()
            if name != "aux_loss_coef" and ours[section][name] != value  # a training knob, not the model
        ]
    wrong += unmodelled(config)
    if wrong:
        raise UserError(f"the HF model is not the spec's model: {'; '.join(wrong)}; set these in the spec")
