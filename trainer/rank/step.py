"""One training step: forward and backward over the micro-batches, clip, optimizer; nothing around it.

What surrounds a step (metrics, checkpoints, snapshots, goodput, preemption, the watchdog) is the
loop's, in :func:`trainer.train.run_steps`; the step only computes the next weights, so reading it
in one screen tells what a step trains.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.config import JobConfig
from trainer.failures import UserError
from trainer.parallel import ParallelModel
from trainer.rank.fault_injection import FaultInjector
from trainer.rank.optim import build_scheduler
from trainer.rank.step_hooks import after_optimizer_step

if TYPE_CHECKING:
    from trainer.rank.replica_ft import ReplicaGroup


class PhaseClock:
    """Seconds spent in each phase of one step (``data_s``, ``forward_backward_s``, ...), written with
    the step's metrics so that a slow step, or a regression in a benchmark, names the phase it is in."""

    def __init__(self, began: float) -> None:
        self.last = began
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[f"{phase}_s"] = now - self.last
        self.last = now


@dataclass(frozen=True)
class StepOutput:
    loss: float
    grad_norm: float  # before clipping
    lr: float  # the rate this step applied


class TrainStep:
    """The step of ``job`` on this rank's ``model`` and ``optimizers``, after ``steps_done`` steps.

    Micro-batching (gradient accumulation) and a pipeline schedule live in
    :meth:`ParallelModel.forward_backward`; with replica fault tolerance the gradients are averaged
    across the replica groups, and a batch a lost replica interrupted is computed again.
    """

    def __init__(
        self,
        job: JobConfig,
        model: ParallelModel,
        optimizers: list[torch.optim.Optimizer],
        micro_batches: int,
        steps_done: int,
        faults: FaultInjector,
        replicas: ReplicaGroup | None = None,
    ) -> None:
        self.job, self.model, self.optimizers = job, model, optimizers
        self.micro_batches, self.faults, self.replicas = micro_batches, faults, replicas
        # The learning-rate schedule is a function of the step: rebuilt at the step a run resumes from.
        self.schedulers = [
            build_scheduler(opt, job.optimizer, job.train.steps, steps_done=steps_done) for opt in optimizers
        ]
        self.max_norm = job.optimizer.grad_clip or math.inf  # inf: never clip
        self.first = True  # out of memory on a process's first step is the job's size, not the machine

    def __call__(
        self, step: int, inputs: torch.Tensor, targets: torch.Tensor, clock: PhaseClock
    ) -> StepOutput:
        """Train ``step`` on this rank's slice of the global batch; ``clock`` times its phases."""
        loss = self.forward_backward(inputs, targets)
        while self.replicas is not None and not self.replicas.average(self.model.parts, loss):
            for optimizer in self.optimizers:  # a replica was lost mid-step: this batch again
                optimizer.zero_grad(set_to_none=True)
            loss = self.forward_backward(inputs, targets)
        loss_value = finite(self.faults.loss(step, loss).item(), step, self.job)
        clock.lap("forward_backward")
        grad_norm = self.model.clip_grad_norm_(self.max_norm).item()
        clock.lap("clip")
        lr = self.optimizers[0].param_groups[0]["lr"]
        for optimizer, scheduler in zip(self.optimizers, self.schedulers, strict=True):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        # Per-step module state, e.g. the MoE routing bias.
        after_optimizer_step(self.model.parts, self.model.mesh)
        clock.lap("optimizer")
        return StepOutput(loss_value, grad_norm, lr)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The global batch's loss, its gradient accumulated over the micro-batches."""
        first, self.first = self.first, False
        try:
            return self.model.forward_backward(inputs, targets, self.micro_batches)
        except torch.OutOfMemoryError as exc:
            if not first:
                raise
            raise UserError(
                "out of memory on the first step; lower train.micro_batch_size, enable "
                "parallel.activation_checkpointing, or shard more (parallel.dp_shard / tp / pp)"
            ) from exc


def finite(loss: float, step: int, job: JobConfig) -> float:
    """``loss``, unless it is NaN or infinite: then the run stops with advice, before the update."""
    if not math.isfinite(loss):
        raise UserError(
            f"loss is {loss} at step {step}; lower optimizer.lr (now {job.optimizer.lr:g}), "
            f"raise optimizer.warmup_steps, or check the data around step {step}"
        )
    return loss
