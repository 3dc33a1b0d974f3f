"""HBM per chip: model states, activations and transient buffers, against the chip's HBM (the planner's memory model).

Model states (ZeRO accounting, Rajbhandari et al. 2020, §3.1): mixed-precision Adam costs
16 bytes/param — 2 (fp16 weights) + 2 (fp16 grads) + K=12 (fp32 master weights, momentum,
variance) — replicated on every data-parallel rank, or 16/N bytes/param when all three are sharded
over N ranks (ZeRO stage 3 = FSDP). Our trainer keeps the same 16 bytes but splits them differently,
because FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` stores the
*sharded* parameters in fp32 (they are the master copy) and makes bf16 copies only while a layer is
all-gathered for compute:

==================  ============  ============  ========================  ==========================
mixed_precision     params        grads         optimizer (AdamW m, v)    transient (buffers)
==================  ============  ============  ========================  ==========================
fp32                4 B/param     4 B/param     8 B/param                 fp32 all-gather of a layer
bf16                4 B/param     4 B/param     8 B/param                 bf16 all-gather of a layer
==================  ============  ============  ========================  ==========================

each sharded over ``dp_shard``×``cp`` and replicated over ``dp_replicate`` (HSDP), split by ``tp`` and by
pipeline stage. Context parallelism divides every activation by cp (a chip holds T/cp tokens of each
sequence; ``Geometry.microbatch_tokens``) and adds ring attention's buffers (``plan/context.py``). The totals equal ZeRO's 16·Ψ and 16·Ψ/N_d.

Peak, not sum: with one micro-batch per step, gradients are freed by ``zero_grad(set_to_none=True)``
and reappear as activations are freed in backward, so the fwd/bwd peak is at the start of backward
(no gradients yet), or, under full activation checkpointing, when backward rebuilds the first block
(nearly all gradients made by then); with gradient accumulation or a pipeline they live through
backward. The
optimizer step then holds all gradients plus AdamW's temporary (:func:`optimizer_temp_bytes`).
``total`` is the larger of the two phases (see :func:`estimate_memory`).

``optimizer.name: muon`` keeps one fp32 momentum (4 B/param) for the blocks' matrices instead of AdamW's
8, and adds the transient of orthogonalising one whole gathered matrix (:func:`newton_schulz_temp_bytes`).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from trainer.plan.context import ring_buffer_bytes
from trainer.plan.layout import Geometry
from trainer.plan.params import active_ffn_dim, attention_shape

FP32 = 4
STATE_BYTES = {"params": 4, "grads": 4, "optimizer": 8}  # per parameter, both precisions (see above)


class MemoryBreakdown(BaseModel):
    """Bytes per chip on the most loaded chip (the first pipeline stage)."""

    model_config = ConfigDict(frozen=True)

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float  # FSDP's unsharded params/grads, CP's K/V chunks, the document mask, the loss's fp32 log-probs and grads
    optimizer_temp: float  # AdamW's temporary during the step
    total: float  # peak over the fwd/bwd and optimizer phases (see module docstring)


def model_state_bytes(n_params: float, shard_degree: int) -> float:
    """Params + grads + Adam states of n_params parameters sharded over shard_degree ranks (16 B/param)."""
    return sum(STATE_BYTES.values()) * n_params / shard_degree


def layer_activation_bytes(geo: Geometry) -> tuple[float, float]:
    """Bytes one block saves for backward for one micro-batch on one chip: (attention part, MLP part).

    Derivation in the style of Korthikanti et al. 2022 ("Reducing Activation Recomputation", §4),
    for *our* block (``trainer/models/llama/model.py`` under torch 2.13), with s·b = T tokens per micro-batch,
    hidden d, SwiGLU width f, a query heads, e bytes per compute element (2 bf16, 4 fp32), t = tp with
    sequence parallelism. Each RMSNorm (computed in fp32 by torch's composite kernel) saves its input
    upcast to fp32 (4Td), the normalized fp32 tensor its gain multiplies (4Td) and the fp32 rstd
    (4T), all sequence-sharded under SP (/t); its e-byte output is saved by the next projections,
    *gathered* over t (DTensor saves the all-gathered input; Megatron would re-gather instead).
    Attention saves q (d wide), k and v at the GQA width d_kv (SDPA reads the grouped heads in place,
    ``enable_gqa``) and the SDPA output, which is the wo input (e·T·(2d + 2d_kv)/t), plus SDPA's fp32
    log-sum-exp (4Ta/t); flash-style SDPA never materializes the s² scores, so Korthikanti's 5as²b
    term is absent. SwiGLU saves w1x, silu(w1x), w3x and their product (4eTf/t). Residual adds save
    nothing. Total:

        A_layer = T·[(16d + 8 + 4a + 2ed + 2e·d_kv + 4ef)/t + 2ed]
                = sbd·(16 + 4e + 2e·d_kv/d + 4e·f/d) + 4sb(a + 2)      (t = 1; MHA, e = 2: sbd·(28 + 8f/d))

    versus Korthikanti's sbh·(34 + 5as/h) for GPT with dropout and materialized scores.
    """
    model, t, e = geo.model, geo.parallel.tp, geo.compute_bytes
    d, f, a, tokens = model.dim, active_ffn_dim(model), model.n_heads, geo.microbatch_tokens
    shape = attention_shape(model)  # MLA: see trainer/plan/params.py
    norm = tokens * ((2 * FP32 * d + FP32) / t + e * d)
    fp32 = shape.saved_fp32 + a + (shape.saved_in_fp32_only if e == FP32 else 0)
    attention = norm + tokens * (e * shape.saved + FP32 * fp32) / t
    mlp = norm + tokens * 4 * e * f / t
    return attention, mlp


def in_flight_microbatches(geo: Geometry) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak.

    GPipe runs all m forwards first; 1F1B holds p (Narayanan et al. 2021); interleaved 1F1B with v
    chunks holds p·(1 + (p−1)/(p·v)) stage-equivalents (Korthikanti et al. 2022, §4.2.3), and so does
    interleaved zero bubble (ZB-H1 keeps 1F1B's memory, Qi et al. 2024 §2.1). ZB-V holds 1F1B's p
    (ibid. §6); DualPipeV PP+1 chunks of half a stage with PP = 2p, i.e. p + ½ (DeepSeek-V3, Table 2).
    """
    p, m, v = geo.parallel.pp, geo.microbatches, geo.parallel.pp_virtual_stages
    if p == 1:
        return 1
    if geo.parallel.pp_schedule == "gpipe":
        return m
    if geo.parallel.pp_schedule in ("1f1b", "zbv_zero_bubble"):
        return min(p, m)
    if geo.parallel.pp_schedule == "dualpipev":
        return min(p + 0.5, m)
    return min(p + (p - 1) / v, m)


def selective_layer_bytes(geo: Geometry) -> float:
    """Bytes a block keeps under ``trainer.parallel.activation``'s selective policy (matmul/SDPA outputs).

    The block input (eTd/t, sequence-sharded), the column-parallel matmul outputs wq, wk, wv, w1, w3
    (e·(d + 2·d_kv + 2f)·T/t), SDPA's output and log-sum-exp (eTd/t + 4Ta/t), and the row-parallel
    outputs of wo and w2, which are full-size partial sums before their reduce-scatter (2eTd).
    """
    model, t, e = geo.model, geo.parallel.tp, geo.compute_bytes
    d, shape = model.dim, attention_shape(model)  # Llama: column-parallel outputs d + 2·d_kv, SDPA's d
    columns = sum(out for out, _, row in shape.projections if not row)
    sharded = e * (d + columns + shape.score_width + 2 * active_ffn_dim(model)) + FP32 * model.n_heads
    return geo.microbatch_tokens * (sharded / t + 2 * e * d)


def activation_bytes(geo: Geometry) -> tuple[float, float]:
    """(kept, recomputed): activations the first stage keeps across its in-flight micro-batches, and
    the transient of recomputing one block in backward.

    full keeps only each block's input (eTd/t); selective: see :func:`selective_layer_bytes`. Both
    rebuild one block's activations at a time in backward.
    """
    attention, mlp = layer_activation_bytes(geo)
    block_input = geo.microbatch_tokens * geo.compute_bytes * geo.model.dim / geo.parallel.tp
    kept = {
        "none": attention + mlp,
        "selective": selective_layer_bytes(geo),
        "full": block_input,
    }[geo.parallel.activation_checkpointing]
    recomputed = 0.0 if geo.parallel.activation_checkpointing == "none" else attention + mlp
    return geo.layers_per_stage * kept * in_flight_microbatches(geo), recomputed


def fsdp_buffer_bytes(geo: Geometry) -> float:
    """FSDP2's unsharded copies: the current and the prefetched layer gathered (2·e B/param) — or the
    whole stage when pipelining keeps it gathered (no reshard after forward) — and one layer's
    unsharded gradient in e bytes plus its fp32 copy for the reduce-scatter."""
    if geo.fsdp_degree == 1 and geo.parallel.mixed_precision == "fp32":
        return 0.0  # nothing to gather or cast
    e = geo.compute_bytes
    gathered = 2 * geo.layer_params_tp if geo.reshard_after_forward else geo.stage_params / geo.parallel.tp
    return gathered * e + geo.layer_params_tp * (e + FP32)


# A chunk's matmul is [rows, dim] x [dim, vocab]: thinner than this it no longer keeps a GPU's tiles
# busy (256 rows of 32K-vocab logits are 2 x 125 tiles of 128 x 256), and on a small model (vocab /
# dim in the hundreds) Liger's rule alone would cut chunks of a few tokens.
MIN_CHUNK_TOKENS = 256


def loss_chunk_tokens(tokens: int, vocab: int, dim: int) -> int:
    """Tokens per chunk of ``trainer.rank.loss.linear_cross_entropy``: a chunk's logits about as many elements
    as the hidden states it reads (Liger's rule), at least ``MIN_CHUNK_TOKENS``. Here so that the
    planner, which imports no torch, prices the chunk the trainer cuts."""
    return max(MIN_CHUNK_TOKENS, math.ceil(tokens / math.ceil(vocab / dim)))


def loss_buffer_bytes(geo: Geometry) -> float:
    """The head's and loss's transient bytes.

    Where the logits are split over vocab (loss-parallel TP) or handed to a pipeline schedule's loss,
    the loss keeps fp32 log-probabilities for backward and creates their gradient and the logits'
    gradient (in e): T·V·(8 + e)/t. Elsewhere the fused head and loss holds one chunk's logits (e) and
    their fp32 copy, turned into the gradient in place, plus the hidden states' gradient (eTd) and an
    fp32 accumulator for the output weight's gradient (4Vd)."""
    model, tokens, e = geo.model, geo.microbatch_tokens, geo.compute_bytes
    vocab, dim = model.vocab_size, model.dim
    if geo.parallel.tp > 1 or geo.parallel.pp > 1:
        return tokens * vocab * (2 * FP32 + e) / geo.parallel.tp
    rows = min(tokens, loss_chunk_tokens(tokens, vocab, dim))
    return rows * vocab * (FP32 + e) + tokens * dim * e + FP32 * vocab * dim


def document_mask_bytes(geo: Geometry) -> float:
    """model.attention=document off GPUs: one dense boolean mask [B, 1, T, T] per micro-batch, shared by
    every layer and kept for backward (trainer/models/documents.py). A GPU's FlexAttention block mask
    holds a few int32 per 128×128 tile (~16·B·(T/128)² bytes): negligible, counted as none."""
    if geo.model.attention != "document" or geo.accelerator == "gpu":
        return 0.0
    return geo.train.micro_batch_size * geo.train.seq_len**2


def optimizer_temp_bytes(geo: Geometry) -> float:
    """AdamW's step temporary (sqrt of the second moment). On CUDA the trainer runs the fused kernel,
    which needs none; on other accelerators torch's default is the foreach path, one fp32 tensor list as
    large as the local parameters; on CPU it is the per-tensor loop, so only the largest local tensor
    (the embedding or output matrix, or an MLP weight)."""
    if geo.accelerator == "gpu":
        return 0.0
    if geo.accelerator != "cpu":
        return FP32 * geo.chip_params
    model, par = geo.model, geo.parallel
    return FP32 * max(model.vocab_size, model.ffn_dim, model.dim) * model.dim / (par.tp * geo.fsdp_degree)


def optimizer_state_bytes(geo: Geometry) -> float:
    """AdamW's two fp32 moments per parameter; Muon keeps one momentum for the matrices it takes."""
    muon_params = sum(rows * cols for rows, cols in geo.muon_matrices) / geo.fsdp_degree
    return STATE_BYTES["optimizer"] * geo.chip_params - FP32 * muon_params


def newton_schulz_temp_bytes(geo: Geometry) -> float:
    """Muon's transient for its largest matrix (m ≤ n): the gathered bf16 matrix, and per iteration its
    Gram matrix, the polynomial of it and the new iterate (2·(2mn + 3m²)), plus the fp32 Nesterov update
    of the local shard; the matrices are done one at a time."""
    if not geo.muon_matrices:
        return 0.0
    m, n = max((min(shape), max(shape)) for shape in geo.muon_matrices)
    return 2 * (2 * m * n + 3 * m * m) + FP32 * m * n / geo.fsdp_degree


def estimate_memory(geo: Geometry) -> MemoryBreakdown:
    """Per-chip bytes. In backward the loss buffers are gone before the first block is recomputed, so
    the fwd/bwd peak has the larger of the two (the recompute with the gradients made by then) on top
    of the kept activations and FSDP buffers."""
    chip_params = geo.chip_params
    states = {name: per_param * chip_params for name, per_param in STATE_BYTES.items()}
    states["optimizer"] = optimizer_state_bytes(geo)
    kept, recomputed = activation_bytes(geo)
    # Ring attention's K/V chunks are, like FSDP's gathered layer, one block's transient; the document
    # mask lives through the whole forward and backward.
    fsdp = fsdp_buffer_bytes(geo) + ring_buffer_bytes(geo) + document_mask_bytes(geo)
    loss = loss_buffer_bytes(geo)
    # Muon's groups and AdamW's run one after the other: the larger transient of the two.
    optimizer_temp = max(optimizer_temp_bytes(geo), newton_schulz_temp_bytes(geo))
    grads_live_in_backward = geo.microbatches > 1 or geo.parallel.pp > 1
    live_grads = states["grads"] if grads_live_in_backward else 0.0
    # Without accumulation the gradients still fill up as backward goes: when full checkpointing
    # rebuilds the first block, every later block's gradient (nearly all of them) already exists.
    # (Selective rebuilds only the element-wise ops, well below ``recomputed``'s whole block, which
    # then already covers them: measured on tiny, tests/test_plan.py.)
    full_rebuild = geo.parallel.activation_checkpointing == "full" and not grads_live_in_backward
    grads_at_recompute = states["grads"] if full_rebuild else 0.0
    fwd_bwd = kept + fsdp + max(loss, recomputed + grads_at_recompute) + live_grads
    step = states["grads"] + optimizer_temp
    total = states["params"] + states["optimizer"] + max(fwd_bwd, step)
    return MemoryBreakdown(
        **states,
        activations=kept + recomputed,
        buffers=fsdp + loss,
        optimizer_temp=optimizer_temp,
        total=total,
    )
