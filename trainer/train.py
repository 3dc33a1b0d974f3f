"""The torchrun entry point: train one job, resuming from its latest committed checkpoint.

Every way to run it is the same module under a launcher::

    # one host, 2 processes (what `tessera train SPEC --run-dir DIR` runs after writing DIR/job.json)
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m trainer.train --spec DIR/job.json --run-dir DIR
    # several hosts (or several agents on 127.0.0.1): one agent per host, one shared rendezvous
    python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29400 --rdzv-id RUN -m trainer.train --spec job.json --run-dir DIR
    # Kubernetes: the same command in every pod of the rendered job (deployments/templates)

Outputs in the run directory: ``metrics.jsonl`` (the loss curve), ``checkpoints/`` (unless
``checkpoint.url`` points elsewhere) and ``status.json`` once the last step is checkpointed.
Exit codes follow :mod:`trainer.failures`: 0 done, 3 user error, 4 hang, 5 infrastructure failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.elastic.multiprocessing.errors import record

from trainer.backends import get_backend, get_chip
from trainer.backends.base import local_rank
from trainer.checkpoint import CheckpointError, CheckpointManager, ModelOptimizerState, RNGState
from trainer.config import JobConfig
from trainer.data import build_loader
from trainer.data.errors import DataError
from trainer.failures import (
    EXIT_INFRA,
    EXIT_OK,
    EXIT_USER_ERROR,
    UserError,
    is_infra_error,
    record_user_error,
    restarted_after_user_error,
)
from trainer.faults import FaultInjector
from trainer.metrics import MetricsWriter
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallel import ParallelModel, build_parallel_model
from trainer.plan import plan_for_job, resolve_checkpoint_interval
from trainer.telemetry import gather_host_times, straggler_fields
from trainer.watchdog import StepWatchdog

log = logging.getLogger("tessera.train")

METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"


@dataclass(frozen=True)
class TrainResult:
    final_step: int
    final_loss: float | None  # None when the run was already complete on start
    resumed_from: int | None
    final_checkpoint: str | None


def train(job: JobConfig, run_dir: Path) -> TrainResult:
    """Train ``job`` to ``job.train.steps`` on the current torchrun process group, resuming if possible."""
    backend = get_backend(job.hardware.accelerator)
    backend.require()
    backend.init_process_group(job.faults.collective_timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != job.parallel.world_size:
        raise UserError(
            f"torchrun started {world} processes but the spec's parallel degrees give world size "
            f"{job.parallel.world_size}; launch with --nproc-per-node {job.parallel.world_size} or change the spec"
        )
    device = backend.device(local_rank())
    torch.manual_seed(job.seed)

    model = build_parallel_model(job, device)
    optimizers = [build_optimizer(part, job.optimizer) for part in model.parts]
    loader = build_loader(job, model.dp_rank, model.dp_size)
    # Model, optimizer, RNG and loader position: everything a bitwise-identical resume needs. The
    # learning-rate schedule is a function of the step, rebuilt from the checkpoint's step below.
    state: dict[str, Stateful] = {
        "app": ModelOptimizerState(model.parts, optimizers),
        "rng": RNGState(rank),
        "loader": loader,
    }
    faults = FaultInjector.from_env()
    ckpt = CheckpointManager(
        job.checkpoint.url or str(run_dir / "checkpoints"),
        job.checkpoint,
        job.checkpoint_interval_steps or resolve_checkpoint_interval(job),
        job.model_fingerprint(),
        world,
        rank,
        layout=job.parallel.model_dump(),
        wrap_writer=lambda writer, step: faults.checkpoint_writer(writer, step, rank, world),
    )
    n_micro = job.train.global_batch_size // (model.dp_size * job.train.micro_batch_size)
    tokens_per_step = job.train.global_batch_size * job.train.seq_len
    flops_per_step = plan_for_job(job).flops_per_step
    peak_flops = world * get_chip(job.hardware.chip).peak_bf16_flops
    max_norm = job.optimizer.grad_clip or math.inf  # inf: measure the norm, never clip
    loss_value = None
    try:
        restored = ckpt.restore(state)
        start = 0
        if restored is not None:
            start = restored.step
            log.info("resumed from step %d (%s)", start, restored.url)
        schedulers = [
            build_scheduler(opt, job.optimizer, job.train.steps, steps_done=start) for opt in optimizers
        ]
        metrics = MetricsWriter(run_dir / METRICS_FILE, resumed_step=start, enabled=rank == 0)
        with StepWatchdog(job.faults.step_timeout_s, rank) as watchdog, metrics:
            for step in range(start + 1, job.train.steps + 1):
                watchdog.arm(step)
                began = time.perf_counter()
                faults.before_step(step, rank, world)
                inputs, targets = next(loader)
                logged = step % job.train.log_every == 0 or step == job.train.steps
                host_times = gather_host_times(time.perf_counter() - began, device) if logged else []
                loss = _forward_backward(model, inputs, targets, n_micro, first=step == start + 1)
                loss_value = faults.loss(step, loss).item()
                if not math.isfinite(loss_value):
                    raise UserError(
                        f"loss is {loss_value} at step {step}; lower optimizer.lr (now {job.optimizer.lr:g}), "
                        f"raise optimizer.warmup_steps, or check the data around step {step}"
                    )
                grad_norm = model.clip_grad_norm_(max_norm).item()
                lr = optimizers[0].param_groups[0]["lr"]
                for optimizer, scheduler in zip(optimizers, schedulers, strict=True):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                step_time = time.perf_counter() - began
                if logged:
                    metrics.write(
                        {
                            "step": step,
                            "time": time.time(),  # wall clock: lines up a run's metrics with its logs
                            "loss": loss_value,
                            "lr": lr,
                            "grad_norm": grad_norm,
                            "tokens": step * tokens_per_step,
                            "tokens_per_s": tokens_per_step / step_time,
                            "step_time_s": step_time,
                            "mfu": flops_per_step / (step_time * peak_flops),
                            **(straggler_fields(step, host_times) if rank == 0 else {}),
                        }
                    )
                # A checkpoint write may legitimately outlast a step; the collective timeout bounds it.
                watchdog.disarm()
                ckpt.maybe_save(
                    step,
                    state,
                    meta={"tokens": step * tokens_per_step, "loss": loss_value},
                    force=step == job.train.steps,
                )
    finally:
        ckpt.close()  # also on errors: finish committing the last good checkpoint
        loader.close()
    dist.barrier()  # rank 0 commits asynchronously: after this, every rank sees the final checkpoint
    final = ckpt.latest()
    result = TrainResult(job.train.steps, loss_value, start or None, final.url if final else None)
    if rank == 0:
        (run_dir / STATUS_FILE).write_text(json.dumps({"state": "completed", **asdict(result)}, indent=2))
    return result


def _forward_backward(
    model: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor, n_micro: int, first: bool
) -> torch.Tensor:
    """One step's loss; out of memory on the first step is the job's size, not the machine's fault."""
    try:
        return model.forward_backward(inputs, targets, n_micro)
    except torch.OutOfMemoryError as exc:
        if not first:
            raise
        raise UserError(
            "out of memory on the first step; lower train.micro_batch_size, enable "
            "parallel.activation_checkpointing, or shard more (parallel.dp_shard / tp / pp)"
        ) from exc


