"""Trainer overhead: tokens/s of ``tessera train`` vs a bare hand-written DDP loop, measured in one run.

Both sides train the ``small`` preset on 2 CPU processes over gloo, with the same model class and
init, the same synthetic samples, global batch, micro-batching, AdamW and gradient clipping. The
trainer runs through ``Run.open`` and ``trainer.runtime.launch.run_agents`` (the path ``tessera train``
takes) twice: pure data parallelism (``dp_replicate=2``, which the trainer runs on DDP, so the ratio
is the loop's own overhead) and the local specs' FSDP2 layout (``dp_shard=2``: all-gathers and
reduce-scatters per micro-batch, the price of sharding); the baseline is ``DistributedDataParallel``
with a plain loop. Throughput is tokens per step over the median step time after warm-up, so a
noisy neighbour on a shared box moves both the same way.

    python -m benchmarks.bench_trainer      # writes benchmarks/results/trainer.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from benchmarks.common import Goal, Headline, main
from deployments.run import Run
from deployments.spec import TrainingSpec
from trainer.config import JobConfig
from trainer.metrics import read_metrics
from trainer.rank.step import PhaseClock
from trainer.rundir import RunDir
from trainer.runtime.launch import launch_env, torchrun_command

STEPS, WARMUP = 12, 3  # the first steps pay for allocator growth and lazy init on both sides
NPROC = 2
PHASES = ("data", "telemetry", "forward_backward", "clip", "optimizer")  # the trainer's PhaseClock laps
TIMES = ("step_time_s", *(f"{phase}_s" for phase in PHASES))
HEADLINE = Headline(
    ratio="ratio_dp_replicate_vs_ddp",
    baseline="hand-written torch DDP loop (tokens/s)",
    goal=Goal("ratio_dp_replicate_vs_ddp", ">=", 0.97),
)

SPEC: dict[str, Any] = {
    "name": "bench-trainer",
    "model": {"preset": "small"},
    "data": {"loader_workers": 0},
    "train": {"steps": STEPS, "seq_len": 64, "global_batch_size": 4, "micro_batch_size": 1},
    "parallel": {"dp_shard": NPROC},
    "cluster": {"chips_per_node": NPROC},
    "checkpoint": {"interval": 10 * STEPS},  # only the final, forced save, after the last timed step
}


def trainer_steps(spec: dict[str, Any], run_dir: Path) -> list[dict[str, float]]:
    """Each step's time and its phases (the trainer's metrics lines)."""
    run = Run.open(TrainingSpec.model_validate(spec), RunDir(run_dir))
    result = run.launch_local()
    if result.kind != "ok":
        raise RuntimeError(f"trainer run failed ({result.kind}):\n{result.log_tail}")
    return [{key: line[key] for key in TIMES} for line in read_metrics(run.dir.metrics)]


def ddp_steps(job: JobConfig, work_dir: Path) -> list[dict[str, float]]:
    job_json, out = work_dir / "ddp-job.json", work_dir / "ddp-times.json"
    job_json.write_text(job.model_dump_json())
    cmd = torchrun_command(
        job_json,
        work_dir,
        NPROC,
        entry=["-m", "benchmarks.bench_trainer", "--ddp-worker", str(job_json), str(out)],
    )
    done = subprocess.run(cmd, env=launch_env(job), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"DDP baseline failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def ddp_worker(job_json: Path, out: Path) -> None:
    """The baseline: what one would write by hand with DDP, timed exactly like the trainer's steps."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainer.data.loader import to_batch
    from trainer.data.synthetic import SyntheticSamples
    from trainer.models.llama.model import Transformer
    from trainer.parallel import token_loss

    job = JobConfig.model_validate_json(job_json.read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Transformer(job.model, max_seq_len=job.train.seq_len)
    model.init_weights(job.seed)
    ddp = DistributedDataParallel(model)
    opt = job.optimizer
    optimizer = torch.optim.AdamW(
        ddp.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay
    )
    samples = SyntheticSamples(job.seed, job.model.vocab_size, job.train.seq_len + 1)
    local = job.train.global_batch_size // world
    n_micro = local // job.train.micro_batch_size
    steps = []
    for step in range(job.train.steps):
        began = time.perf_counter()
        clock = PhaseClock(began)
        inputs, targets = to_batch(samples.rows(step * job.train.global_batch_size + rank * local, local))
        clock.lap("data")
        clock.lap("telemetry")  # the baseline logs nothing
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(inputs.chunk(n_micro), targets.chunk(n_micro), strict=True)):
            with ddp.no_sync() if i < n_micro - 1 else nullcontext():  # all-reduce once per step
                loss = token_loss(ddp(x), y)
                (loss / n_micro).backward()
            total += loss.detach()
        dist.all_reduce(total)
        total.item()
        clock.lap("forward_backward")
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), opt.grad_clip)
        clock.lap("clip")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.lap("optimizer")
        steps.append({"step_time_s": time.perf_counter() - began, **clock.seconds})
    if rank == 0:
        out.write_text(json.dumps(steps))
    dist.destroy_process_group()


def medians(steps: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds after warm-up of the step and of each phase."""
    return {key: statistics.median(step[key] for step in steps[WARMUP:]) for key in TIMES}


def breakdown(sides: dict[str, dict[str, float]]) -> str:
    """Milliseconds per phase, one column per side: a regression shows in the phase that grew."""
    lines = [f"{'phase':<20}" + "".join(f"{side:>24}" for side in sides)]
    for key in TIMES:
        lines.append(
            f"{key.removesuffix('_s'):<20}" + "".join(f"{t[key] * 1e3:>21.1f} ms" for t in sides.values())
        )
    return "\n".join(lines)


def run() -> dict[str, Any]:
    fsdp = TrainingSpec.model_validate(SPEC).job_config(data_url=None)
    # Pure data parallelism runs on DDP in the trainer too: this ratio is the trainer's own overhead.
    replicated = {**SPEC, "parallel": {"dp_replicate": NPROC}}
    tokens_per_step = fsdp.train.global_batch_size * fsdp.train.seq_len
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        work = Path(tmp)
        sides = {
            "ddp": medians(ddp_steps(fsdp, work)),
            "trainer_dp_replicate": medians(trainer_steps(replicated, work / "replicated")),
            "trainer_dp_shard": medians(trainer_steps(SPEC, work / "fsdp")),
        }
    print(breakdown(sides))
    ddp, trainer_replicated, trainer_fsdp = (tokens_per_step / sides[s]["step_time_s"] for s in sides)
    result = {
        "model": "small",
        "processes": NPROC,
        "tokens_per_step": tokens_per_step,
        "steps": STEPS,
        "warmup_steps": WARMUP,
        "baseline": "hand-written torch DDP loop",
        "ddp_tokens_per_s": round(ddp, 1),
        "trainer_dp_replicate_tokens_per_s": round(trainer_replicated, 1),
        "trainer_dp_shard_tokens_per_s": round(trainer_fsdp, 1),
        "ratio_dp_replicate_vs_ddp": round(trainer_replicated / ddp, 3),
        "ratio_dp_shard_vs_ddp": round(trainer_fsdp / ddp, 3),
        "phase_median_ms": {
            side: {k.removesuffix("_s"): round(v * 1e3, 2) for k, v in t.items()} for side, t in sides.items()
        },
        "goal_ratio": 0.97,
    }
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ddp-worker"]:
        ddp_worker(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main("trainer", run)
