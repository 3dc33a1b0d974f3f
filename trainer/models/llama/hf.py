"""Llama's Hugging Face format: transformers' ``LlamaForCausalLM``, or ``MixtralForCausalLM`` with
``model.moe`` (``trainer/checkpoint/hf.py`` reads and writes the files).

RoPE layout. tessera rotates adjacent channel pairs (2i, 2i+1) of each head, as Meta's original Llama
code does; HF's Llama rotates halves (i, i + head_dim/2) ("rotate_half"). The two compute the same
attention when the rows of wq and wk are permuted within each head so that pair (2i, 2i+1) lands on
(i, i + head_dim/2): the permutation of transformers' ``convert_llama_weights_to_hf.py``. Export applies
it to q_proj and k_proj; import applies the inverse. Nothing else needs it: v, o and the MLP see no RoPE.

Mixture of experts. A model with ``model.moe`` exports as transformers' ``MixtralForCausalLM``: the
router is ``block_sparse_moe.gate``, and tessera's stacked experts ([E, d, h] weights, sharded over ep
in training and resharded by DCP on load) split into ``block_sparse_moe.experts.{j}.w1/w2/w3`` (gate,
down and up projections as [out, in] ``nn.Linear`` weights, hence transposed). Mixtral's router is
tessera's: softmax, top-k, weights renormalized over the k. Layers left dense by ``every_n_layers > 1``
keep Llama's ``mlp.*`` names; config.json then records that rule as ``decoder_sparse_step`` (Qwen2-MoE's
key for the same rule) and their width as ``dense_intermediate_size``, which transformers' Mixtral does
not read. Refused: shared experts (Mixtral has none, and a Mixtral loader would drop extra tensors with
only a warning, computing another model; no transformers architecture pairs Llama attention and this
router with an ungated shared expert) and ``balance: bias`` (the routing bias decides which experts a
token uses, and Mixtral has no place for it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trainer.config import ModelConfig
from trainer.failures import UserError

# tessera FQN -> HF name; "{}" is the layer index.
TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DENSE_MLP = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
ROUTER = {"feed_forward.router.gate.weight": "block_sparse_moe.gate.weight"}
# Stacked expert weights (x @ w[e]) -> Mixtral's per-expert nn.Linear names (w[e].T); "{}" is the expert.
EXPERTS = {
    "feed_forward.experts.w1": "block_sparse_moe.experts.{}.w1.weight",
    "feed_forward.experts.w3": "block_sparse_moe.experts.{}.w3.weight",
    "feed_forward.experts.w2": "block_sparse_moe.experts.{}.w2.weight",
}
# Config fields that must agree between a tessera model and an HF config.json.
CONFIG_FIELDS = {
    "n_layers": "num_hidden_layers",
    "dim": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Every tessera parameter FQN stored as one HF tensor, and that tensor's name (a tied head is the
    embedding: HF stores it once). Stacked experts are in :func:`expert_names`."""
    names = {fqn: hf for fqn, hf in TOP_LEVEL.items() if not (cfg.tie_embeddings and fqn == "output.weight")}
    for layer in range(cfg.n_layers):
        ffn = ROUTER if cfg.is_moe_layer(layer) else DENSE_MLP
        for fqn, hf in {**PER_LAYER, **ffn}.items():
            names[f"layers.{layer}.{fqn}"] = f"model.layers.{layer}.{hf}"
    return names


def expert_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """Each stacked expert weight's FQN and the HF names of its experts' slices, in expert order."""
    n_experts = cfg.moe.n_experts if cfg.moe else 0
    return {
        f"layers.{layer}.{fqn}": [f"model.layers.{layer}.{hf.format(e)}" for e in range(n_experts)]
        for layer in range(cfg.n_layers)
        if cfg.is_moe_layer(layer)
        for fqn, hf in EXPERTS.items()
    }


def pairs_to_halves(weight: Tensor, heads: int) -> Tensor:
    """Rows of a q/k projection from adjacent-pair RoPE order to HF's rotate-half order, per head."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_pairs(weight: Tensor, heads: int) -> Tensor:
    """The inverse of :func:`pairs_to_halves`."""
    rows, cols = weight.shape
    return weight.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_heads(fqn: str, cfg: ModelConfig) -> int | None:
    """Heads whose rows RoPE rotates in this parameter (q: n_heads, k: n_kv_heads), else None."""
    if fqn.endswith("attention.wq.weight"):
        return cfg.n_heads
    if fqn.endswith("attention.wk.weight"):
        return cfg.n_kv_heads
    return None


def to_hf(state: dict[str, Tensor], cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """tessera's model state dict as HF tensors (renamed, q/k permuted, experts split, cast, contiguous)."""
    out = {}
    for fqn, hf in hf_names(cfg).items():
        tensor, heads = state[fqn], _rope_heads(fqn, cfg)
        out[hf] = (pairs_to_halves(tensor, heads) if heads else tensor).to(dtype).contiguous()
    for fqn, names in expert_names(cfg).items():
        for hf, weight in zip(names, state[fqn].unbind(0), strict=True):
            out[hf] = weight.T.to(dtype).contiguous()
    return out


