"""Trainer overhead: tokens/s of ``tessera train`` vs a bare hand-written DDP loop, measured in one run.

Both sides train the ``small`` preset on 2 CPU processes over gloo, with the same model class and
init, the same synthetic samples, global batch, micro-batching, AdamW and gradient clipping. The
trainer runs through ``Run.open`` and ``trainer.launch.run_agents`` (the path ``tessera train``
takes) twice: with replicated parameters (``dp_replicate=2``: DDP's communication, so the ratio is
the loop's own overhead) and with the local specs' FSDP2 layout (``dp_shard=2``: all-gathers and
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
from trainer.launch import launch_env, torchrun_command
from trainer.metrics import read_metrics
from trainer.rundir import RunDir

STEPS, WARMUP = 12, 3  # the first steps pay for allocator growth and lazy init on both sides
NPROC = 2
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


def trainer_step_times(spec: dict[str, Any], run_dir: Path) -> list[float]:
    run = Run.open(TrainingSpec.model_validate(spec), RunDir(run_dir))
    result = run.launch_local()
    if result.kind != "ok":
        raise RuntimeError(f"trainer run failed ({result.kind}):\n{result.log_tail}")
    return [line["step_time_s"] for line in read_metrics(run.dir.metrics)]


def ddp_step_times(job: JobConfig, work_dir: Path) -> list[float]:
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
    from trainer.model import Transformer
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
    times = []
    for step in range(job.train.steps):
        began = time.perf_counter()
        inputs, targets = to_batch(samples.rows(step * job.train.global_batch_size + rank * local, local))
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(inputs.chunk(n_micro), targets.chunk(n_micro), strict=True)):
            with ddp.no_sync() if i < n_micro - 1 else nullcontext():  # all-reduce once per step
                loss = token_loss(ddp(x), y)
                (loss / n_micro).backward()
            total += loss.detach()
        dist.all_reduce(total)
        total.item()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), opt.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    if rank == 0:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()


def throughput(step_times: list[float], tokens_per_step: int) -> float:
    return tokens_per_step / statistics.median(step_times[WARMUP:])


def run() -> dict[str, Any]:
    fsdp = TrainingSpec.model_validate(SPEC).job_config(data_url=None)
    # Replicated parameters do exactly DDP's communication: this ratio is the trainer's own overhead.
    replicated = {**SPEC, "parallel": {"dp_replicate": NPROC}}
    tokens_per_step = fsdp.train.global_batch_size * fsdp.train.seq_len
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        work = Path(tmp)
        trainer_fsdp = throughput(trainer_step_times(SPEC, work / "fsdp"), tokens_per_step)
        trainer_replicated = throughput(trainer_step_times(replicated, work / "replicated"), tokens_per_step)
        ddp = throughput(ddp_step_times(fsdp, work), tokens_per_step)
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
        "goal_ratio": 0.97,
    }
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ddp-worker"]:
        ddp_worker(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main("trainer", run)
