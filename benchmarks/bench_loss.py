"""The head and loss: chunked linear cross-entropy (``trainer.rank.loss.linear_cross_entropy``, what the
trainer runs) vs the plain one over materialized fp32 logits, measured in one run.

One fwd+bwd of the output projection and the loss over N tokens at a vocabulary where the logits
dominate the memory (N·V fp32 logits are 4× the hidden states and the weight together). Step time
is the median of alternating steps of the two in this process, so a noisy neighbour slows both;
peak memory is each side's peak resident set above its inputs, each in a fresh child process
(with glibc's mmap threshold fixed low, freed tensors leave the resident set, so its peak is the
peak of live tensors).

    python -m benchmarks.bench_loss         # writes benchmarks/results/loss.json
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Goal, Headline, main
from trainer.rank.loss import linear_cross_entropy, token_loss

TOKENS, DIM, VOCAB = 1024, 256, 32_000  # fp32 logits 131 MB; hidden + weight 34 MB
STEPS, WARMUP = 5, 1
HEADLINE = Headline(
    ratio="peak_memory_ratio",
    baseline="plain cross-entropy over fp32 logits (peak bytes of one fwd+bwd)",
    goal=Goal("peak_memory_ratio", "<=", 0.35),
)
SIDES = {
    "plain": lambda h, w, y: token_loss(h @ w.T, y),
    "chunked": linear_cross_entropy,
}


def head_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, TOKENS, DIM, generator=generator).requires_grad_()
    weight = (torch.randn(VOCAB, DIM, generator=generator) * DIM**-0.5).requires_grad_()
    return hidden, weight, torch.randint(VOCAB, (1, TOKENS), generator=generator)


def step(side: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> float:
    hidden.grad = weight.grad = None
    began = time.perf_counter()
    SIDES[side](hidden, weight, targets).backward()
    return time.perf_counter() - began


def resident_kib(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process; unlike ru_maxrss, VmHWM is not inherited from
    the parent that forked it."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def peak_child(side: str) -> None:
    """In a fresh process: prints the peak RSS of one step of ``side`` above what was resident before it,
    in bytes. A first step pays the one-time allocations (thread pools, kernel workspaces); then the
    peak is reset (clear_refs 5) and the second step is measured."""
    inputs = head_inputs()
    step(side, *inputs)
    Path("/proc/self/clear_refs").write_text("5")
    before = resident_kib("VmRSS")
    step(side, *inputs)
    print((resident_kib("VmHWM") - before) * 1024)


def peak_bytes(side: str) -> int:
    # A fixed mmap threshold: every block over 64 KiB is mapped and unmapped (glibc's default threshold
    # grows to 32 MiB after frees, and then a freed chunk may stay resident or not, run to run).
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_loss", "--peak", side],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    return int(out.stdout.split()[-1])


def run() -> dict[str, Any]:
    inputs = head_inputs()
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(WARMUP + STEPS):
        for side in SIDES:
            seconds = step(side, *inputs)
            if i >= WARMUP:
                times[side].append(seconds)
    step_s = {side: statistics.median(t) for side, t in times.items()}
    peak = {side: peak_bytes(side) for side in SIDES}
    return {
        "shape": {"tokens": TOKENS, "dim": DIM, "vocab": VOCAB, "dtype": "float32"},
        "threads": torch.get_num_threads(),
        "step_s": step_s,
        "peak_bytes": peak,
        "step_time_ratio": step_s["chunked"] / step_s["plain"],
        "peak_memory_ratio": peak["chunked"] / peak["plain"],
        "fp32_logits_bytes": TOKENS * VOCAB * 4,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peak"]:
        peak_child(sys.argv[2])
    else:
        main("loss", run)
