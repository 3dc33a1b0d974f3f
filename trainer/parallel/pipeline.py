"""Pipeline parallelism with ``torch.distributed.pipelining``.

A stage is a deep copy of the whole model with the other stages' layers deleted, so FQNs match the
unsplit model. With v virtual stages per rank (interleaved 1F1B), rank r holds stages r, r+pp, ...:
the "loop" placement, which the interleaved schedule expects.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from trainer.config import PipelineSchedule
from trainer.model import Transformer

Schedule = PipelineScheduleSingle | PipelineScheduleMulti


def stage_indices(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    return [pp_rank + chunk * pp for chunk in range(virtual_stages)]


def split_stage(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """A copy of model holding only stage's contiguous share of layers (and embedding/head if at an end)."""
    per_stage = len(model.layers) // n_stages
    owned = range(stage * per_stage, (stage + 1) * per_stage)
    chunk = copy.deepcopy(model)
    for key in list(chunk.layers):
        if int(key) not in owned:
            del chunk.layers[key]
    if stage > 0:
        chunk.tok_embeddings = None
    if stage < n_stages - 1:
        chunk.norm = None
        chunk.output = None
    return chunk


def build_stages(
    parts: list[Transformer], indices: list[int], n_stages: int, device: torch.device, group: ProcessGroup
) -> list[PipelineStage]:
    return [
        PipelineStage(part, index, n_stages, device, group=group)
        for part, index in zip(parts, indices, strict=True)
    ]


def build_schedule(
    stages: list[PipelineStage],
    n_microbatches: int,
    name: PipelineSchedule,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> Schedule:
    """The schedule runs fwd+bwd of all micro-batches and divides grads by n_microbatches (scale_grads)."""
    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    (stage,) = stages
    return single(stage, n_microbatches, loss_fn=loss_fn)
