"""Muon vs AdamW: CPU seconds of one training step (fwd+bwd+optimizer) of the ``small`` preset, one process.

Both optimizers step the same model from the same weights on the same batch; the steps alternate in
this process, so a noisy neighbour slows both, and each side's median is reported, for the whole step
and for the optimizer step alone. Muon's extra work is its Newton-Schulz matmuls (5 iterations of three
bf16 matmuls per block matrix, ``trainer.plan.compute.newton_schulz_gemms``), which the planner prices;
``newton_schulz_gflop`` reports their count next to the model's fwd+bwd FLOPs.

    python -m benchmarks.bench_muon         # writes benchmarks/results/muon.json
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from benchmarks.common import Goal, Headline, main
from trainer.config import ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
from trainer.models import family_of
from trainer.plan.compute import newton_schulz_gemms
from trainer.plan.flops import model_flops_per_token
from trainer.plan.layout import Geometry
from trainer.rank.optim import build_optimizer

PRESET, BATCH, SEQ_LEN = "small", 4, 256
STEPS, WARMUP = 3, 1
HEADLINE = Headline(
    ratio="step_time_ratio",
    baseline="AdamW, same model, batch and process (median seconds of one fwd+bwd+optimizer step)",
    # A regression guard, not a CPU target: without bf16 matmul units (AVX512-BF16/AMX) a CPU runs
    # Newton-Schulz's bf16 matmuls at about 1/3 of its fp32 rate, and at this size they are ~4× the
    # model's own step FLOPs (on accelerators, where bf16 is the fast path, they are a small share).
    goal=Goal("step_time_ratio", "<=", 10.0),
)


def timed_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor
) -> tuple[float, float]:
    """(whole step, optimizer step) seconds."""
    began = time.perf_counter()
    model(batch[:, :-1], batch[:, 1:]).backward()
    stepping = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    done = time.perf_counter()
    return done - began, done - stepping


def run() -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = ModelConfig(preset=PRESET)
    base = family_of(cfg).build(cfg, SEQ_LEN)
    batch = torch.randint(cfg.vocab_size, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    sides = {}
    for name in ("adamw", "muon"):
        model = copy.deepcopy(base)
        sides[name] = (model, build_optimizer(model, OptimizerConfig(name=name)))
    step_s: dict[str, list[float]] = {name: [] for name in sides}
    optimizer_s: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(WARMUP + STEPS):
        for name, (model, optimizer) in sides.items():
            whole, opt = timed_step(model, optimizer, batch)
            if i >= WARMUP:
                step_s[name].append(whole)
                optimizer_s[name].append(opt)
    step = {name: statistics.median(t) for name, t in step_s.items()}
    train = TrainConfig(seq_len=SEQ_LEN, global_batch_size=BATCH, micro_batch_size=BATCH)
    geo = Geometry(cfg, ParallelConfig(), train, "cpu", "muon")
    opt = {name: statistics.median(t) for name, t in optimizer_s.items()}
    return {
        "shape": {
            "preset": PRESET,
            "batch": BATCH,
            "seq_len": SEQ_LEN,
            "params": sum(p.numel() for p in base.parameters()),
        },
        "threads": torch.get_num_threads(),
        "step_s": step,
        "optimizer_step_s": opt,
        "tokens_per_s": {name: BATCH * SEQ_LEN / s for name, s in step.items()},
        "step_time_ratio": step["muon"] / step["adamw"],
        "optimizer_time_ratio": opt["muon"] / opt["adamw"],
        "newton_schulz_gflop": sum(2 * m * n * k for m, n, k in newton_schulz_gemms(geo)) / 1e9,
        "model_gflop": model_flops_per_token(geo) * BATCH * SEQ_LEN / 1e9,
    }


if __name__ == "__main__":
    main("muon", run)
