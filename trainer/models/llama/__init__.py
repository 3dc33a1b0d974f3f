"""Llama: the decoder of ``model.py`` (RMSNorm, RoPE, grouped-query attention, SwiGLU), dense or with
mixture-of-experts feed-forward layers (Mixtral-style, ``trainer/models/moe.py``).

Presets are the published Llama 3 / 3.1 architectures (Dubey et al. 2024, Table 3, and the released
params.json files) and Mixtral 8x7B; tiny/small are ours, sized to train on a laptop CPU. The module,
its parallelize plan and its HF mapping are imported on use: spec validation reads this file, and
must not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.models import HFMapping, ModelFamily, register
from trainer.models.llama.params import count_params

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.config import ModelConfig, ParallelConfig

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        n_layers=2, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=2048, rope_theta=10000.0
    ),
    "small": dict(
        n_layers=8, dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1408, vocab_size=8192, rope_theta=10000.0
    ),
    "tiny-moe": dict(
        n_layers=2,
        dim=128,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        vocab_size=2048,
        rope_theta=10000.0,
        moe=dict(n_experts=8, top_k=2, shared_experts=1),
    ),
    "llama3-8b": dict(
        n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, rope_theta=500000.0
    ),
    "llama3-70b": dict(
        n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256, rope_theta=500000.0
    ),
    "llama3-405b": dict(
        n_layers=126,
        dim=16384,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    # Mixtral 8x7B (Jiang et al. 2024; the released config.json): Mistral 7B's attention, 8 SwiGLU experts.
    "mixtral-8x7b": dict(
        n_layers=32,
        dim=4096,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32000,
        rope_theta=1e6,
        moe=dict(n_experts=8, top_k=2),
    ),
}


# config.json model types ``model.from_hf`` builds as Llama (``hf_config.py`` maps and refuses their keys).
HF_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3")


def check(cfg: ModelConfig) -> None:
    if cfg.mla is not None:
        raise ValueError(
            f"model.mla (multi-head latent attention) is DeepSeek's; preset {cfg.preset!r} is a Llama: "
            "remove model.mla or pick a DeepSeek preset (tiny-deepseek, deepseek-custom, ...)"
        )
    if cfg.dim % cfg.n_heads and "head_dim" not in cfg.model_fields_set:
        raise ValueError(
            f"model.dim={cfg.dim} must be divisible by model.n_heads={cfg.n_heads}, or set model.head_dim"
        )
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(
            f"model.n_heads={cfg.n_heads} must be a multiple of model.n_kv_heads={cfg.n_kv_heads}"
        )
    if cfg.head_dim % 2:
        raise ValueError(f"head dim (model.head_dim, or dim/n_heads)={cfg.head_dim} must be even for RoPE")


def build_model(cfg: ModelConfig, max_seq_len: int) -> nn.Module:
    from trainer.models.llama.model import Transformer

    return Transformer(cfg, max_seq_len)


def parallelize_model(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig) -> nn.Module:
    from trainer.models.llama.parallelize import parallelize

    return parallelize(model, mesh, cfg)


def load_hf() -> HFMapping:
    from trainer.models.llama import hf

    return hf


LLAMA = register(
    ModelFamily(
        name="llama",
        presets=PRESETS,
        check=check,
        build=build_model,
        count_params=count_params,
        parallelize=parallelize_model,
        hf=load_hf,
        hf_model_types=HF_MODEL_TYPES,
    )
)
