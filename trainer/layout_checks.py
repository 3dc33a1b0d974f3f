"""Cross-field checks of a training layout: parallel degrees against the model, the batch and the chips.

The config models check their own fields; what spans several of them (``parallel.tp`` must divide
``model.n_heads``, the batch must split over data-parallel ranks and pipeline micro-batches, fp8 needs
an fp8 chip) lives here, in one place that the job config, the deployment spec, the planner's layout
search and elastic resizing all call. Each error names the field and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.backends.chips import CHIPS
from trainer.divisors import divisors

if TYPE_CHECKING:
    from trainer.config import HardwareConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig

# Schedules that drive several stages per rank; the V-shaped ones exactly two (rank r: stages r, 2pp−1−r).
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")
# Schedules that split backward into input- and weight-gradient passes (torch refuses compiled stages).
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def layout_errors(
    model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hw: HardwareConfig
) -> list[str]:
    """Cross-field checks shared by the job config and the deployment spec; each names field and fix."""
    errors: list[str] = []
    if parallel.world_size != hw.world_size:
        errors.append(
            f"parallel: dp_replicate×dp_shard×cp×tp×pp = {parallel.dp_replicate}×{parallel.dp_shard}×"
            f"{parallel.cp}×{parallel.tp}×{parallel.pp} = {parallel.world_size}, but cluster nodes×chips_per_node = {hw.nodes}×"
            f"{hw.chips_per_node} = {hw.world_size}; make the degrees multiply to the chip count"
        )
    for name in ("n_heads", "n_kv_heads"):
        value = getattr(model, name)
        if value % parallel.tp:
            errors.append(
                f"parallel.tp={parallel.tp} must divide model.{name}={value}; use a tp from {divisors(value)}"
            )
    if model.n_layers % (parallel.pp * parallel.pp_virtual_stages):
        errors.append(
            f"parallel.pp×pp_virtual_stages={parallel.pp * parallel.pp_virtual_stages} must divide "
            f"model.n_layers={model.n_layers}; use pp from {divisors(model.n_layers)}"
        )
    errors += pipeline_schedule_errors(parallel, train)
    errors += expert_parallel_errors(model, parallel)
    errors += context_parallel_errors(model, parallel, train)
    errors += float8_errors(parallel, hw)
    errors += document_attention_errors(model, parallel)
    errors += qwen_attention_errors(model, parallel)
    errors += family_layout_errors(model, parallel)
    if model.tie_embeddings and parallel.pp > 1:
        # The embedding sits on the first stage and the output head on the last: they cannot share a tensor.
        errors.append("model.tie_embeddings needs parallel.pp=1; set tie_embeddings=false or pp=1")
    per_step = parallel.dp * train.micro_batch_size
    if train.global_batch_size % per_step:
        errors.append(
            f"train.global_batch_size={train.global_batch_size} must be divisible by dp×micro_batch_size="
            f"{parallel.dp}×{train.micro_batch_size}={per_step}; e.g. global_batch_size="
            f"{max(per_step, train.global_batch_size // per_step * per_step)}"
        )
    elif parallel.pp > 1:
        microbatches = train.global_batch_size // per_step
        if microbatches < parallel.pp or microbatches % parallel.pp:
            errors.append(
                f"pipeline micro-batches global/(dp×micro)={microbatches} must be a positive multiple of "
                f"parallel.pp={parallel.pp}; raise train.global_batch_size or lower train.micro_batch_size"
            )
    return errors


def family_layout_errors(model: ModelConfig, parallel: ParallelConfig) -> list[str]:
    """What the model's family refuses to parallelize (``ModelFamily.check_layout``)."""
    from trainer.models import family_of  # the families import config, which imports this module

    check = family_of(model).check_layout
    return check(model, parallel) if check is not None else []


