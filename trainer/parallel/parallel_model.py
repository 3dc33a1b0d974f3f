"""What the training loop holds: this rank's model chunks plus one fwd+bwd and one clip call.

The loop never branches on the layout: ``forward_backward`` runs a pipeline schedule when pp > 1 and
plain gradient accumulation otherwise, and both leave the gradient of the global mean token loss.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from trainer.config import JobConfig, PipelineSchedule
from trainer.data.loader import document_eos_id
from trainer.models import family_of, param_count
from trainer.models.moe import auxiliary_loss_scale
from trainer.parallel.context import shard_sequence
from trainer.parallel.grad_norm import clip_grad_norm_
from trainer.parallel.mesh import build_mesh, dp_coordinates
from trainer.parallel.replicate import sync_gradients_on_last
from trainer.rank.local_tensor import local_tensor
from trainer.rank.loss import token_loss

if TYPE_CHECKING:  # torch.distributed.pipelining imports torch._dynamo: a second of start-up, only for pp
    from torch.distributed.pipelining import PipelineStage

    from trainer.parallel.pipeline import Schedule

# Up to here (~4 GiB fp32) every rank initializes the whole model before sharding, so all layouts
# start from bit-identical weights. Larger models are initialized shard by shard after parallelizing
# (deterministic per layout, never materialized whole).
FULL_INIT_MAX_PARAMS = 2**30


def loss_context(mesh: DeviceMesh) -> AbstractContextManager[None]:
    """Where the loss and its backward run: torch's ``loss_parallel`` when tp splits the logits
    (trainer/parallel/tensor.py), so the softmax reduces over tp ranks instead of gathering them."""
    return loss_parallel() if mesh["tp"].size() > 1 else nullcontext()


@dataclass
class ParallelModel:
    """This rank's share of the model on a (pp, dp_replicate, dp_shard, cp, tp) mesh.

    parts: the model chunks this rank holds (one unless pp with virtual stages); optimizers and
    checkpoints take these. dp_rank/dp_size: this rank's place in the flattened data-parallel group,
    which decides its slice of every global batch (cp, tp and pp peers share a slice).
    """

    parts: list[nn.Module]
    mesh: DeviceMesh
    dp_rank: int
    dp_size: int
    device: torch.device
    stages: list[PipelineStage] = field(default_factory=list)
    pp_schedule: PipelineSchedule = "1f1b"
    _schedules: dict[int, Schedule] = field(default_factory=dict, repr=False)

    def forward_backward(self, inputs: Tensor, targets: Tensor, n_microbatches: int) -> Tensor:
        """Accumulate the gradient of the global-batch mean token loss; return that loss on every rank.

        inputs/targets: this dp rank's [global_batch / dp, T] slice; it is split into n_microbatches.
        """
        if inputs.shape[0] % n_microbatches:
            raise ValueError(
                f"{inputs.shape[0]} local sequences do not split into {n_microbatches} micro-batches"
            )
        # Context-parallel ranks share a dp slice and each trains on its chunks of it (all of it when cp = 1).
        cp = self.mesh["cp"]
        inputs, targets = (shard_sequence(t.to(self.device), cp) for t in (inputs, targets))
        if self.stages:
            local = self._pipeline_step(inputs, targets, n_microbatches)
        else:
            local = self._accumulate(inputs, targets, n_microbatches)
        return self._global_mean(local)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Global grad norm over every rank's parameters (same on all ranks); clips to max_norm if > 0."""
        return clip_grad_norm_(self.parts, max_norm, self._pp_group)

    @property
    def _pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["pp"].get_group() if self.stages else None

    def _accumulate(self, inputs: Tensor, targets: Tensor, n_microbatches: int) -> Tensor:
        (model,) = self.parts
        total = torch.zeros((), device=self.device)
        whole = self.mesh["dp_shard"].size() * self.mesh["cp"].size() == 1
        chunks = zip(inputs.chunk(n_microbatches), targets.chunk(n_microbatches), strict=True)
        for i, (x, y) in enumerate(chunks):
            sync_gradients_on_last(model, last=i == n_microbatches - 1, whole=whole)
            with loss_context(self.mesh):
                with auxiliary_loss_scale(1 / n_microbatches):  # e.g. MoE balancing: weighed like this loss
                    loss = model(x, y)  # the head and loss in one (the family module's forward)
                (loss / n_microbatches).backward()
            total += local_tensor(loss.detach())  # loss_parallel's is a replicated DTensor
        return total / n_microbatches

    def _pipeline_step(self, inputs: Tensor, targets: Tensor, n_microbatches: int) -> Tensor:
        if n_microbatches not in self._schedules:
            from trainer.parallel.pipeline import build_schedule

            self._schedules[n_microbatches] = build_schedule(
                self.stages, n_microbatches, self.pp_schedule, token_loss
            )
        schedule = self._schedules[n_microbatches]
        first = any(stage.is_first for stage in self.stages)
        last = any(stage.is_last for stage in self.stages)
        losses: list[Tensor] = []
        with loss_context(self.mesh):  # the schedule runs the loss and its backward
            schedule.step(
                *([inputs] if first else []),
                target=targets if last else None,
                losses=losses if last else None,
                return_outputs=False,
            )
        if not last:
            return torch.zeros((), device=self.device)
        return torch.stack([local_tensor(loss.detach()).float() for loss in losses]).mean()

    def _global_mean(self, local: Tensor) -> Tensor:
        """Average over data- and context-parallel ranks, then hand the last pipeline stage's value to every stage."""
        for dim in ("dp_replicate", "dp_shard", "cp"):
            if self.mesh[dim].size() > 1:
                dist.all_reduce(local, group=self.mesh[dim].get_group())
        local /= self.dp_size * self.mesh["cp"].size()  # cp ranks hold equal token counts
        if self.stages:
            # Only the rank holding the last stage has a loss (pp rank 0 under a V placement); others hold 0.
            dist.all_reduce(local, group=self.mesh["pp"].get_group())
        return local


