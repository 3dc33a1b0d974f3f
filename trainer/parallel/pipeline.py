"""Pipeline parallelism with ``torch.distributed.pipelining``.

A stage is a deep copy of the whole model with the other stages' layers deleted, so FQNs match the
unsplit model. With v virtual stages per rank, rank r holds stages r, r+pp, ... (the "loop" placement
of interleaved 1F1B and interleaved zero bubble), except under the V-shaped schedules (ZB-V,
DualPipeV), where rank r holds stages r and 2pp−1−r: the first and last stage share a rank, so a
micro-batch's forward runs down the ranks and back up, and its backward follows the same V.

The zero-bubble schedules split each backward into an input-gradient pass (on the critical path)
and a weight-gradient pass that fills the bubbles; torch runs the split with autograd, so any module
works, but not compiled ones (the spec refuses that combination).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from trainer.config import PipelineSchedule
from trainer.layout_checks import V_SCHEDULES

Schedule = PipelineScheduleSingle | PipelineScheduleMulti


MULTI_STAGE = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
SINGLE_STAGE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_indices(pp_rank: int, pp: int, virtual_stages: int, schedule: PipelineSchedule) -> list[int]:
    """The stages pp_rank holds: V placement for ZB-V/DualPipeV, loop placement otherwise."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + chunk * pp for chunk in range(virtual_stages)]


def split_stage(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
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
    parts: list[nn.Module], indices: list[int], n_stages: int, device: torch.device, group: ProcessGroup
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
    if name in MULTI_STAGE:
        return MULTI_STAGE[name](stages, n_microbatches, loss_fn=loss_fn)
    (stage,) = stages
    return SINGLE_STAGE[name](stage, n_microbatches, loss_fn=loss_fn)
