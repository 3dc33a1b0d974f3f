"""Llama's Hugging Face format: transformers' ``LlamaForCausalLM``; ``MixtralForCausalLM`` with
``model.moe``; ``Qwen2ForCausalLM`` with ``model.qkv_bias``; ``Qwen3ForCausalLM`` with ``model.qk_norm``
(``trainer/checkpoint/hf.py`` reads and writes the files; ``hf_config.py`` is the config.json side).

RoPE layout. tessera rotates adjacent channel pairs (2i, 2i+1) of each head, as Meta's original Llama
code does; HF's Llama rotates halves (i, i + head_dim/2) ("rotate_half"). The two compute the same
attention when the rows of wq and wk are permuted within each head so that pair (2i, 2i+1) lands on
(i, i + head_dim/2): the permutation of transformers' ``convert_llama_weights_to_hf.py``. Export applies
it to q_proj and k_proj; import applies the inverse. The same order holds for what acts on those
channels: Qwen2's q/k biases and Qwen3's q/k norm gains (one head_dim vector, applied before RoPE) move
with them. Nothing else needs it: v, o and the MLP see no RoPE.

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

from typing import TYPE_CHECKING

from trainer.failures import UserError

# The config.json side, part of this mapping too (``HFMapping``); torch-free, as spec validation uses it.
from trainer.models.llama.hf_config import (  # noqa: F401
    check_convertible,
    check_hf_config,
    hf_config,
    model_fields,
)

if TYPE_CHECKING:  # imported on use: model_fields runs at spec validation, which stays torch-free
    import torch
    from torch import Tensor

    from trainer.config import ModelConfig

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
QKV_BIAS = {  # model.qkv_bias: Qwen2's
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
}
QK_NORM = {  # model.qk_norm: Qwen3's
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
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


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Every tessera parameter FQN stored as one HF tensor, and that tensor's name (a tied head is the
    embedding: HF stores it once). Stacked experts are in :func:`expert_names`."""
    names = {fqn: hf for fqn, hf in TOP_LEVEL.items() if not (cfg.tie_embeddings and fqn == "output.weight")}
    attention = {**PER_LAYER, **(QKV_BIAS if cfg.qkv_bias else {}), **(QK_NORM if cfg.qk_norm else {})}
    for layer in range(cfg.n_layers):
        ffn = ROUTER if cfg.is_moe_layer(layer) else DENSE_MLP
        for fqn, hf in {**attention, **ffn}.items():
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
    """Rows of a q/k projection (or entries of its bias, or of a q/k norm's gains: one head) from
    adjacent-pair RoPE order to HF's rotate-half order, per head."""
    rows, cols = weight.shape[0], weight[0].numel()
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(weight.shape)


def halves_to_pairs(weight: Tensor, heads: int) -> Tensor:
    """The inverse of :func:`pairs_to_halves`."""
    rows, cols = weight.shape[0], weight[0].numel()
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(weight.shape)


def _rope_heads(fqn: str, cfg: ModelConfig) -> int | None:
    """Heads whose channels RoPE rotates in this parameter (q: n_heads, k: n_kv_heads, the q/k norms'
    gains: one head's), else None. The norms act before RoPE, on channels in the same order as q/k."""
    if fqn.endswith(("attention.wq.weight", "attention.wq.bias")):
        return cfg.n_heads
    if fqn.endswith(("attention.wk.weight", "attention.wk.bias")):
        return cfg.n_kv_heads
    if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
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
    import torch  # here, not above: this module is loaded by spec validation (model_fields)

    out = {}
    for fqn, hf in hf_names(cfg).items():
        tensor, heads = state[hf], _rope_heads(fqn, cfg)
        out[fqn] = (halves_to_pairs(tensor, heads) if heads else tensor).contiguous()
    for fqn, names in expert_names(cfg).items():
        out[fqn] = torch.stack([state[hf].T for hf in names])
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def check_exportable(cfg: ModelConfig) -> None:
    """Also refuse trained routing biases: an import starts them at zero, an export would drop them."""
    check_convertible(cfg)
    if cfg.moe is not None and cfg.moe.balance == "bias":
        raise UserError(
            "model.moe.balance='bias': its routing biases decide which experts each token uses and Mixtral "
            "has no place for them; only models trained with balance: aux_loss export"
        )