def pipeline_schedule_errors(parallel: ParallelConfig, train: TrainConfig) -> list[str]:
    """What torch.distributed.pipelining's schedules need of stages per rank and micro-batches."""
    schedule, v = parallel.pp_schedule, parallel.pp_virtual_stages
    errors = []
    if v > 1 and schedule not in MULTI_STAGE_SCHEDULES:
        errors.append(
            f"parallel.pp_virtual_stages > 1 needs a multi-stage parallel.pp_schedule "
            f"({', '.join(MULTI_STAGE_SCHEDULES)}), not {schedule}"
        )
    if parallel.pp > 1 and schedule in V_SCHEDULES and v != 2:
        errors.append(
            f"parallel.pp_schedule={schedule} places exactly two stages per rank in a V; "
            "set parallel.pp_virtual_stages=2"
        )
    if parallel.pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES and parallel.compile:
        errors.append(
            f"parallel.pp_schedule={schedule} splits backward into input and weight passes, which torch "
            "does not support on compiled blocks; set parallel.compile=false or pp_schedule=interleaved_1f1b"
        )
    per_step = parallel.dp * train.micro_batch_size
    microbatches = train.global_batch_size // per_step
    if parallel.pp > 1 and schedule == "dualpipev" and microbatches < 2 * parallel.pp:
        errors.append(
            f"parallel.pp_schedule=dualpipev needs at least 2·pp={2 * parallel.pp} micro-batches (one per "
            f"stage), got global/(dp×micro)={microbatches}; raise train.global_batch_size or lower "
            "train.micro_batch_size"
        )
    return errors


def qwen_attention_errors(model: ModelConfig, parallel: ParallelConfig) -> list[str]:
    """qkv_bias and qk_norm (Qwen2/Qwen3) are not in the tensor-parallel plan: a q/k norm's gains would
    sit outside the tp mesh, and neither has a parity test under tp; refused rather than trained wrong."""
    used = [name for name in ("qkv_bias", "qk_norm") if getattr(model, name)]
    if parallel.tp == 1 or not used:
        return []
    return [
        f"model.{' and model.'.join(used)} with parallel.tp={parallel.tp} is not supported; set parallel.tp=1 "
        "(use dp_shard, cp or pp to split the model instead)"
    ]


def float8_errors(parallel: ParallelConfig, hw: HardwareConfig) -> list[str]:
    """fp8 needs fp8 matmul units, bf16 around them, and torchao's own TP plans (not wired in)."""
    recipe = parallel.float8
    if recipe == "none":
        return []
    errors = []
    # torchao.float8 runs on CUDA's fp8 matmul (torch._scaled_mm); Trainium2's fp8 is not reached by it.
    with_fp8 = [name for name, c in CHIPS.items() if c.peak_fp8_flops and c.accelerator == "gpu"]
    if hw.chip in CHIPS and hw.chip not in with_fp8:
        errors.append(
            f"parallel.float8={recipe} needs a GPU with fp8 matmuls, but chip {hw.chip!r} has none; "
            f"set parallel.float8=none or use one of {', '.join(with_fp8)}"
        )
    if parallel.mixed_precision != "bf16":
        errors.append(f"parallel.float8={recipe} needs parallel.mixed_precision=bf16")
    if parallel.tp > 1:
        errors.append(
            f"parallel.float8={recipe} with parallel.tp={parallel.tp} is not supported (fp8 tensor "
            "parallelism needs torchao's float8 TP plans); set tp=1 or float8=none"
        )
    return errors


