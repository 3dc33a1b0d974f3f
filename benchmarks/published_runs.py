"""Published training runs the planner is checked against, with the source of every figure.

Each row is a configuration someone trained, expressed in tessera's spec terms, and the throughput
they published, as tokens/s per chip. Where a source gives TFLOP/s per chip or MFU instead, tokens/s
follows from the FLOPs per token it counted: model FLOPs (6N + 12·L·s·d, PaLM Appendix B: MaxText,
Llama 3, PaLM) or hardware FLOPs with recomputation (Megatron-LM's 96·B·s·l·h² formula), both of
which tessera's planner computes identically (tests/test_plan.py checks Megatron's).

``split`` says which rows the catalog's fitted defaults were tuned on ("calibration": the TPU
matmul efficiency and the GPU matmul knee, see ``trainer/backends/chips.py``) and which were not
looked at while tuning ("held_out"); tests/test_plan.py holds the held-out rows to the goals.

Expressing a run in tessera's terms needs a few approximations, each noted in the row:
- GPT (Megatron-LM) is a 4h GELU MLP with tied embeddings: we use a SwiGLU of width 8h/3 (same
  FLOPs and parameters, 3·h·f = 8h²) and untied embeddings (pipeline stages cannot share them).
- Micro-batch sizes Megatron-LM did not publish are assumed: 1 under a pipeline, the whole local
  batch (no gradient accumulation) without one, or the largest power of two that fits.
- Llama 3 405B has 126 layers and dropped one block from its first and last stages to balance them
  (Dubey et al. 2024, §3.3.2); we give it 128 layers and 8 per stage, the same stage work.
- PaLM's attention (48 heads of 256, multi-query) is narrower than its width: we keep its width and
  parameter count with 48 heads of 384 over 12 key/value heads and a SwiGLU of 66,732 (a matmul
  parameter count within 0.1% of PaLM's).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.backends.chips import get_chip
from trainer.config import CheckpointConfig, HardwareConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.plan import make_plan
from trainer.plan.timing import Overlap

MEGATRON = "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters', Table 1"
LLAMA3 = "Dubey et al. 2024, 'The Llama 3 Herd of Models', Table 4"
TITAN_H100 = "pytorch/torchtitan docs/performance.md (Dec 2024 runs, Grand Teton H100 96 GB)"
TITAN_A100 = "pytorch/torchtitan docs/performance.md (2024 runs, 64 A100 80 GB)"
TITAN_405B = "pytorch/torchtitan docs/performance.md (Llama 3.1 405B on 128 H100, no Float8)"
MAXTEXT_V5P = (
    "AI-Hypercomputer/maxtext Runtime Performance Results, TPU v5p; configs MaxText/configs/v5p/*.sh"
)
MAXTEXT_V5E = "AI-Hypercomputer/maxtext MaxText/configs/v5e/README.md; configs MaxText/configs/v5e/*.sh"
PALM = "Chowdhery et al. 2022, 'PaLM', §4 and Table 3 (46.2% MFU on 6144 TPU v4)"

Metric = Literal["tokens_per_s", "model_tflops", "hardware_tflops", "mfu"]
Split = Literal["calibration", "held_out"]


@dataclass(frozen=True)
class PublishedRun:
    """One published configuration: the spec sections it maps to and the figure that was published."""

    name: str
    source: str
    split: Split
    model: dict[str, Any]
    parallel: dict[str, Any]
    train: dict[str, Any]
    cluster: dict[str, Any]
    metric: Metric
    value: float  # in the metric's unit: tokens/s per chip, TFLOP/s per chip, or a fraction of peak
    note: str = ""
    overlap: Overlap = field(
        default_factory=Overlap
    )  # what the framework overlapped (trainer.plan.timing.Overlap)
    trained: bool = True  # it ran at this scale, so the planner must predict that it fits
    # False where the framework keeps far fewer activations than tessera's torch block, whose saved
    # tensors the memory model counts exactly (tests/test_plan.py): then "fits" says whether *tessera*
    # could run the layout, and the fit goal does not apply.
    memory_comparable: bool = True


def gpt(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    """Megatron-LM's GPT configurations as compute-equivalent Llama blocks (see module docstring)."""
    return dict(
        preset="custom",
        n_layers=layers,
        dim=hidden,
        n_heads=heads,
        n_kv_heads=heads,
        ffn_dim=8 * hidden // 3,
        vocab_size=51200,
        rope_theta=1e4,
    )


