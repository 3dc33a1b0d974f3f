"""Llama's ``config.json``: what an export writes, what an import checks, what ``model.from_hf`` builds.

One tessera Llama is one of five transformers architectures, by its features:

| tessera model                         | model_type (architecture)                       |
|---------------------------------------|-------------------------------------------------|
| dense                                 | ``llama`` (read: ``mistral`` too, the same model) |
| ``model.moe``                         | ``mixtral``                                     |
| ``model.qkv_bias``                    | ``qwen2`` (biases on q, k and v; none on o)     |
| ``model.qk_norm`` (often ``head_dim``) | ``qwen3`` (RMSNorm of each q and k head)        |

Keys a config.json may leave out take transformers' defaults for its model type. Whatever would build
a different model than the file describes is refused, naming the key: another activation than SiLU,
biases on o_proj or the MLP (``attention_bias``, ``mlp_bias``), RoPE scaled otherwise than Llama 3.1's,
sliding-window attention, and MoE or feature combinations no architecture above holds. No torch here:
spec validation calls :func:`model_fields`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.failures import UserError

if TYPE_CHECKING:
    from trainer.config import ModelConfig

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
    "head_dim": "head_dim",
}
# transformers' defaults (its configuration_<type>.py) for keys a config.json may omit; None: derived
# (num_key_value_heads: num_attention_heads; head_dim: hidden_size / num_attention_heads).
OPTIONAL_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "rms_norm_eps": 1e-6},
    "mixtral": {"num_key_value_heads": 8, "head_dim": None, "rms_norm_eps": 1e-5},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "rms_norm_eps": 1e-6},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6},
}
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
FEATURES = {"qwen2": "qkv_bias", "qwen3": "qk_norm"}


def hf_model_type(cfg: ModelConfig) -> str:
    """The transformers architecture that holds this model (see the module docstring)."""
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mixtral" if cfg.moe else "llama"


def _count(config: dict[str, Any], key: str, default: Any = None) -> int:
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r} in config.json is not a positive integer")
    return value


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{key}={value!r} in config.json is not a positive number")
    return float(value)


def _flag(config: dict[str, Any], key: str) -> bool:
    value = config.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} in config.json is not true or false")
    return value


LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE's base and scaling: ``rope_theta`` and ``rope_scaling`` (transformers 4), or
    ``rope_parameters`` (transformers 5). Llama 3.1's scaling (``llama3``) is tessera's
    ``model.rope_scaling``; any other is refused, since tessera would compute another model."""
    parameters = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        theta, key = parameters["rope_theta"], "rope_parameters.rope_theta"
        scaling = scaling or parameters
    elif "rope_theta" in config:
        theta, key = config["rope_theta"], "rope_theta"
    else:
        raise ValueError("config.json gives no rope_theta (nor rope_parameters.rope_theta); add RoPE's base")
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
    if kind in (None, "default"):
        return _number(key, theta), None
    if kind != "llama3":
        raise ValueError(
            f"rope_scaling type {kind!r}: tessera's RoPE scales only as Llama 3.1's ('llama3'), so it would "
            "compute another model; only configs with that or unscaled RoPE (rope_scaling: null) build"
        )
    missing = [name for name in LLAMA3_SCALING if scaling.get(name) is None]
    if missing:
        raise ValueError(
            f"rope_scaling type 'llama3' without {', '.join(missing)}; give all of {LLAMA3_SCALING}"
        )
    numbers = {name: _number(f"rope_scaling.{name}", scaling[name]) for name in LLAMA3_SCALING}
    numbers["original_max_position_embeddings"] = _count(scaling, "original_max_position_embeddings")
    return _number(key, theta), numbers


