"""Typed configuration the training process needs.

These models are the contract between the orchestrator and ``python -m trainer.train``: the
deployment spec (``deployments/spec.py``) composes them with cluster, data-prep and eval settings,
and hands the trainer a :class:`JobConfig` as JSON. Every field carries a description because the
same schema renders as the Prefect UI run form.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Annotated, Any, Literal

import fsspec
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from trainer.hub import HUB_URL_PREFIXES
from trainer.layout_checks import layout_errors, muon_errors

Accelerator = Literal["cpu", "gpu", "tpu", "trainium"]
PipelineSchedule = Literal[
    "gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"
]
Float8Recipe = Literal["none", "tensorwise", "rowwise"]
ActivationCheckpointing = Literal["none", "selective", "full"]
Precision = Literal["fp32", "bf16"]
AsyncMode = Literal["sync", "async", "async_process"]
OptimizerName = Literal["adamw", "muon"]

# Every count in a spec is bounded: large enough for any real run, small enough that nothing
# overflows downstream (torch seeds, int32 tensors) or loops over it for hours.
MAX_COUNT = 2**31 - 1
PositiveInt = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
# Durations: positive and at most a week, so a typo like 1e300 fails here, not inside a timedelta.
Seconds = Annotated[float, Field(gt=0, le=7 * 24 * 3600)]


MIN_WRITE_GBPS = 1e-3  # 1 MB/s: a 1B-parameter model's 12 GB checkpoint takes 3 h to write at it

OUTPUT_RULE = "A relative path must stay inside the working directory."
# No control characters (NUL, newline, tab, DEL) in a place tessera writes: a NUL ends the path early in
# C, a newline splits a log or manifest line. In the JSON schema too, so the server refuses them.
NO_CONTROL_CHARACTERS = r"^[^\x00-\x1f\x7f]*$"


def confined_output(location: str) -> str:
    """A place tessera writes: an object-store URL, an absolute path other than /, or a relative path
    that stays inside the working directory, normalised (``data/./x/`` → ``data/x``)."""
    if not location.strip():
        raise ValueError("is empty; give a directory such as data, an absolute path, or a gs:// / s3:// URL")
    if "://" in location:
        scheme, _, rest = location.partition("://")
        if not scheme.isidentifier() or not rest.strip("/"):
            raise ValueError(f"{location!r} names no bucket or path; use e.g. s3://bucket/prefix")
        if scheme not in fsspec.available_protocols():
            raise ValueError(
                f"{location!r}: {scheme}:// is not a storage protocol fsspec knows; use a path, gs:// or s3://"
            )
        return location
    normalised = posixpath.normpath(location)
    if normalised == "/":
        raise ValueError("is the filesystem root; give a directory of its own")
    if normalised == ".." or normalised.startswith("../"):
        raise ValueError(
            f"{location!r} leaves the working directory; use a path inside it or an absolute path"
        )
    return normalised


OutputLocation = Annotated[str, Field(pattern=NO_CONTROL_CHARACTERS), AfterValidator(confined_output)]


class Strict(BaseModel):
    """Base for every config section: unknown keys are errors, not silently ignored typos."""

    # strict: a spec means the same at every door. `true` is not 1 and 0 is not false, as the Prefect
    # server's JSON schema sees them too. allow_inf_nan=False: YAML's .inf would pass `gt=0` and
    # become null in job.json.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, strict=True)


class MoEConfig(Strict):
    """Mixture-of-experts feed-forward: top-k token-choice routing, dropless (no token is ever dropped).

    Load balancing (``balance``), both from DeepSeek-V3: ``aux_loss``, the sequence-wise auxiliary loss,
    computed per sequence and averaged, so any split of a batch over ranks and micro-batches gives the
    same gradient as the whole batch; or ``bias``, auxiliary-loss-free balancing: a per-expert bias on the
    routing scores (top-k selection only) moved after every step by bias_update_rate toward the experts
    the global batch under-used, so balancing never pulls on the language-model gradient.
    """

    n_experts: int = Field(ge=2, le=4096, description="Routed experts per MoE layer.")
    top_k: PositiveInt = Field(2, description="Experts each token is routed to.")
    shared_experts: int = Field(
        0, ge=0, le=64, description="Always-on experts every token also goes through (DeepSeek-style)."
    )
    every_n_layers: PositiveInt = Field(
        1, description="Layers i with i % every_n_layers == every_n_layers - 1 are MoE; 1 = every layer."
    )
    expert_ffn_dim: PositiveInt | None = Field(
        None, description="SwiGLU hidden size of one expert (default: model.ffn_dim)."
    )
    balance: Literal["aux_loss", "bias"] = Field(
        "aux_loss",
        description="Load balancing: 'aux_loss' (sequence-wise balance loss) or 'bias' (DeepSeek-V3's "
        "auxiliary-loss-free per-expert routing bias, updated after each step from the global batch).",
    )
    aux_loss_coef: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Weight of the sequence-wise balance loss; 0 turns it off (default: 0.01 with "
        "balance 'aux_loss', 0 with 'bias', which DeepSeek-V3 pairs with a tiny one, 1e-4).",
    )
    bias_update_rate: float | None = Field(
        None,
        gt=0,
        le=1,
        description="balance 'bias' only: how far each step moves an expert's bias, up if the global "
        "batch gave it fewer tokens than the mean, down if more (default 0.001, DeepSeek-V3's).",
    )
    first_dense_layers: Count = Field(
        0,
        description="Leading layers kept dense (model.ffn_dim wide) whatever every_n_layers says: "
        "DeepSeek's first_k_dense_replace (V3: 3, V2-Lite: 1).",
    )
    score: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description="Router score per expert: softmax over experts (Mixtral, DeepSeek-V2) or an independent "
        "sigmoid each (DeepSeek-V3).",
    )
    normalize_weights: bool = Field(
        True,
        description="Rescale the chosen experts' scores to sum to 1 (DeepSeek's norm_topk_prob; V2-Lite: "
        "false).",
    )
    routed_scale: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="Multiplies the routed experts' mixing weights (DeepSeek's routed_scaling_factor; V3: 2.5).",
    )

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.n_experts:
            raise ValueError(
                f"model.moe.top_k={self.top_k} exceeds model.moe.n_experts={self.n_experts}; lower top_k"
            )
        if self.balance == "aux_loss" and self.bias_update_rate is not None:
            raise ValueError(
                "model.moe.bias_update_rate only applies with model.moe.balance='bias'; set balance: bias "
                "or remove bias_update_rate"
            )
        # object.__setattr__ skips re-validation recursion from validate_assignment.
        if self.aux_loss_coef is None:
            object.__setattr__(self, "aux_loss_coef", 0.01 if self.balance == "aux_loss" else 0.0)
        if self.balance == "bias" and self.bias_update_rate is None:
            object.__setattr__(self, "bias_update_rate", 0.001)
        return self


class RopeScaling(Strict):
    """Llama 3.1's RoPE scaling (``rope_type: llama3`` in a Hugging Face config.json): frequencies whose
    wavelength exceeds original_max_position_embeddings / low_freq_factor are divided by factor, those
    under original_max_position_embeddings / high_freq_factor are kept, and the band between is
    interpolated smoothly, so a model trained at the original context reads longer ones."""

    factor: float = Field(ge=1, le=1e6, description="How much the low frequencies are slowed (Llama 3.1: 8).")
    low_freq_factor: float = Field(
        gt=0, le=1e6, description="Wavelengths above original/this are scaled (1)."
    )
    high_freq_factor: float = Field(gt=0, le=1e6, description="Wavelengths below original/this are kept (4).")
    original_max_position_embeddings: PositiveInt = Field(
        description="The context length the model was first trained at (Llama 3.1: 8192)."
    )

    @model_validator(mode="after")
    def _band(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
                f"{self.low_freq_factor} (Llama 3.1: 4 and 1)"
            )
        return self


def _preset_enum(schema: dict[str, Any]) -> None:
    """The run form's preset menu: every registered family's presets (read when the schema is built)."""
    from trainer.models import preset_names

    schema["enum"] = preset_names()


class MLAConfig(Strict):
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are rebuilt per head from one
    low-rank latent, plus a RoPE key part shared by every head; queries optionally low-rank too."""

    q_lora_rank: PositiveInt | None = Field(
        None,
        description="Rank of the compressed query (V3: 1536); none: a plain query projection (V2-Lite).",
    )
    kv_lora_rank: PositiveInt = Field(description="Rank of the joint key/value latent (V3 and V2-Lite: 512).")
    qk_nope_head_dim: PositiveInt = Field(
        description="Per-head query/key width that RoPE leaves alone (128)."
    )
    qk_rope_head_dim: PositiveInt = Field(
        description="Query/key width that RoPE rotates; the key's part is shared by all heads (64; even)."
    )
    v_head_dim: PositiveInt = Field(description="Per-head value width (128).")

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head; softmax scales scores by its inverse square root."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class ModelConfig(Strict):
    """A decoder: a preset of a registered model family (``trainer/models/``), optionally with any
    dimension overridden. The preset names the family; ``custom`` is a Llama of the given dimensions.

    Or ``from_hf``: a Hugging Face config.json, read once here (``trainer/models/from_hf.py``), whose
    model_type picks the family and fills the preset and every dimension; fields the spec also sets
    override the file's (as they override a preset's; ``moe`` key by key), and ``preset`` may not be
    set beside it. The validated config keeps from_hf for display only: dumps (run records, job files,
    fingerprints) leave it out and carry the resolved fields, so nothing reads the file again.
    """

    from_hf: str | None = Field(
        None,
        exclude=True,
        pattern=NO_CONTROL_CHARACTERS,
        description="A Hugging Face config.json (or its directory): local path relative to the working "
        "directory, gs:// or s3://, never the Hub. Builds its model_type's family (llama, mistral, mixtral, "
        "qwen2, qwen3, deepseek_v3, deepseek_v2) with its dimensions; other model fields set here override the file's. Leave preset "
        "unset.",
    )
    preset: str = Field(
        "tiny",
        description="Architecture preset; 'custom' requires every dimension.",
        json_schema_extra=_preset_enum,
    )
    n_layers: PositiveInt | None = Field(None, description="Transformer blocks (default: from preset).")
    dim: PositiveInt | None = Field(None, description="Hidden size (default: from preset).")
    n_heads: PositiveInt | None = Field(None, description="Query heads (default: from preset).")
    n_kv_heads: PositiveInt | None = Field(None, description="Key/value heads for grouped-query attention.")
    ffn_dim: PositiveInt | None = Field(None, description="SwiGLU hidden size (default: from preset).")
    vocab_size: PositiveInt | None = Field(
        None, description="Vocabulary size; the tokenizer is trained to it."
    )
    rope_theta: float | None = Field(None, gt=0, description="RoPE base frequency (default: from preset).")
    rope_scaling: RopeScaling | None = Field(
        None, description="Llama 3.1-style RoPE scaling (Hugging Face's rope_type llama3); empty: plain RoPE."
    )
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool = Field(False, description="Share input embedding and output projection weights.")
    head_dim: PositiveInt | None = Field(
        None,
        description="Width of one attention head (default: dim / n_heads); Qwen3's differs from it.",
    )
    qkv_bias: bool = Field(False, description="Biases on the query, key and value projections (Qwen2).")
    qk_norm: bool = Field(
        False, description="RMSNorm over each query and key head before RoPE (Qwen3); gains of head_dim."
    )
    moe: MoEConfig | None = Field(None, description="Mixture-of-experts layers (default: from preset; none).")
    mla: MLAConfig | None = Field(
        None, description="Multi-head latent attention: DeepSeek family only (default: from preset)."
    )
    attention: Literal["causal", "document"] = Field(
        "causal",
        description="causal: a token attends to every earlier token of its sample, across the packed "
        "documents; document: only to earlier tokens of its own document (each ends at the dataset's "
        "end-of-text token), through FlexAttention. document needs parallel.cp=1 and parallel.pp=1.",
    )
    rope_positions: Literal["sequence", "document"] = Field(
        "sequence",
        description="RoPE positions count from the sample's start (sequence) or restart at 0 with each "
        "document (document, as if it were alone; needs attention=document).",
    )

    @model_validator(mode="before")
    @classmethod
    def _resolve_from_hf(cls, data: Any) -> Any:
        """from_hf: the file's fields, then the spec's own on top (the file is read here, once)."""
        if not isinstance(data, dict) or data.get("from_hf") is None:
            return data
        if "preset" in data:
            raise ValueError(
                f"model.preset={data['preset']!r} and model.from_hf both set: the config.json's model_type "
                "picks the family; remove preset (set dimensions to override the file's)"
            )
        from trainer.models.from_hf import model_fields

        fields = model_fields(data["from_hf"])
        if isinstance(data.get("moe"), dict) and isinstance(fields.get("moe"), dict):
            data = {**data, "moe": {**fields["moe"], **data["moe"]}}
        return {**fields, **data}

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str) -> str:
        # Imported here: the families import this module (for their configs' types and checks).
        from trainer.models import preset_names

        names = preset_names()
        if preset not in names:
            raise ValueError(f"unknown model.preset {preset!r}; use one of {', '.join(names)}")
        return preset

    @model_validator(mode="after")
    def _fill_from_preset(self) -> ModelConfig:
        from trainer.models import family_of, preset_shape

        base = preset_shape(self.preset)
        if self.moe is None and "moe" in base:
            object.__setattr__(self, "moe", MoEConfig(**base["moe"]))
        if self.mla is None and "mla" in base:
            object.__setattr__(self, "mla", MLAConfig(**base["mla"]))
        if "norm_eps" in base and "norm_eps" not in self.model_fields_set:
            object.__setattr__(self, "norm_eps", float(base["norm_eps"]))
        missing = []
        for key in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta"):
            if getattr(self, key) is None:
                if key not in base:
                    missing.append(key)
                    continue
                # object.__setattr__ skips re-validation recursion from validate_assignment.
                object.__setattr__(self, key, type(base[key])(base[key]))
        if missing:
            raise ValueError(
                f"model.preset={self.preset} needs model.{', model.'.join(missing)}; set them or pick a preset"
            )
        if self.head_dim is None:  # derived (a family may require dim to divide evenly: Llama does)
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        family_of(self).check(self)
        if self.rope_positions == "document" and self.attention != "document":
            raise ValueError(
                "model.rope_positions=document needs model.attention=document (positions that restart at "
                "a document are only meaningful if attention stays inside it); set both or neither"
            )
        return self

    @model_serializer(mode="wrap")
    def _derived_head_dim_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A head_dim of dim / n_heads is derived, not chosen: left out of dumps, so records and
        fingerprints of models that never set it stay as they were, and a dump whose dim is edited
        derives it again."""
        data = handler(self)
        derived = self.dim and self.n_heads and not self.dim % self.n_heads and self.dim // self.n_heads
        if derived and data.get("head_dim") == derived:
            del data["head_dim"]
        return data

    def is_moe_layer(self, layer: int) -> bool:
        if self.moe is None or layer < self.moe.first_dense_layers:
            return False
        every = self.moe.every_n_layers
        return layer % every == every - 1

    @property
    def moe_layer_count(self) -> int:
        """How many layers ``is_moe_layer`` picks, counted without visiting them: the planner runs on
        every validation, and n_layers may be up to 2³¹."""
        if self.moe is None:
            return 0
        every, dense = self.moe.every_n_layers, min(self.moe.first_dense_layers, self.n_layers)
        return self.n_layers // every - dense // every

    @property
    def expert_ffn_dim(self) -> int:
        return (self.moe and self.moe.expert_ffn_dim) or self.ffn_dim


class ParallelConfig(Strict):
    """How the model is cut across chips. Degrees multiply to the world size."""

    dp_replicate: PositiveInt = Field(1, description="Data-parallel replicas (HSDP outer dim; DDP-like).")
    dp_shard: PositiveInt = Field(1, description="FSDP2 sharding degree (ZeRO-3 style) within a replica.")
    tp: PositiveInt = Field(
        1, description="Tensor-parallel degree (with sequence parallel); keep within a node."
    )
    cp: PositiveInt = Field(
        1,
        description="Context-parallel degree: each sequence is split over cp ranks (ring attention); "
        "train.seq_len must be divisible by 2·cp.",
    )
    pp: PositiveInt = Field(1, description="Pipeline-parallel stages.")
    pp_schedule: PipelineSchedule = Field(
        "1f1b",
        description="Pipeline schedule when pp > 1; zbv_zero_bubble (ZB-V) and dualpipev (DeepSeek) need "
        "pp_virtual_stages=2.",
    )
    pp_virtual_stages: PositiveInt = Field(
        1,
        description="Model chunks per pipeline rank; >1 needs a multi-stage pp_schedule (interleaved_1f1b, "
        "interleaved_zero_bubble, zbv_zero_bubble, dualpipev).",
    )
    activation_checkpointing: ActivationCheckpointing = Field(
        "none", description="Recompute activations in backward: none, selective (attention), or full."
    )
    mixed_precision: Precision = Field(
        "fp32", description="Parameter/compute dtype for FSDP; gradients are always reduced in fp32."
    )
    compile: bool = Field(False, description="torch.compile each transformer block.")
    reshard_after_forward: bool = Field(
        True,
        description="FSDP2: free gathered parameters after forward (ZeRO-3); false keeps them until backward "
        "(ZeRO-2-like): fewer all-gathers, more memory.",
    )
    float8: Float8Recipe = Field(
        "none",
        description="fp8 matmuls (torchao.float8) on chips with fp8: tensorwise (fastest) or rowwise (robust "
        "to outliers); needs bf16 and tp=1.",
    )
    ep: PositiveInt = Field(
        1,
        description="Expert-parallel degree: each MoE layer's experts are split over ep ranks carved out of "
        "dp_shard (all-to-all).",
    )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp


class TrainConfig(Strict):
    """Batch geometry and run length."""

    steps: PositiveInt = Field(100, description="Optimizer steps to train for.")
    global_batch_size: PositiveInt = Field(
        8, description="Sequences per optimizer step, across all replicas."
    )
    micro_batch_size: PositiveInt = Field(
        4,
        description="Sequences per forward pass on one data-parallel rank; global / (dp × micro) are "
        "accumulated per step.",
    )
    seq_len: PositiveInt = Field(128, description="Tokens per sample.")
    log_every: PositiveInt = Field(1, description="Write a metrics line every N steps.")
    step_line_every: PositiveInt = Field(
        10,
        description="Log a step line (loss, step time, tokens/s, MFU) in the run's logs every N steps; "
        "a straggler or a slow step is logged whenever it happens.",
    )


MAX_LR = 1.0
MAX_LR_REASON = (
    "AdamW moves every weight by about lr each step, so above 1 a single step moves weights far past "
    "their scale (init std 0.02) and the loss diverges"
)


class OptimizerConfig(Strict):
    """AdamW (or Muon for the blocks' matrices) with linear warmup then cosine decay to min_lr_ratio × lr."""

    name: OptimizerName = Field(
        "adamw",
        description="adamw, or muon: Newton-Schulz-orthogonalised momentum for the blocks' 2-D weight "
        "matrices, its update scaled to AdamW's RMS so lr and weight_decay carry over (Moonshot), and AdamW "
        "with these settings for embeddings, norms and the output layer. Dense models without tp only.",
    )
    lr: float = Field(
        3e-3, gt=0, le=MAX_LR, description=f"Peak learning rate, at most {MAX_LR}: {MAX_LR_REASON}."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of the peak.")
    warmup_steps: Count = Field(
        10,
        description="Linear warmup steps, at most train.steps (the default 10 is cut to train.steps on "
        "shorter runs).",
    )
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="Adam beta2.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient norm; 0 disables clipping.")

    @field_validator("lr", mode="before")
    @classmethod
    def _lr_with_reason(cls, value: object) -> object:
        """The bound's reason in the refusal itself (the constraint alone says only 'less than 1')."""
        if isinstance(value, float | int) and not isinstance(value, bool) and value > MAX_LR:
            raise ValueError(f"{value} is above {MAX_LR}: {MAX_LR_REASON}; typical peaks are 1e-4 to 1e-2")
        return value


class CheckpointConfig(Strict):
    """Sharded DCP checkpoints through fsspec."""

    url: OutputLocation | None = Field(
        None,
        description="Local path, gs:// or s3://; default: the run directory's checkpoints/. " + OUTPUT_RULE,
    )
    interval: PositiveInt | Literal["auto"] = Field(
        "auto",
        description="Steps between checkpoints, or 'auto' for the Young/Daly optimum from the planner.",
    )
    keep_last: PositiveInt = Field(3, description="Keep the newest N checkpoints.")
    keep_every: PositiveInt | None = Field(
        None, description="Also keep every checkpoint whose step is a multiple of K."
    )
    mode: AsyncMode = Field(
        "async",
        description="sync blocks training for the whole write; async stages to host memory and "
        "writes in a thread; async_process writes in a separate process.",
    )
    write_bandwidth_gbps: float = Field(
        2.0,
        ge=MIN_WRITE_GBPS,
        le=10_000,
        description="Assumed storage write bandwidth per node in GB/s (planner input), 0.001 (1 MB/s: "
        "slower stores cannot hold checkpoints) to 10,000.",
    )
    memory_interval: PositiveInt | Literal["auto", "off"] = Field(
        "off",
        description="In-memory tier: steps between host-memory snapshots, each copied to a peer node; "
        "'auto': the planner's optimum; 'off': storage only.",
    )
    memory_dir: str = Field(
        "/dev/shm",
        description="Host-memory (tmpfs) directory the in-memory tier keeps its snapshots in; it outlives "
        "the training processes, so a restarted rank finds them.",
    )

    @field_validator("memory_dir")
    @classmethod
    def _absolute_memory_dir(cls, value: str) -> str:
        if not posixpath.isabs(value):
            raise ValueError(f"checkpoint.memory_dir={value!r} must be an absolute path, e.g. /dev/shm")
        return value


class FaultsConfig(Strict):
    """Failure handling: in-job restarts, then task-level retries on node failure only."""

    node_failure_retries: int = Field(
        3, ge=0, le=100, description="Prefect task retries after a node failure."
    )
    retry_delay_s: float = Field(5.0, ge=0, le=24 * 3600, description="Seconds between task retries.")
    max_restarts: int = Field(
        2, ge=0, le=100, description="torchrun --max-restarts: in-job restarts of all workers."
    )
    step_timeout_s: Seconds = Field(
        300.0,
        description="Watchdog: a step slower than this and than 10x the slowest step so far (the first step: "
        "collective_timeout_s) is a hang, treated as a node failure.",
    )
    collective_timeout_s: Seconds = Field(
        600.0, description="Process-group timeout, so a lost peer fails fast instead of after 30 min."
    )
    min_nodes: PositiveInt | None = Field(
        None,
        description="Elastic: a lost node not replaced within replacement_wait_s leaves the job on the nodes "
        "left, down to this many, until it returns; dp_replicate (if > 1) or dp_shard flexes and the global "
        "batch stays. Empty: not elastic.",
    )
    replacement_wait_s: int = Field(
        60,
        ge=3,
        le=3600,
        description="Elastic: seconds to notice a lost node, and as long again to wait for a replacement.",
    )
    warm_restart: bool = Field(
        False,
        description="Fork restarted workers from a per-host server that imported torch once: a killed "
        "rank restored from memory trains again in ~0.5 s, not ~7-10 s (tiny model, CPU).",
    )
    replica_fault_tolerance: bool = Field(
        False,
        description="HSDP (dp_replicate > 1): a lost replica group stops no other; the rest continue and it "
        "heals from a live one when it restarts (torchft). Steps on fewer replicas train fewer rows.",
    )


class HardwareConfig(Strict):
    """What the job runs on; the chip must belong to the accelerator (see trainer.backends.chips)."""

    accelerator: Accelerator = Field(
        "cpu", description="Accelerator family; selects the backend and work pool."
    )
    chip: str = Field("cpu", description="Chip type from the catalog, e.g. h100-sxm, tpu-v5p, trainium2.")
    nodes: PositiveInt = Field(1, description="Hosts in the job.")
    chips_per_node: PositiveInt = Field(1, description="Accelerator chips (or CPU processes) per host.")
    mtbf_hours: float | None = Field(
        None,
        gt=0,
        description="Job mean time between failures; default from the chip's per-chip failure rate.",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.chips_per_node


class CorpusConfig(Strict):
    """One corpus: where its documents come from and how they are read."""

    source: Literal["stdlib", "generated", "files"] = Field(
        "stdlib",
        description="stdlib: the Python standard library's sources (real text, on every machine); "
        "generated: a small synthetic corpus; files: the paths below.",
    )
    paths: list[str] = Field(
        default_factory=list, description="Files, globs or fsspec URLs (gs://, s3://) when source=files."
    )
    format: Literal["auto", "text", "jsonl", "parquet"] = Field("auto", description="Input file format.")
    text_field: str = Field("text", description="Column holding the text (JSONL/Parquet).")
    max_documents: PositiveInt | None = Field(None, description="Use at most N documents (quick runs).")

    @field_validator("paths")
    @classmethod
    def _no_hub_paths(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if path.startswith(HUB_URL_PREFIXES):
                raise ValueError(
                    f"{path!r} is on the Hugging Face Hub, which tessera never reads at run time; copy "
                    "the files to a local path, gs:// or s3:// and list that in data.paths"
                )
        return paths


class MixtureSource(CorpusConfig):
    """One source of a mixture: a corpus, its name in metrics, and its sampling weight."""

    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9_-]*$",
        description="Short name (web, code, books): the key of its tokens in metrics.jsonl and the report.",
    )
    weight: float = Field(
        gt=0, description="Relative sampling weight before any schedule stage (normalised over sources)."
    )


class MixtureStage(Strict):
    """New weights from a step on: how a run anneals onto other data late in training."""

    step: PositiveInt = Field(description="First training step drawn with these weights.")
    weights: list[Annotated[float, Field(ge=0)]] = Field(
        description="One relative weight per source, in the order of mixture.sources; 0 pauses a source."
    )


class MixtureConfig(Strict):
    """Several corpora drawn with weights: one shared tokenizer, one prepared dataset per source."""

    sources: list[MixtureSource] = Field(min_length=2, description="The corpora and their weights.")
    schedule: list[MixtureStage] = Field(
        default_factory=list, description="Weight changes by step, in increasing step order."
    )

    @model_validator(mode="after")
    def _check(self) -> MixtureConfig:
        names = [source.name for source in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.mixture.sources: names must be unique, got {names}")
        steps = [stage.step for stage in self.schedule]
        if steps != sorted(set(steps)):
            raise ValueError(f"data.mixture.schedule: steps must increase, got {steps}")
        for stage in self.schedule:
            if len(stage.weights) != len(names) or not sum(stage.weights) > 0:
                raise ValueError(
                    f"data.mixture.schedule step {stage.step}: give {len(names)} weights (for {names}) "
                    "with a positive sum"
                )
        return self


class DataConfig(CorpusConfig):
    """The corpus (or a mixture of corpora), how it is tokenized and sharded, and how the trainer reads it."""

    mixture: MixtureConfig | None = Field(
        None,
        description="Draw from several sources with weights instead of the one corpus above "
        "(then leave source/paths/format/text_field/max_documents unset here).",
    )
    tokenizer: str | None = Field(
        None,
        description="Existing tokenizer.json; default: train a byte-level BPE to model.vocab_size on "
        "tokenizer_sample_mb of each source.",
    )
    tokenizer_sample_mb: float = Field(
        64,
        gt=0,
        le=1 << 20,
        description="Text the tokenizer trains on, in MB, split evenly over the sources.",
    )
    output_url: OutputLocation = Field(
        "data", description="Where shards + manifest go: local path, gs:// or s3://. " + OUTPUT_RULE
    )
    validation_fraction: float = Field(0.05, ge=0, lt=1, description="Documents held out for eval, by seed.")
    samples_per_shard: PositiveInt = Field(1024, description="Packed samples per webdataset tar shard.")
    dedup: bool = Field(False, description="Drop exact duplicate documents (first occurrence kept).")
    min_chars: Count = Field(0, description="Drop documents shorter than this many characters.")
    max_chars: PositiveInt | None = Field(
        None, description="Drop documents longer than this many characters."
    )
    num_proc: int = Field(
        1,
        ge=1,
        le=256,
        description="Processes preparing parts: 1 prepares in the flow's process, more start a Dask "
        "LocalCluster of that many single-threaded workers.",
    )
    dask_address: str | None = Field(
        None,
        description="A running Dask scheduler (tcp://host:8786) to prepare on instead; num_proc is then "
        "ignored.",
    )
    loader_workers: int = Field(
        1, ge=0, le=64, description="Data loader worker processes per rank (at most 64)."
    )

    @model_validator(mode="after")
    def _one_corpus_or_a_mixture(self) -> DataConfig:
        corpus_fields = set(CorpusConfig.model_fields) & self.model_fields_set
        if self.mixture is not None and corpus_fields:
            raise ValueError(
                f"data.{', data.'.join(sorted(corpus_fields))} and data.mixture both set; give each "
                "mixture source its own corpus fields"
            )
        return self

    def corpora(self) -> dict[str, CorpusConfig]:
        """Every corpus to prepare, by source name (``main`` when there is no mixture)."""
        if self.mixture is None:
            return {"main": self}
        return {source.name: source for source in self.mixture.sources}


# ModelConfig fields newer than the first checkpoints, with the defaults that leave fingerprints unchanged.
LATER_MODEL_DEFAULTS = {
    "attention": "causal",
    "rope_positions": "sequence",
    "mla": None,
    "qkv_bias": False,
    "qk_norm": False,
    "rope_scaling": None,
}
LATER_MOE_DEFAULTS = {
    "first_dense_layers": 0,
    "score": "softmax",
    "normalize_weights": True,
    "routed_scale": 1.0,
}


class JobConfig(Strict):
    """Everything ``python -m trainer.train`` needs, and nothing it must not know (no Prefect, no k8s)."""

    name: str = Field("tessera", description="The spec's name (the prefix of its runs' ids; logs).")
    run_id: str | None = Field(
        None, description="The run's identity (its directory's name); None for a job run outside a Run."
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**63 - 1,
        description="Seed for init, data order and dropout-free determinism.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    data_url: str | None = Field(
        None,
        description="URL of a prepared dataset's manifest.json; None trains on deterministic synthetic tokens.",
    )
    loader_workers: int = Field(1, ge=0, le=64, description="Data loader worker processes per rank.")
    run_url: str | None = Field(
        None,
        description="Object-store URL (gs://, s3://) rank 0 mirrors the run's metrics to as it trains, so an "
        "orchestrator elsewhere follows them (a Kubernetes pod's own run directory dies with the pod).",
    )
    checkpoint_interval_steps: PositiveInt | None = Field(
        None, description="Resolved interval (the planner fills it when checkpoint.interval is 'auto')."
    )
    memory_interval_steps: PositiveInt | None = Field(
        None,
        description="Resolved in-memory snapshot interval (the planner fills it for checkpoint.memory_interval "
        "'auto'); None: the in-memory tier is off.",
    )
    flops_per_step: float | None = Field(
        None,
        gt=0,
        description="Model FLOPs of one global batch (the planner's), which each rank's MFU divides by; "
        "resolved with the job, so that no rank builds a plan.",
    )

    @model_validator(mode="after")
    def _check_layout(self) -> JobConfig:
        errors = layout_errors(self.model, self.parallel, self.train, self.hardware)
        errors += muon_errors(self.optimizer, self.model, self.parallel)
        if errors:
            raise ValueError("; ".join(errors))
        return self

    def model_fingerprint(self) -> str:
        """Hash of the model's shape: a checkpoint with another fingerprint cannot be resumed into this job.

        Fields added since checkpoints were first written count only when set away from their default,
        so a model that leaves them alone keeps the fingerprint its existing checkpoints carry.
        """
        shape = self.model.model_dump()
        for fields, defaults in ((shape, LATER_MODEL_DEFAULTS), (shape["moe"] or {}, LATER_MOE_DEFAULTS)):
            for name, default in defaults.items():
                if fields.get(name, default) == default:
                    fields.pop(name, None)
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
