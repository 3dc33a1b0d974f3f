"""Context parallelism on CPU: tokens/s of CP=2 against CP=1 at the longest sequence that fits.

"Fits" is the planner's per-rank memory estimate against ``BUDGET_BYTES``, a stand-in for an
accelerator's HBM (CPU RAM would fit anything this benchmark runs). The ``tiny`` preset, fp32, one
sequence per step; each layout is a real torchrun launch over gloo (one rank per core):

- ``longest_fitting_seq``: the longest power-of-two sequence within the budget at cp=1 and cp=2
  (the planner's estimate: CP=2 holds half of every activation).
- ``cp1`` / ``cp2``: tokens/s at cp=1's longest sequence (1 rank, the whole sequence; 2 ranks, ring
  attention over its two halves), median of ``STEPS`` steps after a warm-up; ``cp2_at_its_longest``:
  cp=2 at its own longest sequence.
- ``ratio``: cp2 over cp1 tokens/s at the same sequence. CP=2 uses twice the cores, so 2 is the
  ceiling; ring hops, the merge and a shared, busy box take their share.

Run: ``python -m benchmarks.bench_cp`` (writes benchmarks/results/cp.json).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import Goal, Headline, main
from trainer.config import JobConfig
from trainer.parallel import build_parallel_model
from trainer.plan.hbm import estimate_memory
from trainer.plan.layout import Geometry

BUDGET_BYTES = 256 * 2**20
SEQ_LENGTHS = [2**k for k in range(10, 17)]
STEPS = 3
HEADLINE = Headline(
    ratio="ratio",
    baseline="cp=1 tokens/s (one rank, the whole sequence) at the same sequence length",
    goal=Goal("ratio", ">=", 1.0),
)


def job_for(cp: int, seq_len: int) -> JobConfig:
    return JobConfig.model_validate(
        {
            "model": {"preset": "tiny"},
            "parallel": {"cp": cp},
            "train": {"seq_len": seq_len, "global_batch_size": 1, "micro_batch_size": 1},
            "hardware": {"chips_per_node": cp},
        }
    )


def longest_fitting(cp: int) -> int:
    def peak(seq_len: int) -> float:
        job = job_for(cp, seq_len)
        return estimate_memory(Geometry(job.model, job.parallel, job.train, "cpu")).total

    return max(seq for seq in SEQ_LENGTHS if peak(seq) <= BUDGET_BYTES)


def measure(cp: int, seq_len: int) -> dict[str, float]:
    """Launch the worker on cp ranks; its rank 0 reports step times."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}"]
        cmd += ["-m", "benchmarks.bench_cp", "worker", str(cp), str(seq_len), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        times = json.loads(out.read_text())
    step_s = statistics.median(times)
    return {"seq_len": seq_len, "ranks": cp, "step_s": step_s, "tokens_per_s": seq_len / step_s}


def worker(cp: int, seq_len: int, out: Path) -> None:
    """One rank: build the parallel model, time fwd+bwd+clip+AdamW steps on random tokens."""
    dist.init_process_group("gloo")
    job = job_for(cp, seq_len)
    model = build_parallel_model(job, torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for part in model.parts for p in part.parameters()])
    tokens = torch.randint(job.model.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(STEPS + 1):  # the first is a warm-up
        start = time.perf_counter()
        model.forward_backward(tokens[:, :-1], tokens[:, 1:], 1)
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(times[1:]))
    dist.destroy_process_group()


def run() -> dict[str, Any]:
    longest = {cp: longest_fitting(cp) for cp in (1, 2)}
    cp1, cp2 = measure(1, longest[1]), measure(2, longest[1])
    return {
        "budget_bytes": BUDGET_BYTES,
        "longest_fitting_seq": {f"cp{cp}": seq for cp, seq in longest.items()},
        "cp1": cp1,
        "cp2": cp2,
        "cp2_at_its_longest": measure(2, longest[2]),
        "ratio": cp2["tokens_per_s"] / cp1["tokens_per_s"],
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    else:
        main("cp", run)
