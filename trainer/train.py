"""The torchrun entry point: train one job, resuming from its latest committed checkpoint.

Every way to run it is the same module under a launcher::

    # one host, 2 processes (what `tessera train SPEC --run-dir DIR` runs after writing DIR/job.json)
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m trainer.train --job DIR/job.json --run-dir DIR
    # several hosts (or several agents on 127.0.0.1): one agent per host, one shared rendezvous
    python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29400 --rdzv-id RUN -m trainer.train --job job.json --run-dir DIR
    # Kubernetes: the same command in every pod of the rendered job (deployments/templates)

``--job`` is the resolved job a Run writes (``DIR/job.json``; :mod:`trainer.job`): every rank reads its
checkpoint location, cadences and FLOPs per step from it and plans nothing itself.

Outputs in the run directory: ``metrics.jsonl`` (the loss curve), ``checkpoints/`` (unless
``checkpoint.url`` points elsewhere), ``status.json`` once the last step is checkpointed, and with
``parallel.compile`` Inductor's cache ``compile_cache/`` (unless ``TORCHINDUCTOR_CACHE_DIR`` names one).
Exit codes follow :mod:`trainer.failures`: 0 done, 3 user error, 4 hang, 5 infrastructure failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.elastic.multiprocessing.errors import record

from trainer.backends import get_backend, get_chip
from trainer.backends.base import local_rank
from trainer.checkpoint import CheckpointError, CheckpointManager, ModelOptimizerState, RNGState
from trainer.checkpoint.ram_tier import HostMemoryTier, memory_directory
from trainer.checkpoint.resize import discard_other_sizes, memory_tier_current
from trainer.config import JobConfig
from trainer.data import StepLoader, build_loader
from trainer.data.errors import DataError
from trainer.elastic import describe_resize, fit_to_world
from trainer.failures import (
    EXIT_INFRA,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    UserError,
    is_infra_error,
    record_user_error,
    restarted_after_user_error,
)
from trainer.goodput_log import GoodputRecorder, process_started_at
from trainer.job import require_resolved
from trainer.metrics import MetricsWriter, mirror_of
from trainer.parallel import ParallelModel, build_parallel_model
from trainer.parallel.compile import compile_seconds, use_compile_cache
from trainer.rank.fault_injection import FaultInjector
from trainer.rank.optim import build_optimizer
from trainer.rank.preemption import Preempted, PreemptionWatch
from trainer.rank.step import PhaseClock, TrainStep
from trainer.rank.telemetry import gather_host_times, peak_memory_bytes, straggler_fields
from trainer.rank.watchdog import StepWatchdog
from trainer.rundir import RunDir

if TYPE_CHECKING:
    from trainer.rank.replica_ft import ReplicaGroup

log = logging.getLogger("tessera.train")


@dataclass(frozen=True)
class TrainResult:
    final_step: int
    final_loss: float | None  # None when the run was already complete on start
    resumed_from: int | None
    final_checkpoint: str | None


@dataclass
class Session:
    """What one training process holds: model, optimizers, data, checkpoints, fault hooks."""

    job: JobConfig
    rank: int
    device: torch.device
    model: ParallelModel
    optimizers: list[torch.optim.Optimizer]
    loader: StepLoader
    state: dict[str, Stateful]
    ckpt: CheckpointManager
    memory: HostMemoryTier | None  # the in-memory tier, when checkpoint.memory_interval is not 'off'
    faults: FaultInjector
    preemption: PreemptionWatch
    replicas: ReplicaGroup | None = None  # the other replica groups, with faults.replica_fault_tolerance


def open_session(job: JobConfig) -> Session:
    """Join the process group and build everything a step needs, on this rank's device."""
    backend = get_backend(job.hardware.accelerator)
    backend.require()
    backend.init_process_group(job.faults.collective_timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = None
    if job.faults.replica_fault_tolerance:  # this process group is one replica group; torchft links them
        from trainer.rank.replica_ft import ReplicaGroup

        replicas = ReplicaGroup(job)
        job = replicas.job
    spec_job, job = job, fit_to_world(job, world)
    if job is not spec_job and rank == 0:
        log.warning("ELASTIC: %s", describe_resize(spec_job, job))
    device = backend.device(local_rank())
    torch.manual_seed(job.seed)
    model = build_parallel_model(job, device)
    optimizers = [build_optimizer(part, job.optimizer) for part in model.parts]
    dp_rank, dp_size = model.dp_rank, model.dp_size
    if replicas is not None:
        dp_rank, dp_size = replicas.data_shard(dp_rank, dp_size)
    loader = build_loader(job, dp_rank, dp_size)
    # Model, optimizer, RNG and loader position: everything a bitwise-identical resume needs. The
    # learning-rate schedule is a function of the step, rebuilt from the checkpoint's step.
    state: dict[str, Stateful] = {
        "app": ModelOptimizerState(model.parts, optimizers),
        "rng": RNGState(rank),
        "loader": loader,
    }
    faults = FaultInjector.from_env()
    ckpt, memory = checkpoint_tiers(job, rank, world, faults)
    watch = PreemptionWatch(device)
    return Session(job, rank, device, model, optimizers, loader, state, ckpt, memory, faults, watch, replicas)


def checkpoint_tiers(
    job: JobConfig, rank: int, world: int, faults: FaultInjector
) -> tuple[CheckpointManager, HostMemoryTier | None]:
    """This rank's storage checkpoints, and its host-memory tier unless ``checkpoint.memory_interval``
    is 'off', at the location and cadences the resolved job names."""
    assert job.checkpoint.url is not None and job.checkpoint_interval_steps is not None, (
        "require_resolved first"
    )
    ckpt = CheckpointManager(
        job.checkpoint.url,
        job.checkpoint,
        job.checkpoint_interval_steps,
        job.model_fingerprint(),
        world,
        rank,
        layout=job.parallel.model_dump(),
        faults=faults,
    )
    if job.memory_interval_steps is None:
        return ckpt, None
    memory = HostMemoryTier(
        memory_directory(job),
        job.memory_interval_steps,
        rank,
        world,
        job.hardware.chips_per_node,
        job.faults.collective_timeout_s,
    )
    return ckpt, memory


def restore(session: Session) -> tuple[int, str]:
    """Own host memory → a peer's host memory → storage: the newest step every rank can restore, from
    the fastest tier that has it. Returns the step (0: a fresh start) and where it came from."""
    from_memory = None
    # Only if at least as new as storage's newest, and in its layout (an elastic resize changes it).
    if session.memory is not None and memory_tier_current(session.ckpt, session.job):
        from_memory = session.memory.restore(session.state, not_older_than=session.ckpt.newest_step())
    if from_memory is not None:
        session.ckpt.remove_partials()
        step, source = from_memory.step, from_memory.detail
    else:
        manifest = session.ckpt.restore(session.state)
        step, source = (manifest.step, manifest.url) if manifest is not None else (0, "")
    if session.memory is not None:
        session.memory.discard_after(step)  # snapshots past it belong to the abandoned timeline
    if session.replicas is not None:  # a live peer replica ahead of this one: heal from it
        own, step = step, session.replicas.join(step, session.state["app"], session.loader, session.device)
        if step != own:
            source = "healed from a live replica"
    return step, source


def train(job: JobConfig, run_dir: RunDir) -> TrainResult:
    """Train ``job`` to ``job.train.steps`` on the current torchrun process group, resuming if possible.

    ``job`` is trusted as resolved (:func:`trainer.job.resolve_job`, which a Run applies before it
    writes ``job.json``): its checkpoint location, cadences and FLOPs per step are read, never planned.
    """
    require_resolved(job)
    if job.parallel.compile:  # a retry or resume finds the graphs its first attempt compiled
        use_compile_cache(run_dir.compile_cache)
    session = open_session(job)
    goodput = GoodputRecorder(run_dir.goodput, enabled=session.rank == 0)
    ready = time.time()
    goodput.write("startup", process_started_at(), ready)
    try:
        start, source = restore(session)
        goodput.write("restore", ready, time.time(), step=start)
        if start:
            log.info("resumed from step %d (%s)", start, source)
        loss = run_steps(session, start, run_dir, goodput)
    finally:
        closing = time.time()
        session.ckpt.close()  # also on errors: finish committing the last good checkpoint
        goodput.checkpoint(None, closing, time.time())  # waiting for the save in flight
        goodput.close()
        session.loader.close()
        if session.replicas is not None:
            session.replicas.close()
    dist.barrier()  # rank 0 commits asynchronously: after this, every rank sees the final checkpoint
    if session.memory is not None:
        session.memory.discard()  # the final checkpoint is stored: free the host memory
        discard_other_sizes(job, session.job)  # and that of an elastic run's other node counts
    final = session.ckpt.latest()
    result = TrainResult(job.train.steps, loss, start or None, final.url if final else None)
    if session.rank == 0:
        run_dir.status.write_text(json.dumps({"state": "completed", **asdict(result)}, indent=2))
    return result


def run_steps(session: Session, start: int, run_dir: RunDir, goodput: GoodputRecorder) -> float | None:
    """Steps ``start + 1`` .. ``train.steps``: each trained by a :class:`TrainStep`, logged on log steps,
    then saved (:func:`save_step`). Returns the last step's loss (None if there was no step to run)."""
    job, rank, replicas = session.job, session.rank, session.replicas
    micro_batches = session.loader.local_batch // job.train.micro_batch_size
    train_step = TrainStep(
        job, session.model, session.optimizers, micro_batches, start, session.faults, replicas
    )
    telemetry = StepTelemetry(job, session.device, rank, replicas.replicas if replicas else 1)
    metrics = MetricsWriter(
        run_dir.metrics,
        resumed_step=start,
        enabled=rank == 0,
        mirror_url=mirror_of(run_dir.metrics, job.run_url),
    )
    watchdog = StepWatchdog(job.faults.step_timeout_s, rank, job.faults.collective_timeout_s)
    loss = None
    with watchdog, metrics:
        for step in range(start + 1, job.train.steps + 1):
            watchdog.arm(step)
            began, began_wall = time.perf_counter(), time.time()
            session.faults.before_step(step, rank, job.parallel.world_size)
            clock = PhaseClock(began)
            inputs, targets = next(session.loader)
            clock.lap("data")
            logged = step % job.train.log_every == 0 or step == job.train.steps
            host_times = telemetry.host_times(began) if logged else []
            clock.lap("telemetry")
            out = train_step(step, inputs, targets, clock)
            loss = out.loss
            if logged:
                step_time = time.perf_counter() - began
                participants = replicas.participants() if replicas else None
                line = telemetry.record(
                    step, loss, out.lr, out.grad_norm, step_time, host_times, participants
                )
                metrics.write(
                    line | telemetry.tokens_by_source(session.loader.source_samples()) | clock.seconds
                )
            # A checkpoint write may legitimately outlast a step; the collective timeout bounds it.
            watchdog.disarm()
            save_step(
                session, step, {"tokens": step * telemetry.tokens_per_step, "loss": loss}, began_wall, goodput
            )
    return loss


def save_step(
    session: Session, step: int, meta: dict[str, float], began_wall: float, goodput: GoodputRecorder
) -> None:
    """Checkpoint ``step`` on the interval, at the end or when every rank agreed to stop, and snapshot
    it to host memory on the memory tier's interval, each timed for goodput; then stop if preempted
    (the step is committed, so a retry resumes right after it)."""
    stop = session.preemption.agreed()
    saving = time.time()
    goodput.step(step, began_wall, saving)
    last = session.job.train.steps
    force = step == last or stop
    session.ckpt.maybe_save(step, session.state, meta=meta, force=force, last_step=last)
    if force or step % session.ckpt.interval_steps == 0:
        goodput.checkpoint(step, saving, time.time())
    if session.memory is not None:
        snapping = time.time()
        session.memory.maybe_snapshot(step, session.state)  # blocked: memory.last_stall_s
        if step % session.memory.interval_steps == 0:
            goodput.snapshot(step, snapping, time.time())
    if stop:
        raise Preempted(step)


class StepTelemetry:
    """The fields of a ``metrics.jsonl`` line: loss, throughput, MFU against the chip's peak, stragglers.

    Under replica fault tolerance ``job`` is one of ``replicas`` replica groups: it computes its share
    of each global batch on its own chips, and the run's throughput counts the replicas that took part.
    """

    def __init__(self, job: JobConfig, device: torch.device, rank: int, replicas: int = 1) -> None:
        self.device, self.rank, self.replicas = device, rank, replicas
        self.tokens_per_step = job.train.global_batch_size * job.train.seq_len
        self.seq_len = job.train.seq_len
        assert job.flops_per_step is not None, "a resolved job (trainer.job.resolve_job)"
        self.flops_per_step = job.flops_per_step / replicas
        self.peak_flops = job.parallel.world_size * get_chip(job.hardware.chip).peak_bf16_flops
        self.world_size = job.parallel.world_size  # an elastic job's shrinks show in its metrics
        self.compiled = job.parallel.compile

    def host_times(self, began: float) -> list[float]:
        """Every rank's time before its first collective this step (a collective: all ranks call it)."""
        return gather_host_times(time.perf_counter() - began, self.device)

    def record(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float,
        step_time: float,
        host_times: list[float],
        participants: int | None = None,
    ) -> dict[str, float | int | bool | str]:
        """``participants``: the replicas this step averaged (replica fault tolerance only)."""
        trained = self.tokens_per_step * (participants or self.replicas) / self.replicas
        return {
            "step": step,
            "time": time.time(),  # wall clock: lines up a run's metrics with its logs
            "world_size": self.world_size,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": step * self.tokens_per_step,
            "tokens_per_s": trained / step_time,
            "step_time_s": step_time,
            "mfu": self.flops_per_step / (step_time * self.peak_flops),
            "peak_memory_bytes": peak_memory_bytes(self.device),
            **(straggler_fields(step, host_times) if self.rank == 0 else {}),
            **({"replicas": participants} if participants is not None else {}),
            # This process's compile time so far (most in step 1, a cache hit makes it small).
            **({"compile_s": compile_seconds()} if self.compiled else {}),
        }

    def tokens_by_source(self, source_samples: dict[str, int]) -> dict[str, dict[str, int]]:
        """A mixture's tokens trained so far per source (samples × seq_len); nothing for one dataset."""
        if not source_samples:
            return {}
        return {"tokens_by_source": {name: n * self.seq_len for name, n in source_samples.items()}}


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
    parser.add_argument(
        "--job", type=Path, required=True, help="The resolved JobConfig JSON (a Run writes it: job.json)."
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="Stable run directory; reused to resume.")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(message)s", force=True, stream=sys.stdout
    )
    run_dir = RunDir(args.run_dir)
    previous = restarted_after_user_error(run_dir)
    if previous is not None:  # it would fail the same way again: use up no time, no restart budget
        print(f"error: [rank {rank}] {previous}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    try:
        result = train(load_job(args.job), run_dir)
    except Preempted as exc:  # the step that was running is committed: a retry resumes right there
        print(f"[rank {rank}] {exc}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except Exception as exc:
        if is_infra_error(exc):  # the store, a peer or a loader worker failed: a retry can fix it
            print(
                f"error: [rank {rank}] infrastructure failure, retryable: {exc}", file=sys.stderr, flush=True
            )
            return EXIT_INFRA
        expected = isinstance(exc, UserError | CheckpointError | DataError)
        first_line = next(iter(str(exc).splitlines()), "")
        record_user_error(run_dir, first_line if expected else f"{type(exc).__name__}: {first_line}")
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
