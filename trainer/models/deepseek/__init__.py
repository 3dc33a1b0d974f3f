"""DeepSeek-V2/V3: multi-head latent attention (``model.py``) and DeepSeekMoE (routed plus shared
experts after the first dense layers; sigmoid scores and auxiliary-loss-free bias balancing for V3).

Presets: ``tiny-deepseek`` (ours, trains on a laptop CPU in seconds), the published DeepSeek-V2-Lite and
DeepSeek-V3 (main model, without the multi-token-prediction module), and ``deepseek-custom``: every
dimension given, for a DeepSeek model of your own or one read from a Hugging Face config.json.

Left out, with why:
- node-limited (group) routing, V3's n_group=8 / topk_group=4: it bounds how many nodes a token's
  experts span, a dispatch-traffic limit for expert parallelism across nodes; tokens here pick their
  top-k over all experts. An imported V3 then routes a few tokens to other experts than V3 would.
- YaRN RoPE scaling (rope_scaling in the released configs): context extension after pre-training;
  tessera's RoPE has none, so training starts at the base rope_theta.
- multi-token prediction (V3's MTP module, 11.5B parameters): an extra training objective.
- tensor and context parallelism (``check_layout``): MLA has no TP plan or ring attention here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.models import HFMapping, ModelFamily, register
from trainer.models.deepseek.hf_config import MODEL_TYPES
from trainer.models.deepseek.params import count_params

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.config import ModelConfig, ParallelConfig

CUSTOM = "deepseek-custom"
PRESETS: dict[str, dict[str, Any]] = {
    # 1 dense + 3 MoE layers, V3's routing (sigmoid, normalised, scaled, bias-balanced) and both query
    # forms' widths small; v_head_dim != nope + rope, so the padded-value path always runs.
    "tiny-deepseek": dict(
        n_layers=4,
        dim=128,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=384,
        vocab_size=2048,
        rope_theta=10000.0,
        mla=dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
        moe=dict(
            n_experts=8,
            top_k=2,
            shared_experts=1,
            expert_ffn_dim=64,
            first_dense_layers=1,
            score="sigmoid",
            routed_scale=2.5,
            balance="bias",
        ),
    ),
    # DeepSeek-V2-Lite: 15.7B total, 2.4B active (DeepSeek-AI 2024, arXiv:2405.04434, Appendix B). Values
    # from the released config.json (huggingface.co/deepseek-ai/DeepSeek-V2-Lite, model_type deepseek_v2):
    # num_hidden_layers 27, hidden_size 2048, num_attention_heads 16, intermediate_size 10944,
    # vocab_size 102400, q_lora_rank null, kv_lora_rank 512, qk_nope/rope_head_dim 128/64, v_head_dim
    # 128, n_routed_experts 64, num_experts_per_tok 6, n_shared_experts 2, moe_intermediate_size 1408,
    # first_k_dense_replace 1, scoring_func softmax, norm_topk_prob false, routed_scaling_factor 1.0,
    # aux_loss_alpha 0.001, rms_norm_eps 1e-6, rope_theta 10000.
    "deepseek-v2-lite": dict(
        n_layers=27,
        dim=2048,
        n_heads=16,
        n_kv_heads=16,
        ffn_dim=10944,
        vocab_size=102400,
        rope_theta=10000.0,
        norm_eps=1e-6,
        mla=dict(
            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
        moe=dict(
            n_experts=64,
            top_k=6,
            shared_experts=2,
            expert_ffn_dim=1408,
            first_dense_layers=1,
            normalize_weights=False,
            aux_loss_coef=0.001,
        ),
    ),
    # DeepSeek-V3: 671B total, 37B active (DeepSeek-AI 2024, arXiv:2412.19437, §4.2; the repository's
    # README_WEIGHTS.md: 36.6B activated including the 0.9B output head, MTP module excluded). Values from
    # the released config.json (huggingface.co/deepseek-ai/DeepSeek-V3, model_type deepseek_v3):
    # num_hidden_layers 61, hidden_size 7168, num_attention_heads 128, intermediate_size 18432,
    # vocab_size 129280, q_lora_rank 1536, kv_lora_rank 512, qk_nope/rope_head_dim 128/64, v_head_dim
    # 128, n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, moe_intermediate_size 2048,
    # first_k_dense_replace 3, scoring_func sigmoid, norm_topk_prob true, routed_scaling_factor 2.5,
    # topk_method noaux_tc (the bias), rms_norm_eps 1e-6, rope_theta 10000. Balance loss α = 1e-4 and
    # bias speed γ = 0.001 from the paper (§4.2).
    "deepseek-v3": dict(
        n_layers=61,
        dim=7168,
        n_heads=128,
        n_kv_heads=128,
        ffn_dim=18432,
        vocab_size=129280,
        rope_theta=10000.0,
        norm_eps=1e-6,
        mla=dict(
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
        moe=dict(
            n_experts=256,
            top_k=8,
            shared_experts=1,
            expert_ffn_dim=2048,
            first_dense_layers=3,
            score="sigmoid",
            routed_scale=2.5,
            balance="bias",
            aux_loss_coef=1e-4,
            bias_update_rate=0.001,
        ),
    ),
    CUSTOM: {},  # every dimension from the spec (or from an HF config.json: hf_config.model_fields)
}


def check(cfg: ModelConfig) -> None:
    if cfg.mla is None:
        raise ValueError(
            f"model.preset={cfg.preset} is a DeepSeek model and needs model.mla (kv_lora_rank, "
            "qk_nope_head_dim, qk_rope_head_dim, v_head_dim; q_lora_rank optional)"
        )
    if cfg.n_kv_heads != cfg.n_heads:
        raise ValueError(
            f"model.n_kv_heads={cfg.n_kv_heads} must equal model.n_heads={cfg.n_heads}: MLA rebuilds keys "
            "and values for every head from one latent (no grouped heads); set them equal"
        )
    if cfg.mla.qk_rope_head_dim % 2:
        raise ValueError(f"model.mla.qk_rope_head_dim={cfg.mla.qk_rope_head_dim} must be even for RoPE")
    llama_only = [name for name in ("qkv_bias", "qk_norm", "rope_scaling") if getattr(cfg, name)]
    if "head_dim" in cfg.model_fields_set:
        llama_only.append("head_dim")
    if llama_only:
        raise ValueError(
            f"model.{', model.'.join(llama_only)}: options of the Llama family's attention, which MLA does not "
            "have (its widths are model.mla's); remove them"
        )


def check_layout(cfg: ModelConfig, parallel: ParallelConfig) -> list[str]:
    """What the family does not parallelize: no TP plan and no ring attention for MLA."""
    errors = []
    if parallel.tp > 1:
        errors.append(
            f"parallel.tp={parallel.tp}: the DeepSeek family has no tensor-parallel plan (MLA's latent "
            "projections); set parallel.tp=1 and split the model with parallel.dp_shard, ep or pp"
        )
    if parallel.cp > 1:
        errors.append(
            f"parallel.cp={parallel.cp}: the DeepSeek family has no ring attention for MLA; set "
            "parallel.cp=1 (shorter train.seq_len or more parallel.dp_shard to fit memory)"
        )
    return errors


def build_model(cfg: ModelConfig, max_seq_len: int) -> nn.Module:
    from trainer.models.deepseek.model import DeepSeekTransformer

    return DeepSeekTransformer(cfg, max_seq_len)


def parallelize_model(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig) -> nn.Module:
    """Llama's plan (EP, fp8, AC, FSDP or DDP) without its TP and CP steps, which check_layout refuses."""
    from trainer.models.llama.parallelize import parallelize

    if cfg.tp > 1 or cfg.cp > 1:
        raise ValueError("; ".join(check_layout(model.cfg, cfg)))
    return parallelize(model, mesh, cfg)


def load_hf() -> HFMapping:
    from trainer.models.deepseek import hf

    return hf


DEEPSEEK = register(
    ModelFamily(
        name="deepseek",
        presets=PRESETS,
        check=check,
        build=build_model,
        count_params=count_params,
        parallelize=parallelize_model,
        hf=load_hf,
        check_layout=check_layout,
        hf_model_types=MODEL_TYPES,
    )
)