def build_parallel_model(
    job: JobConfig, device: torch.device, init_whole_max_params: int = FULL_INIT_MAX_PARAMS
) -> ParallelModel:
    """Build, initialize from job.seed, and parallelize the model per job.parallel on this rank.

    Models up to init_whole_max_params are initialized whole before sharding (identical on every
    layout); larger ones are built on ``meta`` and only this rank's shards are ever allocated.
    """
    cfg, family = job.parallel, family_of(job.model)
    mesh = build_mesh(cfg, device.type)
    with torch.device("meta"):
        model = family.build(job.model, job.train.seq_len)
    model.eos_id = document_eos_id(job)
    init_whole = param_count(model) <= init_whole_max_params
    if init_whole:
        model.to_empty(device=device)
        model.init_weights(job.seed)

    pipeline = None
    if cfg.pp > 1:
        from trainer.parallel import pipeline

        n_stages = cfg.pp * cfg.pp_virtual_stages
        indices = pipeline.stage_indices(
            mesh.get_local_rank("pp"), cfg.pp, cfg.pp_virtual_stages, cfg.pp_schedule
        )
    chunks = [pipeline.split_stage(model, index, n_stages) for index in indices] if pipeline else [model]
    parts = [family.parallelize(chunk, mesh, cfg) for chunk in chunks]
    if not init_whole:
        for part in parts:
            part.to_empty(device=device)
            part.init_weights(job.seed)

    stages = (
        pipeline.build_stages(parts, indices, n_stages, device, mesh["pp"].get_group()) if pipeline else []
    )
    dp_rank, dp_size = dp_coordinates(mesh)
    return ParallelModel(parts, mesh, dp_rank, dp_size, device, stages, cfg.pp_schedule)