def load_job(path: Path) -> JobConfig:
    try:
        return JobConfig.model_validate_json(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read job spec {path}: {exc.strerror}") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'job'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise UserError(f"job spec {path} is invalid: {problems}") from None


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spec", type=Path, required=True, help="JobConfig JSON (tessera train writes it).")
    parser.add_argument("--run-dir", type=Path, required=True, help="Stable run directory; reused to resume.")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(message)s", force=True, stream=sys.stdout
    )
    previous = restarted_after_user_error(args.run_dir)
    if previous is not None:  # it would fail the same way again: use up no time, no restart budget
        print(f"error: [rank {rank}] {previous}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    try:
        result = train(load_job(args.spec), args.run_dir)
    except Exception as exc:
        if is_infra_error(exc):  # the store, a peer or a loader worker failed: a retry can fix it
            print(
                f"error: [rank {rank}] infrastructure failure, retryable: {exc}", file=sys.stderr, flush=True
            )
            return EXIT_INFRA
        expected = isinstance(exc, UserError | CheckpointError | DataError)
        first_line = next(iter(str(exc).splitlines()), "")
        record_user_error(args.run_dir, first_line if expected else f"{type(exc).__name__}: {first_line}")
        if not expected:
            raise  # a bug: @record keeps the traceback for the launcher's report
        # One line, no traceback: the message names the input and the fix (exit code: trainer.failures).
        print(f"error: [rank {rank}] {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    log.info("done: step %d, final checkpoint %s", result.final_step, result.final_checkpoint)
    return EXIT_OK


if __name__ == "__main__":  # the guard process-mode async checkpoint saves need (they re-import __main__)
    sys.exit(main())
