"""Per-chip shapes of one layout: what each chip holds and processes, shared by every estimate."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from trainer.config import Accelerator, ModelConfig, OptimizerName, ParallelConfig, TrainConfig
from trainer.plan.params import ParamCounts, count_params


@dataclass(frozen=True)
class Geometry:
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    accelerator: Accelerator  # the optimizer's default implementation differs on CPU (see memory.py)
    optimizer: OptimizerName = "adamw"

    @cached_property
    def counts(self) -> ParamCounts:
        return count_params(self.model)

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and gathered weights: FSDP2's param_dtype."""
        return 2 if self.parallel.mixed_precision == "bf16" else 4

    @property
    def microbatches(self) -> int:
        """Micro-batches per step per data-parallel rank: gradient accumulation, or the pipeline's m."""
        return self.train.global_batch_size // (self.parallel.dp * self.train.micro_batch_size)

    @property
    def microbatch_tokens(self) -> int:
        """Tokens of one micro-batch on one chip: context parallelism gives each chip 1/cp of every sequence."""
        return self.train.micro_batch_size * self.train.seq_len // self.parallel.cp

    @property
    def fsdp_degree(self) -> int:
        """Ranks FSDP shards over: dp_shard×cp (context-parallel ranks hold the same parameters)."""
        return self.parallel.dp_shard * self.parallel.cp

    @property
    def replicated(self) -> bool:
        """DDP, not FSDP, holds the parameters: as ``trainer.parallel.replicate.replicates`` decides
        (pure fp32 data parallelism; this module stays free of torch)."""
        par = self.parallel
        splits = (par.dp_shard, par.cp, par.tp, par.pp, par.ep)
        return all(degree == 1 for degree in splits) and par.mixed_precision == "fp32"

    @property
    def layers_per_stage(self) -> int:
        return self.model.n_layers // self.parallel.pp

    @property
    def stage_params(self) -> int:
        """Parameters of the heaviest pipeline stage (first: + embedding; last: + norm and output)."""
        counts, layers = self.counts, self.layers_per_stage * self.counts.per_layer
        if self.parallel.pp == 1:
            return counts.total
        return layers + max(counts.embedding, counts.final_norm + counts.output)

    @property
    def muon_matrices(self) -> list[tuple[int, int]]:
        """(rows, cols) of the whole 2-D weights Muon orthogonalises on the heaviest stage: each block's
        wq, wk, wv, wo, w1, w3, w2 (``trainer.rank.muon``; tp=1 and dense only). None under AdamW."""
        if self.optimizer != "muon":
            return []
        model = self.model
        d, f = model.dim, model.ffn_dim
        q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
        return [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)] * self.layers_per_stage

    @property
    def chip_params(self) -> float:
        """Parameters a chip owns: its stage, split by TP (norm gains are few) and sharded by FSDP."""
        return self.stage_params / (self.parallel.tp * self.fsdp_degree)

    @property
    def reshard_after_forward(self) -> bool:
        """As ``trainer.parallel`` sets it: the spec's choice (ZeRO-3 or ZeRO-2-like), except that
        pipelines always keep a stage gathered between a micro-batch's fwd and bwd."""
        return self.parallel.reshard_after_forward and self.parallel.pp == 1

    @property
    def root_params_tp(self) -> float:
        """The heaviest stage's parameters outside its blocks (embedding, output, final norm) on one TP
        rank: FSDP's root unit, gathered once per step and not resharded."""
        return (self.stage_params - self.layers_per_stage * self.counts.per_layer) / self.parallel.tp

    @property
    def layer_params_tp(self) -> float:
        """One block's parameters on one TP rank: the unit FSDP all-gathers. Under EP a rank gathers
        only its 1/ep of the routed experts (from the other dp_shard/ep ranks holding them)."""
        routed = self.counts.routed / self.model.n_layers * (1 - 1 / self.parallel.ep)
        return (self.counts.per_layer - routed) / self.parallel.tp