def context_parallel_errors(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> list[str]:
    """CP gives each rank two of 2·cp equal sequence chunks (load balancing for the causal mask)."""
    if parallel.cp == 1:
        return []
    errors = []
    chunks = 2 * parallel.cp * parallel.tp  # sequence parallel splits each rank's share again by tp
    if train.seq_len % chunks:
        errors.append(
            f"train.seq_len={train.seq_len} must be divisible by 2·cp·tp={chunks} (each cp rank holds "
            f"2 of 2·cp chunks, split again over tp); e.g. seq_len={max(chunks, train.seq_len // chunks * chunks)}"
        )
    if parallel.pp > 1:
        errors.append(
            f"parallel.cp={parallel.cp} with parallel.pp={parallel.pp} is not supported (pipeline stages do "
            "not run ring attention); set pp=1 or cp=1"
        )
    if model.moe is not None:
        # Its load-balancing loss is per whole sequence, and expert FSDP does not average over cp ranks.
        errors.append(
            f"parallel.cp={parallel.cp} with a mixture-of-experts model (model.moe) is not supported; set cp=1"
        )
    if parallel.compile:
        errors.append(
            "parallel.compile with parallel.cp > 1 is not supported (ring attention's point-to-point "
            "exchange does not trace into a full graph); set compile=false"
        )
    return errors


def document_attention_errors(model: ModelConfig, parallel: ParallelConfig) -> list[str]:
    """Document masking is built from the token ids on the rank that embeds them, over whole rows."""
    if model.attention != "document":
        return []
    errors = []
    if parallel.cp > 1:
        errors.append(
            f"model.attention=document with parallel.cp={parallel.cp} is not supported (ring attention "
            "computes a causal mask over zigzag chunks and has no per-document mask); set parallel.cp=1 "
            "or model.attention=causal"
        )
    if parallel.pp > 1:
        errors.append(
            f"model.attention=document with parallel.pp={parallel.pp} is not supported (later pipeline "
            "stages receive hidden states, not the token ids the mask is built from); set parallel.pp=1 "
            "or model.attention=causal"
        )
    return errors


def expert_parallel_errors(model: ModelConfig, parallel: ParallelConfig) -> list[str]:
    """EP splits experts evenly over ranks that are FSDP shard ranks too (torchtitan's carving)."""
    if model.moe is not None and parallel.compile:  # tokens per expert are data-dependent: no full graph
        return [
            "model.moe does not compile per block (data-dependent expert splits); set parallel.compile=false"
        ]
    if model.moe is not None and model.moe.balance == "bias" and parallel.pp > 1:
        # torch 2.13's schedules infer stage shapes on their first step with a forward and backward of
        # made-up inputs, and an MoE layer counts routing loads in backward: they would skew the bias.
        return [
            f"model.moe.balance=bias with parallel.pp={parallel.pp} is not supported (the pipeline's shape "
            "inference would count made-up tokens into the expert loads); set balance: aux_loss or pp=1"
        ]
    if parallel.ep == 1:
        return []
    if model.moe is None:
        return [f"parallel.ep={parallel.ep} needs a mixture-of-experts model; set model.moe or parallel.ep=1"]
    errors = []
    if model.moe.n_experts % parallel.ep:
        errors.append(
            f"parallel.ep={parallel.ep} must divide model.moe.n_experts={model.moe.n_experts}; "
            f"use ep from {divisors(model.moe.n_experts)}"
        )
    if parallel.dp_shard % parallel.ep:
        errors.append(
            f"parallel.ep={parallel.ep} must divide parallel.dp_shard={parallel.dp_shard} (expert-parallel "
            f"ranks are carved out of the FSDP shard ranks); use ep from {divisors(parallel.dp_shard)}"
        )
    if parallel.cp > 1:  # the experts' FSDP group would also have to span cp, which is not built yet
        errors.append(
            f"parallel.ep={parallel.ep} with parallel.cp={parallel.cp} is not supported; set one to 1"
        )
    return errors


def muon_errors(optimizer: OptimizerConfig, model: ModelConfig, parallel: ParallelConfig) -> list[str]:
    """Layouts Muon is not built for: it orthogonalises whole 2-D matrices, gathered over FSDP's mesh."""
    if optimizer.name != "muon":
        return []
    errors = []
    if model.mla is not None:
        errors.append(
            "optimizer.name=muon is not wired for multi-head latent attention (model.mla, the DeepSeek "
            "family); set optimizer.name=adamw"
        )
    if model.moe is not None:
        errors.append(
            "optimizer.name=muon does not take MoE experts (3-D weight stacks); remove model.moe or set "
            "optimizer.name=adamw"
        )
    if parallel.tp > 1:
        errors.append(f"optimizer.name=muon needs parallel.tp=1 (got {parallel.tp}); set tp=1 or name=adamw")
    return errors