def megatron(
    name: str,
    split: Split,
    model: dict[str, Any],
    t: int,
    p: int,
    gpus: int,
    batch: int,
    tflops: float,
    micro: int,
) -> PublishedRun:
    """A Table 1 row: A100 80 GB (Selene: 8 per node, 8 × HDR 200 Gb/s), seq 2048, fp16, full recompute."""
    return PublishedRun(
        name=name,
        source=MEGATRON,
        split=split,
        model=model,
        parallel=dict(
            dp_replicate=gpus // (t * p),
            tp=t,
            pp=p,
            activation_checkpointing="full",
            mixed_precision="bf16",
        ),
        train=dict(seq_len=2048, global_batch_size=batch, micro_batch_size=micro),
        cluster=dict(accelerator="gpu", chip="a100-80gb", nodes=gpus // 8, chips_per_node=8),
        metric="hardware_tflops",
        value=tflops,
        note=f"micro-batch {micro} assumed (not published)",
        # Megatron-LM 2021 all-reduced gradients after the pipeline flush (§4.1; overlap came later).
        overlap=Overlap(grads_in_backward=False),
    )


def llama(dim: int, layers: int, heads: int, kv: int, ffn: int, vocab: int) -> dict[str, Any]:
    return dict(
        preset="custom",
        n_layers=layers,
        dim=dim,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=ffn,
        vocab_size=vocab,
        rope_theta=5e5,
    )


LLAMA2_13B = llama(5120, 40, 40, 40, 13824, 32000)
LLAMA2_70B = llama(8192, 80, 64, 8, 28672, 32000)
LLAMA3_405B_BALANCED = llama(16384, 128, 128, 8, 53248, 128256)
MAXTEXT_SCALE = {  # MaxText global_parameter_scale → dims (pyconfig.get_individual_scales, base.yml)
    32: llama(8192, 32, 64, 64, 28672, 32000),
    64: llama(8192, 64, 64, 64, 28672, 32000),
    256: llama(16384, 64, 128, 128, 57344, 32000),
    512: llama(16384, 128, 128, 128, 57344, 32000),
}


def titan(
    name: str,
    split: Split,
    source: str,
    model: dict[str, Any],
    parallel: dict[str, Any],
    train: dict[str, Any],
    chip: str,
    gpus: int,
    tokens_per_s: float,
    **extra: Any,
) -> PublishedRun:
    return PublishedRun(
        name=name,
        source=source,
        split=split,
        model=model,
        parallel={"mixed_precision": "bf16", **parallel},
        train=train,
        cluster=dict(accelerator="gpu", chip=chip, nodes=gpus // 8, chips_per_node=8),
        metric="tokens_per_s",
        value=tokens_per_s,
        **extra,
    )


def maxtext(
    name: str,
    split: Split,
    source: str,
    scale: int,
    chip: str,
    chips: int,
    slices: int,
    tp: int,
    per_device_batch: int,
    ac: str,
    tflops: float,
) -> PublishedRun:
    """MaxText rows: FSDP over ICI within a slice (× TP), data parallel over DCN across slices; seq 2048."""
    return PublishedRun(
        name=name,
        source=source,
        split=split,
        model=MAXTEXT_SCALE[scale],
        parallel=dict(
            dp_replicate=slices,
            dp_shard=chips // (slices * tp),
            tp=tp,
            activation_checkpointing=ac,
            mixed_precision="bf16",
        ),
        train=dict(
            seq_len=2048,
            global_batch_size=per_device_batch * chips,
            micro_batch_size=per_device_batch * tp,
        ),
        cluster=dict(accelerator="tpu", chip=chip, nodes=chips // 4, chips_per_node=4),
        metric="model_tflops",
        value=tflops,
        note="remat_policy minimal → selective, full → full; XLA fuses and rematerialises "
        "below tessera's block, so the fit goal does not apply",
        memory_comparable=False,
    )


RUNS: list[PublishedRun] = [
    # Megatron-LM Table 1: (params, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU).
    megatron("megatron-1.7b", "calibration", gpt(24, 2304, 24), 1, 1, 32, 512, 137, micro=16),
    megatron("megatron-3.6b", "held_out", gpt(30, 3072, 32), 2, 1, 64, 512, 138, micro=16),
    megatron("megatron-7.5b", "calibration", gpt(36, 4096, 32), 4, 1, 128, 512, 142, micro=16),
    megatron("megatron-18.4b", "held_out", gpt(40, 6144, 48), 8, 1, 256, 1024, 135, micro=8),
    megatron("megatron-39.1b", "calibration", gpt(48, 8192, 64), 8, 2, 512, 1536, 138, micro=1),
    megatron("megatron-76.1b", "held_out", gpt(60, 10240, 80), 8, 4, 1024, 1792, 140, micro=1),
    megatron("megatron-145.6b", "calibration", gpt(80, 12288, 96), 8, 8, 1536, 2304, 148, micro=1),
    megatron("megatron-310.1b", "held_out", gpt(96, 16384, 128), 8, 16, 1920, 2160, 155, micro=1),
    megatron("megatron-529.6b", "calibration", gpt(105, 20480, 128), 8, 35, 2520, 2520, 163, micro=1),
    megatron("megatron-1008b", "held_out", gpt(128, 25600, 160), 8, 64, 3072, 3072, 163, micro=1),
    # Llama 3 405B pre-training, Table 4 (TP 8, CP 1, PP 16; seq 8192; 16M tokens per batch; H100
    # 80 GB at 700 W): 430 TFLOP/s per GPU on 8,192 GPUs (DP 64), 400 on 16,384 (DP 128). FSDP without
    # resharding after forward (§3.3.2); the interleaved schedule's chunks per stage are not published
    # (8, one block per chunk, assumed: it is what makes the 8K→16K drop as small as published); full recomputation assumed (our activation model needs it to fit 80 GB).
    *(
        PublishedRun(
            name=f"llama3-405b-{gpus}",
            source=LLAMA3,
            split=split,
            model=LLAMA3_405B_BALANCED,
            parallel=dict(
                dp_shard=gpus // 128,
                tp=8,
                pp=16,
                pp_schedule="interleaved_1f1b",
                pp_virtual_stages=8,
                activation_checkpointing="full",
                mixed_precision="bf16",
                reshard_after_forward=False,
            ),
            train=dict(seq_len=8192, global_batch_size=2048, micro_batch_size=1),
            cluster=dict(accelerator="gpu", chip="h100-sxm", nodes=gpus // 8, chips_per_node=8),
            metric="model_tflops",
            value=tflops,
            note="126 layers as 128 (balanced first/last stages); v=8 and full AC assumed",
        )
        for gpus, tflops, split in ((8192, 430, "calibration"), (16384, 400, "held_out"))
    ),
    # torchtitan, Llama 3.1 8B on Grand Teton H100s, local batch 2, seq 8192, selective AC (Tables 1, 3).
    *(
        titan(
            f"torchtitan-8b-h100-{gpus}gpu{'-compile' if compiled else ''}",
            split,
            TITAN_H100,
            dict(preset="llama3-8b"),
            dict(dp_shard=gpus, activation_checkpointing="selective", compile=compiled),
            dict(seq_len=8192, global_batch_size=2 * gpus, micro_batch_size=2),
            "h100-96gb",
            gpus,
            tokens,
        )
        for gpus, compiled, tokens, split in (
            (8, False, 5762, "calibration"),
            (8, True, 6667, "held_out"),
            (128, False, 5605, "held_out"),
            (128, True, 6514, "calibration"),
        )
    ),
    titan(
        "torchtitan-405b-h100-128gpu",
        "held_out",
        TITAN_405B,
        dict(preset="llama3-405b"),
        dict(dp_shard=16, tp=8, activation_checkpointing="full"),
        dict(seq_len=8192, global_batch_size=32, micro_batch_size=2),
        "h100-96gb",
        128,
        109,
    ),
    # torchtitan on 64 A100 80 GB, FSDP only, seq 8192 (Llama 3) / 4096 (Llama 2).
    titan(
        "torchtitan-llama3-8b-a100",
        "calibration",
        TITAN_A100,
        dict(preset="llama3-8b"),
        dict(dp_shard=64, activation_checkpointing="selective"),
        dict(seq_len=8192, global_batch_size=64, micro_batch_size=1),
        "a100-80gb",
        64,
        2973,
    ),
    titan(
        "torchtitan-llama3-70b-a100",
        "held_out",
        TITAN_A100,
        dict(preset="llama3-70b"),
        dict(dp_shard=64, activation_checkpointing="full"),
        dict(seq_len=8192, global_batch_size=64, micro_batch_size=1),
        "a100-80gb",
        64,
        331,
    ),
    titan(
        "torchtitan-llama2-13b-a100-noac",
        "held_out",
        TITAN_A100,
        LLAMA2_13B,
        dict(dp_shard=64, activation_checkpointing="none"),
        dict(seq_len=4096, global_batch_size=128, micro_batch_size=2),
        "a100-80gb",
        64,
        2162,
        memory_comparable=False,
        note="torchtitan's 2024 RMSNorm saved ~6 B per element of d where tessera's block saves ~16 "
        "(fp32 input, normalized tensor and rstd): tessera would need full or selective AC here",
    ),
    titan(
        "torchtitan-llama2-13b-a100-selective",
        "held_out",
        TITAN_A100,
        LLAMA2_13B,
        dict(dp_shard=64, activation_checkpointing="selective"),
        dict(seq_len=4096, global_batch_size=128, micro_batch_size=2),
        "a100-80gb",
        64,
        1904,
    ),
    titan(
        "torchtitan-llama2-70b-a100",
        "calibration",
        TITAN_A100,
        LLAMA2_70B,
        dict(dp_shard=64, activation_checkpointing="full"),
        dict(seq_len=4096, global_batch_size=128, micro_batch_size=2),
        "a100-80gb",
        64,
        353,
    ),
    # MaxText on TPU v5p (v5p-N has N/2 chips): TFLOP/s per chip from the results table.
    maxtext("maxtext-32b-v5p-128", "calibration", MAXTEXT_V5P, 32, "tpu-v5p", 64, 1, 4, 7, "selective", 328),
    maxtext("maxtext-64b-v5p-128", "held_out", MAXTEXT_V5P, 64, "tpu-v5p", 64, 1, 4, 3, "selective", 323),
    maxtext(
        "maxtext-256b-v5p-1024", "calibration", MAXTEXT_V5P, 256, "tpu-v5p", 512, 1, 8, 1, "selective", 316
    ),
    maxtext("maxtext-512b-v5p-1024", "held_out", MAXTEXT_V5P, 512, "tpu-v5p", 512, 1, 8, 2, "full", 294),
    # MaxText on TPU v5e-256 slices (256 chips each), FSDP within a slice, DP across slices over DCN.
    maxtext("maxtext-32b-v5e-1x256", "calibration", MAXTEXT_V5E, 32, "tpu-v5e", 256, 1, 1, 4, "full", 132),
    maxtext("maxtext-32b-v5e-8x256", "held_out", MAXTEXT_V5E, 32, "tpu-v5e", 2048, 8, 1, 4, "full", 125),
    maxtext("maxtext-32b-v5e-32x256", "held_out", MAXTEXT_V5E, 32, "tpu-v5e", 8192, 32, 1, 4, "full", 119),
    maxtext("maxtext-64b-v5e-1x256", "held_out", MAXTEXT_V5E, 64, "tpu-v5e", 256, 1, 1, 2, "full", 118),
    maxtext("maxtext-64b-v5e-32x256", "calibration", MAXTEXT_V5E, 64, "tpu-v5e", 8192, 32, 1, 2, "full", 99),
    # PaLM 540B: 2 pods × 3,072 TPU v4, 12-way model parallel × 256-way FSDP per pod, data parallel
    # across pods; seq 2048, batch 2048 sequences; 46.2% MFU (57.8% HFU with rematerialisation).
    PublishedRun(
        name="palm-540b-v4-6144",
        source=PALM,
        split="held_out",
        model=dict(
            preset="custom",
            n_layers=118,
            dim=18432,
            n_heads=48,
            n_kv_heads=12,
            ffn_dim=66732,
            vocab_size=256000,
            rope_theta=1e4,
            tie_embeddings=True,
        ),
        parallel=dict(
            dp_replicate=2, dp_shard=256, tp=12, activation_checkpointing="full", mixed_precision="bf16"
        ),
        train=dict(seq_len=2048, global_batch_size=2048, micro_batch_size=4),
        cluster=dict(accelerator="tpu", chip="tpu-v4", nodes=1536, chips_per_node=4),
        metric="mfu",
        value=0.462,
        note="attention re-shaped to tessera's head_dim = dim / n_heads, parameters kept (docstring)",
    ),
]


def published_tokens_per_chip(
    run: PublishedRun, flops_per_token: float, hardware_flops_per_token: float, peak: float
) -> float:
    """The published figure as tokens/s per chip, through the FLOPs per token the source counted."""
    if run.metric == "tokens_per_s":
        return run.value
    if run.metric == "model_tflops":
        return run.value * 1e12 / flops_per_token
    if run.metric == "hardware_tflops":
        return run.value * 1e12 / hardware_flops_per_token
    return run.value * peak / flops_per_token


def evaluate(run: PublishedRun) -> dict[str, Any]:
    """Plan the run with the catalog's defaults; compare tokens/s per chip with the published figure."""
    hardware = HardwareConfig(**run.cluster)
    plan = make_plan(
        ModelConfig(**run.model),
        ParallelConfig(**run.parallel),
        TrainConfig(**run.train),
        hardware,
        CheckpointConfig(),
        overlap=run.overlap,
    )
    tokens = plan.tokens_per_step
    published = published_tokens_per_chip(
        run, plan.flops_per_token, plan.hardware_flops_per_step / tokens, get_chip(plan.chip).peak_bf16_flops
    )
    predicted = plan.tokens_per_second / plan.chips
    return {
        "name": run.name,
        "split": run.split,
        "chip": plan.chip,
        "chips": plan.chips,
        "layout": plan.layout,
        "published_tokens_per_s_per_chip": round(published, 2),
        "predicted_tokens_per_s_per_chip": round(predicted, 2),
        "ratio": round(predicted / published, 4),
        "predicted_mfu": round(plan.mfu, 4),
        "fits": plan.fits,
        "trained": run.trained,
        "memory_comparable": run.memory_comparable,
        "memory_gb": round(plan.memory_per_chip_bytes.total / 1e9, 1),
        "source": run.source,
        "note": run.note,
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst |predicted/published − 1|, and the fit and over-prediction checks, for rows."""
    errors = [abs(row["ratio"] - 1) for row in rows]
    return {
        "rows": len(rows),
        "median_error": round(statistics.median(errors), 4),
        "worst_error": round(max(errors), 4),
        "max_over_prediction": round(max(row["ratio"] for row in rows) - 1, 4),
        "trained_rows_predicted_to_fit": all(
            row["fits"] for row in rows if row["trained"] and row["memory_comparable"]
        ),
    }
