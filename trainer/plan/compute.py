"""Compute seconds of one micro-batch on one chip, part by part: blocks, recompute, head, optimizer.

Shapes follow ``trainer/models/llama/model.py`` under TP with sequence parallelism (Megatron-style, Korthikanti et
al. 2022): column-parallel matmuls see the whole micro-batch's T tokens and 1/t of the output
features, row-parallel ones 1/t of the inner dimension; norms, residual adds and casts run on the
sequence shard (T/t tokens). Backward runs each matmul twice (input and weight gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.plan.kernels import (
    attention_seconds,
    elementwise_seconds,
    gemm_seconds,
    memory_seconds,
    with_launches,
)
from trainer.plan.layout import Geometry
from trainer.plan.params import active_ffn_dim, attention_shape
from trainer.plan.profile import HardwareProfile, MatmulPrecision

FP32 = 4
BACKWARD_ATTENTION = 2.5  # flash attention backward / forward FLOPs (FlashAttention-2, §3.1.2)
# Kernels per block forward, counted from trainer/models/llama/model.py under torch 2.13: 7 matmuls, SDPA, and the
# element-wise ops (two fp32 RMSNorms of 6 ops each, RoPE's 10, two residual adds, SwiGLU's 2, views and
# casts); compiled blocks fuse the element-wise ops into ~6 Triton/C++ kernels. Backward launches ~2×.
BLOCK_KERNELS = {False: 45, True: 14}
BACKWARD_KERNELS = 2
# model.attention=document where FlexAttention has no backward (every accelerator but GPUs, see
# trainer/models/documents.py): SDPA with a dense mask computes every tile, twice the causal kernel's.
DENSE_MASK_WORK = 2.0


@dataclass(frozen=True)
class BlockSeconds:
    """One block, one micro-batch, one chip: forward, backward, and what checkpointing recomputes.

    weight_grad: the part of backward that computes weight gradients (the W pass zero-bubble pipeline
    schedules defer into idle slots); the rest is the input-gradient (B) pass.
    """

    forward: float
    backward: float
    recompute: float
    weight_grad: float


def block_matmuls(geo: Geometry) -> list[tuple[float, float, float]]:
    """(m, n, k) of the block's forward matmuls on one TP rank: the attention's projections (Llama: wq,
    wk, wv, wo; MLA: its query, latent and output projections, ``attention_shape``), then w1, w3, w2."""
    model, t, tokens = geo.model, geo.parallel.tp, geo.microbatch_tokens
    d, f = model.dim, active_ffn_dim(model)
    attention = [
        (tokens, out, inner / t) if row else (tokens, out / t, inner)
        for out, inner, row in attention_shape(model).projections
    ]
    return [*attention, (tokens, f / t, d), (tokens, f / t, d), (tokens, d, f / t)]


def elementwise_bytes(geo: Geometry) -> float:
    """HBM bytes of one block's forward element-wise work on one chip.

    Eager (counted from trainer/models/llama/model.py): each RMSNorm upcasts to fp32 and makes ~7 fp32 passes over
    d (14 for both); the two residual adds 3 passes each; RoPE ~6 passes over q and k; SwiGLU's silu and
    product 5 passes over f. Compiled blocks fuse them: norm + residual read and write once (3 passes
    each), RoPE 3, SwiGLU 3 (read both inputs, write the product). Backward moves about twice as much.
    """
    model, e, t = geo.model, geo.compute_bytes, geo.parallel.tp
    d, f, rope = model.dim, active_ffn_dim(model), attention_shape(model).rope_width
    if geo.parallel.compile:
        per_token = e * (6 * d + 3 * rope + 3 * f)
    else:
        per_token = FP32 * 14 * d + e * (6 * d + 6 * rope + 5 * f)
    return geo.microbatch_tokens * per_token / t


def fsdp_copy_bytes(geo: Geometry) -> float:
    """FSDP2's copies around each block's collectives: the all-gather's copy-out of the e-byte layer
    (read + write) and the reduce-scatter's fp32 copy-in of its gradient (read e, write 4). None under
    DDP, which computes on the parameters themselves."""
    if geo.replicated:
        return 0.0
    layer = geo.layer_params_tp
    return layer * (2 * geo.compute_bytes + geo.compute_bytes + FP32)


def block_attention_seconds(geo: Geometry, hw: HardwareProfile) -> float:
    """Forward attention of one block on one chip: its tp share of the heads, and 1/cp of the causal
    attention over whole sequences (context parallelism's ring steps are load-balanced).

    Document attention on GPUs is priced as causal: FlexAttention skips the tiles outside every
    document, so this is an upper bound, exact when a document fills its sample (the planner does not
    see document lengths). Elsewhere its dense mask costs DENSE_MASK_WORK × causal.
    """
    model, par = geo.model, geo.parallel
    width = attention_shape(model).score_width / par.tp
    whole = attention_seconds(geo.train.micro_batch_size, geo.train.seq_len, width, hw, par.mixed_precision)
    dense_mask = model.attention == "document" and geo.accelerator != "gpu"
    return whole / par.cp * (DENSE_MASK_WORK if dense_mask else 1.0)


def matmul_precisions(geo: Geometry) -> list[MatmulPrecision]:
    """What each of :func:`block_matmuls` computes in: fp8 for the nn.Linear layers parallel.float8
    converts (all seven in a dense block; an MoE block's experts run grouped matmuls, which
    torchao.float8 leaves in the compute dtype), else FSDP's compute dtype."""
    dtype, attention = geo.parallel.mixed_precision, len(attention_shape(geo.model).projections)
    if geo.parallel.float8 == "none":
        return [dtype] * (attention + 3)
    ffn: MatmulPrecision = dtype if geo.model.moe is not None else "fp8"
    return ["fp8"] * attention + [ffn] * 3


def block_seconds(geo: Geometry, hw: HardwareProfile) -> BlockSeconds:
    """Forward and backward of one block; recompute is a forward under full checkpointing and the
    element-wise part of one under selective (its policy keeps matmul and attention outputs)."""
    shapes = list(zip(block_matmuls(geo), matmul_precisions(geo), strict=True))
    matmuls = sum(gemm_seconds(m, n, k, hw, precision) for (m, n, k), precision in shapes)
    weight_grad = sum(gemm_seconds(k, n, m, hw, precision) for (m, n, k), precision in shapes)
    backward_matmuls = weight_grad + sum(
        gemm_seconds(m, k, n, hw, precision) for (m, n, k), precision in shapes
    )
    attention = block_attention_seconds(geo, hw)
    elementwise = elementwise_seconds(elementwise_bytes(geo), hw)
    copies = memory_seconds(fsdp_copy_bytes(geo), hw)
    kernels = BLOCK_KERNELS[geo.parallel.compile]
    forward = with_launches(matmuls + attention + elementwise + copies / 2, kernels, hw)
    backward = with_launches(
        backward_matmuls + BACKWARD_ATTENTION * attention + 2 * elementwise + copies / 2,
        BACKWARD_KERNELS * kernels,
        hw,
    )
    recompute = {
        "none": 0.0,
        "selective": with_launches(elementwise, kernels - len(block_matmuls(geo)) - 1, hw),
        "full": forward,
    }[geo.parallel.activation_checkpointing]
    return BlockSeconds(forward, backward, recompute, weight_grad)


def head_seconds(geo: Geometry, hw: HardwareProfile) -> float:
    """Output projection and loss, forward and backward, on the last stage.

    The (T × d)·(d × V/t) matmul three times, and the cross-entropy's memory traffic over T·V/t logits:
    written in e, upcast and log-softmaxed in fp32 (~4 fp32 passes), its gradient formed and cast
    back (~3 passes): ≈ 28 + 2e bytes per logit.
    """
    model, t, tokens = geo.model, geo.parallel.tp, geo.microbatch_tokens
    precision = geo.parallel.mixed_precision
    m, n, k = tokens, model.vocab_size / t, model.dim
    matmuls = gemm_seconds(m, n, k, hw, precision) + gemm_seconds(m, k, n, hw, precision)
    matmuls += gemm_seconds(k, n, m, hw, precision)
    loss = memory_seconds(tokens * n * (7 * FP32 + 2 * geo.compute_bytes), hw)
    return with_launches(matmuls + loss, 20, hw)


def embedding_seconds(geo: Geometry, hw: HardwareProfile) -> float:
    """Embedding lookup (T·d·e written) and its backward scatter-add into fp32 (T·d·(e + 4) moved)."""
    nbytes = geo.microbatch_tokens * geo.model.dim * (2 * geo.compute_bytes + FP32)
    return with_launches(memory_seconds(nbytes, hw), 4, hw)


# AdamW's foreach step reads p, g, m, v and writes p, m, v in fp32 (28 B/param); clipping reads the
# gradients for the norm and scales them (12 B/param): 40 B per local parameter.
OPTIMIZER_BYTES_PER_PARAM = 40
# On CPU torch runs AdamW's per-tensor loop (foreach kernels are for accelerators only), one unfused op
# at a time, counted from torch.optim.adam._single_tensor_adam in fp32: decoupled weight decay p.mul_
# (8 B/param), exp_avg.lerp_(g) (12), exp_avg_sq.mul_ (8) then .addcmul_(g, g) (12), the denominator
# v.sqrt() / √bc₂ + ε in three passes through temporaries (24), p.addcdiv_(m, denom) (16): 80 B; with
# clipping's 12, 92 B per local parameter.
HOST_OPTIMIZER_BYTES_PER_PARAM = 92
OPTIMIZER_KERNELS_PER_TENSOR = 12  # torch's per-tensor AdamW loop (what the trainer runs on CPU)
TENSORS_PER_BLOCK = 9  # 7 projections + 2 norm gains


def optimizer_seconds(geo: Geometry, hw: HardwareProfile) -> float:
    """The optimizer step: memory-bound over the chip's parameters (foreach kernels on accelerators, the
    per-tensor loop's passes on CPU); on CPU plus per-tensor dispatch. Muon's element-wise passes are
    priced as AdamW's (it has fewer: a bound), plus its Newton-Schulz matmuls."""
    tensors = TENSORS_PER_BLOCK * geo.layers_per_stage + 3
    kernels = OPTIMIZER_KERNELS_PER_TENSOR * (tensors if hw.host_bound else 1)
    per_param = HOST_OPTIMIZER_BYTES_PER_PARAM if hw.host_bound else OPTIMIZER_BYTES_PER_PARAM
    elementwise = with_launches(memory_seconds(per_param * geo.chip_params, hw), kernels, hw)
    ns = newton_schulz_gemms(geo)
    return elementwise + with_launches(sum(gemm_seconds(*mnk, hw, "bf16") for mnk in ns), len(ns), hw)


MUON_NS_STEPS = 5  # trainer.rank.muon.NS_STEPS (torch.optim.Muon's default; a test holds them equal)


def newton_schulz_gemms(geo: Geometry) -> list[tuple[int, int, int]]:
    """(m, n, k) of Muon's bf16 matmuls on one chip per step. Every rank orthogonalises every whole
    matrix of its stage (``trainer.rank.muon`` gathers them), so FSDP does not divide this work. Per
    iteration on a matrix with short side m and long side n: X·Xᵀ (m, m, n), A·A (m, m, m) and B·X
    (m, n, m), i.e. 4m²n + 2m³ FLOPs."""
    gemms = []
    for rows, cols in geo.muon_matrices:
        m, n = min(rows, cols), max(rows, cols)
        gemms += [(m, m, n), (m, m, m), (m, n, m)] * MUON_NS_STEPS
    return gemms