def _refuse_what_tessera_computes_differently(config: dict[str, Any], model_type: str) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config['hidden_act']!r}: tessera's feed-forward is SwiGLU with silu")
    if _flag(config, "attention_bias"):
        raise ValueError(
            "attention_bias=true puts biases on o_proj as well as q/k/v; tessera has q/k/v biases only "
            "(model.qkv_bias, as Qwen2)"
        )
    if _flag(config, "mlp_bias"):
        raise ValueError("mlp_bias=true: tessera's feed-forward has no biases")
    # Sliding windows: Mistral/Mixtral by sliding_window alone, Qwen by use_sliding_window (or per layer).
    window = config.get("sliding_window") if model_type in ("mistral", "mixtral") else None
    if model_type in ("qwen2", "qwen3") and _flag(config, "use_sliding_window"):
        window = config.get("sliding_window")
    layer_types = config.get("layer_types") or []
    if window is not None or any(kind != "full_attention" for kind in layer_types):
        raise ValueError(
            f"sliding-window attention (sliding_window={config.get('sliding_window')!r}, layer_types): "
            "tessera attends to the whole sequence; set sliding_window: null (and use_sliding_window: false) "
            "in a copy of config.json if train.seq_len is within the window, where the two are the same"
        )


def _moe_fields(config: dict[str, Any], ffn_dim: int) -> tuple[int, dict[str, Any]]:
    """(model.ffn_dim, model.moe) of a Mixtral config; tessera's own export adds decoder_sparse_step and
    dense_intermediate_size for models with dense layers between the sparse ones."""
    moe: dict[str, Any] = {
        "n_experts": _count(config, "num_local_experts", 8),
        "top_k": _count(config, "num_experts_per_tok", 2),
    }
    every = _count(config, "decoder_sparse_step", 1)
    if every > 1:
        moe |= {"every_n_layers": every, "expert_ffn_dim": ffn_dim}
        return _count(config, "dense_intermediate_size"), moe
    return ffn_dim, moe


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields (preset ``custom``) of the Llama, Mistral, Mixtral, Qwen2 or Qwen3 config.json."""
    model_type = config.get("model_type")
    defaults = OPTIONAL_DEFAULTS[model_type]
    for key in REQUIRED:
        if config.get(key) is None:
            raise ValueError(f"config.json has no {key}; a {model_type} config.json gives every dimension")
    _refuse_what_tessera_computes_differently(config, model_type)
    theta, scaling = _rope(config)
    heads = _count(config, "num_attention_heads")
    dim = _count(config, "hidden_size")
    fields: dict[str, Any] = {
        "preset": "custom",
        "n_layers": _count(config, "num_hidden_layers"),
        "dim": dim,
        "n_heads": heads,
        "n_kv_heads": _count(config, "num_key_value_heads", defaults["num_key_value_heads"] or heads),
        "ffn_dim": _count(config, "intermediate_size"),
        "vocab_size": _count(config, "vocab_size"),
        "rope_theta": theta,
        "norm_eps": _number("rms_norm_eps", config.get("rms_norm_eps", defaults["rms_norm_eps"])),
        "tie_embeddings": _flag(config, "tie_word_embeddings"),
        "head_dim": _count(config, "head_dim", defaults["head_dim"] or dim // heads),
    }
    if scaling is not None:
        fields["rope_scaling"] = scaling
    if model_type in FEATURES:
        fields[FEATURES[model_type]] = True
    if model_type == "mixtral":
        fields["ffn_dim"], fields["moe"] = _moe_fields(config, fields["ffn_dim"])
    return fields


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
    """Refuse what no architecture of the table holds (see ``hf.py``'s docstring for the MoE reasons)."""
    if cfg.moe is not None and cfg.moe.shared_experts:
        raise UserError(
            f"model.moe.shared_experts={cfg.moe.shared_experts}: Mixtral has no shared experts; "
            "only models with shared_experts: 0 convert to Hugging Face"
        )
    if cfg.moe is not None:
        mixtral = {
            "score": "softmax",
            "normalize_weights": True,
            "routed_scale": 1.0,
            "first_dense_layers": 0,
        }
        other = [
            f"model.moe.{name}={getattr(cfg.moe, name)}"
            for name, value in mixtral.items()
            if getattr(cfg.moe, name) != value
        ]
        if other:
            raise UserError(
                f"{', '.join(other)}: Mixtral's router is softmax top-k renormalised, unscaled, in every MoE "
                f"layer; set {', '.join(f'{name}: {value}' for name, value in mixtral.items())} to convert to "
                "Hugging Face"
            )
    features = [name for name in ("qkv_bias", "qk_norm") if getattr(cfg, name)]
    if features and (cfg.moe is not None or len(features) > 1):
        raise UserError(
            f"model.{' and model.'.join(features)}{' with model.moe' if cfg.moe else ''}: no Hugging Face "
            "architecture tessera converts holds them together (Qwen2: qkv_bias, Qwen3: qk_norm, both "
            "dense; Mixtral: moe)"
        )


def hf_config(cfg: ModelConfig, max_seq_len: int, torch_dtype: str) -> dict[str, Any]:
    """config.json of transformers' LlamaConfig, MixtralConfig, Qwen2Config or Qwen3Config (RoPE scaling
    only as Llama 3.1's; no sliding window: tessera attends to the whole sequence)."""
    model_type = hf_model_type(cfg)
    architecture = {"llama": "Llama", "mixtral": "Mixtral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
    by_type: dict[str, dict[str, Any]] = {
        "llama": {"mlp_bias": False, "attention_bias": False},
        "mixtral": {
            "router_aux_loss_coef": cfg.moe.aux_loss_coef if cfg.moe else 0.0,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "sliding_window": None,
            **{hf: value for hf, (value, _) in moe_config_fields(cfg).items()},
        },
        "qwen2": {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers},
        "qwen3": {
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": cfg.n_layers,
        },
    }
    return {
        "architectures": [f"{architecture}ForCausalLM"],
        "model_type": model_type,
        **{hf: getattr(cfg, field) for field, hf in CONFIG_FIELDS.items()},
        **by_type[model_type],
        "hidden_act": "silu",
        "max_position_embeddings": max_seq_len,
        "rope_scaling": None
        if cfg.rope_scaling is None
        else {"rope_type": "llama3", **cfg.rope_scaling.model_dump()},
        "torch_dtype": torch_dtype,
    }


def check_hf_config(config: dict[str, Any], cfg: ModelConfig) -> None:
    """Refuse an HF model whose architecture differs from the spec's, naming each field."""
    expected = hf_model_type(cfg)
    found = config.get("model_type")
    if found != expected and (found, expected) != ("mistral", "llama"):
        raise UserError(
            f"config.json has model_type {found!r} but the spec's model is {expected} (model.moe, "
            f"model.qkv_bias and model.qk_norm pick it); llama, mistral, mixtral, qwen2 and qwen3 import"
        )
    try:
        theirs = model_fields(config)
    except ValueError as exc:
        raise UserError(f"config.json: {exc}") from None
    wrong = [
        f"model.{field}={getattr(cfg, field)} but {hf}={theirs[field]}"
        for field, hf in CONFIG_FIELDS.items()
        if getattr(cfg, field) != theirs[field] and not (cfg.moe and field == "ffn_dim")
    ]
    ours = None if cfg.rope_scaling is None else cfg.rope_scaling.model_dump()
    if ours != theirs.get("rope_scaling"):
        wrong.append(f"model.rope_scaling={ours} but rope_scaling={theirs.get('rope_scaling')}")
    if cfg.moe is not None:
        moe, their_moe = cfg.moe, theirs["moe"]
        their_expert = their_moe.get("expert_ffn_dim") or theirs["ffn_dim"]
        pairs = [
            ("moe.n_experts", moe.n_experts, their_moe["n_experts"], "num_local_experts"),
            ("moe.top_k", moe.top_k, their_moe["top_k"], "num_experts_per_tok"),
            (
                "moe.every_n_layers",
                moe.every_n_layers,
                their_moe.get("every_n_layers", 1),
                "decoder_sparse_step",
            ),
            ("moe.expert_ffn_dim", cfg.expert_ffn_dim, their_expert, "intermediate_size"),
        ]
        if moe.every_n_layers > 1:  # dense layers in between: their width too
            pairs.append(("ffn_dim", cfg.ffn_dim, theirs["ffn_dim"], "dense_intermediate_size"))
        wrong += [
            f"model.{field}={ours} but {hf}={value}" for field, ours, value, hf in pairs if ours != value
        ]
    if wrong:
        raise UserError(f"the HF model is not the spec's model: {'; '.join(wrong)}; set these in the spec")