def from_hf(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF tensors as tessera's model state dict (a tied head shares the embedding tensor)."""
    out = {}
    for fqn, hf in hf_names(cfg).items():
        tensor, heads = state[hf], _rope_heads(fqn, cfg)
        out[fqn] = (halves_to_pairs(tensor, heads) if heads else tensor).contiguous()
    for fqn, names in expert_names(cfg).items():
        out[fqn] = torch.stack([state[hf].T for hf in names])
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def moe_config_fields(cfg: ModelConfig) -> dict[str, tuple[Any, str]]:
    """Mixtral's config.json keys for an MoE model: key -> (value, the spec field it comes from)."""
    if cfg.moe is None:
        return {}
    fields = {
        "num_local_experts": (cfg.moe.n_experts, "model.moe.n_experts"),
        "num_experts_per_tok": (cfg.moe.top_k, "model.moe.top_k"),
        "intermediate_size": (cfg.expert_ffn_dim, "model.moe.expert_ffn_dim"),  # Mixtral: one expert's width
    }
    if cfg.moe.every_n_layers > 1:
        fields["decoder_sparse_step"] = (cfg.moe.every_n_layers, "model.moe.every_n_layers")
        fields["dense_intermediate_size"] = (cfg.ffn_dim, "model.ffn_dim")
    return fields


def check_convertible(cfg: ModelConfig) -> None:
    """Refuse what Mixtral's format cannot hold (see the module docstring for why)."""
    if cfg.moe is not None and cfg.moe.shared_experts:
        raise UserError(
            f"model.moe.shared_experts={cfg.moe.shared_experts}: Mixtral has no shared experts; "
            "only models with shared_experts: 0 convert to Hugging Face"
        )
    if cfg.moe is None:
        return
    mixtral = {"score": "softmax", "normalize_weights": True, "routed_scale": 1.0, "first_dense_layers": 0}
    other = [
        f"model.moe.{name}={getattr(cfg.moe, name)}"
        for name, value in mixtral.items()
        if getattr(cfg.moe, name) != value
    ]
    if other:
        raise UserError(
            f"{', '.join(other)}: Mixtral's router is softmax top-k renormalised, unscaled, in every MoE layer; "
            f"set {', '.join(f'{name}: {value}' for name, value in mixtral.items())} to convert to Hugging Face"
        )


def check_exportable(cfg: ModelConfig) -> None:
    """Also refuse trained routing biases: an import starts them at zero, an export would drop them."""
    check_convertible(cfg)
    if cfg.moe is not None and cfg.moe.balance == "bias":
        raise UserError(
            "model.moe.balance='bias': its routing biases decide which experts each token uses and Mixtral "
            "has no place for them; only models trained with balance: aux_loss export"
        )


def hf_config(cfg: ModelConfig, max_seq_len: int, torch_dtype: str) -> dict[str, Any]:
    """config.json of transformers' LlamaConfig, or MixtralConfig for an MoE model (no RoPE scaling:
    tessera has none; no sliding window: tessera attends to the whole sequence)."""
    mixtral = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "router_aux_loss_coef": cfg.moe.aux_loss_coef if cfg.moe else 0.0,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
        **{hf: value for hf, (value, _) in moe_config_fields(cfg).items()},
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **{hf: getattr(cfg, field) for field, hf in CONFIG_FIELDS.items()},
        **(mixtral if cfg.moe else {"mlp_bias": False}),
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_seq_len,
        "attention_bias": False,
        "rope_scaling": None,
        "torch_dtype": torch_dtype,
    }


def check_hf_config(config: dict[str, Any], cfg: ModelConfig) -> None:
    """Refuse an HF model whose architecture differs from the spec's, naming each field."""
    expected = "mixtral" if cfg.moe else "llama"
    if config.get("model_type") != expected:
        raise UserError(
            f"config.json has model_type {config.get('model_type')!r} but the spec's model is {expected} "
            f"(model.moe is {'set' if cfg.moe else 'unset'}); only llama and mixtral import"
        )
    moe = moe_config_fields(cfg)
    wrong = [
        f"model.{field}={getattr(cfg, field)} but {hf}={config.get(hf)}"
        for field, hf in CONFIG_FIELDS.items()
        if hf not in moe and config.get(hf) != getattr(cfg, field)
    ]
    wrong += [
        f"{field}={value} but {hf}={config.get(hf, 1 if hf == 'decoder_sparse_step' else None)}"
        for hf, (value, field) in moe.items()
        if config.get(hf, 1 if hf == "decoder_sparse_step" else None) != value
    ]
    if config.get("head_dim", cfg.head_dim) != cfg.head_dim:
        wrong.append(f"model head_dim={cfg.head_dim} but head_dim={config['head_dim']}")
    if config.get("rope_scaling"):
        wrong.append(f"rope_scaling={config['rope_scaling']} but tessera's RoPE has no scaling")
    if wrong:
        raise UserError(f"the HF model is not the spec's model: {'; '.join(wrong)}; set these in the spec")
