"""Activation checkpointing cost, as ratios against no checkpointing measured in the same run.

For the ``small`` preset (one process, fp32, batch 2 × 128 tokens), per mode (selective, full):
- ``flops_ratio``: matmul/attention FLOPs of one forward+backward (counted by FlopCounterMode, so
  exact and machine-independent) over those without checkpointing. Goal: selective 1.0 (recomputes
  only memory-bound ops), full < 4/3 (one extra forward of the blocks, not of the output head).
- ``time_ratio``: median wall time of forward+backward over that without checkpointing (CPU here;
  noisy on a shared box).

The parallel layouts' correctness (every layout's loss = the single-process loss) is a test
(tests/test_parallel.py), not a benchmark: CPU/gloo step times say nothing about accelerator scaling.

Run: ``python -m benchmarks.bench_parallel`` (writes benchmarks/results/parallel.json).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import Goal, Headline, main
from trainer.config import ActivationCheckpointing, ModelConfig
from trainer.models.llama.model import Transformer
from trainer.parallel import apply_ac, token_loss

SEQ_LEN, BATCH, REPEATS = 128, 2, 3
HEADLINE = Headline(
    ratio="full.flops_ratio",
    baseline="forward+backward FLOPs without activation checkpointing",
    goal=Goal("full.flops_ratio", "<", 4 / 3),
)


def fwd_bwd(model: Transformer, tokens: torch.Tensor) -> None:
    token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()


def measure(mode: ActivationCheckpointing, cfg: ModelConfig, tokens: torch.Tensor) -> tuple[int, float]:
    model = Transformer(cfg, max_seq_len=SEQ_LEN)
    model.init_weights(0)
    apply_ac(model, mode)
    with FlopCounterMode(display=False) as counter:
        fwd_bwd(model, tokens)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fwd_bwd(model, tokens)
        times.append(time.perf_counter() - start)
    return counter.get_total_flops(), statistics.median(times)


def run() -> dict:
    cfg = ModelConfig(preset="small")
    tokens = torch.randint(cfg.vocab_size, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    base_flops, base_s = measure("none", cfg, tokens)
    results: dict = {"model": "small", "batch": BATCH, "seq_len": SEQ_LEN, "none_fwd_bwd_s": base_s}
    for mode in ("selective", "full"):
        flops, seconds = measure(mode, cfg, tokens)
        results[mode] = {"flops_ratio": flops / base_flops, "time_ratio": seconds / base_s}
    return results


if __name__ == "__main__":
    main("parallel", run)
