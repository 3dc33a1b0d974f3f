"""Llama's parallelize plan: TP with sequence parallelism, composed with CP, EP, AC, compile and FSDP.

``parallelize`` composes the parallelisms in torchtitan's order. TP first (it rewrites parameters into
tp-sharded DTensors), CP (ring attention and the local RoPE positions, inside the blocks), EP (experts
sharded over ep ranks, with their own FSDP units), then activation checkpointing and compile (they
wrap the already-parallel blocks), FSDP last (it shards whatever parameters it finds over dp).
A layout that splits nothing in fp32 (pure data parallelism, or one process) gets DDP instead
(``trainer/parallel/replicate.py``): FSDP with one shard per replica pays gathers and DTensors for no
memory saving. Every other layout gets FSDP even when dp = 1, for the same parameter types and mixed
precision.

The TP plan (Megatron-style, torchtitan's): Attention/MLP input projections are column-wise (each rank owns whole heads / a slice of the hidden
width), output projections row-wise; between blocks activations stay sharded along the sequence so
norms run on 1/tp of the tokens. Embedding, norms and output are on the same tp mesh too, so after
FSDP every parameter lives on one 2-D (dp, tp) mesh and a global grad norm is a single reduction.
The output head leaves the logits split over the vocabulary and the loss is computed that way
(Megatron's vocab-parallel cross-entropy, torch's ``loss_parallel``): replicated logits would cost
each rank an all-gather and the whole loss over T·V, 4 GiB per 8k tokens of a 128k vocabulary.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.config import ParallelConfig
from trainer.models.llama.model import Transformer, TransformerBlock
from trainer.models.moe import MoE
from trainer.parallel.activation import apply_ac
from trainer.parallel.compile import apply_compile
from trainer.parallel.context import apply_cp
from trainer.parallel.expert import apply_ep
from trainer.parallel.float8 import apply_float8
from trainer.parallel.fsdp import apply_fsdp, precision_policy
from trainer.parallel.mesh import check_mesh, dp_mesh
from trainer.parallel.replicate import apply_ddp, replicates


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig) -> Transformer:
    check_mesh(mesh)
    if cfg.tp > 1:
        apply_tp(model, mesh["tp"])
    if cfg.cp > 1:
        apply_cp(model, mesh["cp"])
    reshard = (
        cfg.reshard_after_forward and cfg.pp == 1
    )  # a pipeline stage stays gathered across micro-batches
    if cfg.ep > 1:  # the experts' own FSDP units, before the blocks' claim the dense parameters
        apply_ep(model, mesh, cfg.ep, precision_policy(cfg.mixed_precision), reshard)
    apply_float8(model, cfg.float8)  # swaps nn.Linear modules: before AC/compile/FSDP wrap them
    apply_ac(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    if replicates(cfg):
        return apply_ddp(model, mesh)
    return apply_fsdp(model, dp_mesh(mesh), cfg.mixed_precision, reshard_after_forward=reshard)


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> Transformer:
    """Shard model over tp_mesh in place. Sequence length must be divisible by the tp degree."""
    edges = {}
    if model.tok_embeddings is not None:
        edges["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        edges["norm"] = SequenceParallel()
    if model.output is not None:
        # Logits stay split over the vocabulary (a DTensor): the loss runs under loss_parallel
        # (parallel_model.loss_context), so no rank gathers or holds all T·V of them.
        edges["output"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        )
        model.vocab_parallel = True
    parallelize_module(model, tp_mesh, edges)
    if model.cfg.tie_embeddings:
        # parallelize_module distributed the two uses separately; both are Shard(0) of [vocab, dim].
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        apply_tp_block(block, tp_mesh)
    return model


def apply_tp_block(block: TransformerBlock, tp_mesh: DeviceMesh) -> TransformerBlock:
    """Shard one block over tp_mesh in place: it takes and returns its rank's sequence shard
    (``tessera calibrate`` times a lone block this way)."""
    block_plan = {
        "attention_norm": SequenceParallel(),
        # (x, rope, documents): only x is a sequence shard; the RoPE table and the documents are
        # plain values every rank holds whole.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    dense_plan = {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    # An MoE layer runs whole on each tp rank over the gathered sequence (its experts are split by ep and
    # FSDP, not by tp): plain tensors in, this rank's sequence shard out.
    moe_plan = {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
        )
    }
    ffn_plan = moe_plan if isinstance(block.feed_forward, MoE) else dense_plan
    parallelize_module(block, tp_mesh, {**block_plan, **ffn_plan})
    return block
