"""``tessera calibrate``: measure this machine's figures for the time model and write a chip profile.

Microbenchmarks on whatever backend the process has (plain torch, no Prefect): matmul throughput over
a grid of shapes (the peak and the knee of ``kernels.gemm_efficiency``), memory bandwidth (a large
copy), per-op dispatch cost, fused attention's efficiency, and collective α and β per process-group
size (all-gathers of growing buffers over gloo, one group per size, via torch.multiprocessing), the
share of the host each of those processes gets when all compute at once, and FSDP2's round trip of
one transformer block (``fully_shard``: its gathers, reduce-scatter and own work around them) at two
block sizes. On CPU each figure is per process with one thread, as torchrun runs the trainer's
workers (OMP_NUM_THREADS=1).

The JSON is what ``trainer.plan.profile.load_profile`` reads.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GEMM_SIZES = (32, 128, 512, 1024)  # each of m, n, k; the largest square sets the peak
COLLECTIVE_BYTES = (2**10, 2**14, 2**18, 2**20, 2**22)
COLLECTIVE_REPEATS = 21
SHARE_SIZE, SHARE_REPEATS, SHARE_WINDOWS = (
    512,
    60,
    5,
)  # the matmul every process runs at once to measure its share
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Units FSDP2 shards in the round-trip microbenchmark: the ``tiny`` and ``small`` presets' transformer
# blocks (0.8 and 11.8 MB of fp32 parameters in 9 tensors), run on 8 tokens.
FSDP_UNITS, FSDP_TOKENS, FSDP_REPEATS = ("tiny", "small"), 8, 7


def best_seconds(fn: Callable[[], object], repeats: int = 5, min_time: float = 0.02) -> float:
    """Best over ``repeats`` of the mean time of enough calls to last ``min_time`` (after a warm-up).

    The best, not the median: the profile describes what the machine can do, and on a shared host the
    other samples measure the neighbours (as ``timeit`` advises)."""
    fn()
    calls, began = 1, time.perf_counter()
    while time.perf_counter() - began < min_time:
        fn()
        calls += 1
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - began) / calls)
    return min(samples)


def gemm_grid(dtype: torch.dtype) -> list[dict[str, float]]:
    rows = []
    for m in GEMM_SIZES:
        for n in GEMM_SIZES:
            for k in GEMM_SIZES:
                a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
                seconds = best_seconds(lambda a=a, b=b: a @ b, repeats=3)
                rows.append({"m": m, "n": n, "k": k, "flops_per_s": 2 * m * n * k / seconds})
    return rows


def fit_knee(rows: list[dict[str, float]], peak: float) -> float:
    """Knee of η = x / (x + knee): the median of x·(1 − r)/r over shapes, r = throughput / peak."""
    knees = []
    for row in rows:
        ratio = min(row["flops_per_s"] / peak, 0.999)
        knees.append(min(row["m"], row["n"], row["k"]) * (1 - ratio) / ratio)
    return statistics.median(knees)


def memory_bandwidth() -> float:
    """Bytes/s of a 64 MiB copy (read + write), the streaming rate element-wise kernels see."""
    source = torch.randn(16 * 2**20)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / best_seconds(lambda: target.copy_(source))


def kernel_overhead() -> float:
    """Seconds of host work per kernel: one tiny Transformer block (trainer/model.py, dim 8, one token)
    forward and backward, whose device work is nil, over the kernels the planner counts for it."""
    from trainer.config import ModelConfig
    from trainer.model import TransformerBlock, rope_table
    from trainer.plan.compute import BACKWARD_KERNELS, BLOCK_KERNELS

    cfg = ModelConfig(
        preset="custom", n_layers=1, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=8, rope_theta=1e4
    )
    block, rope = TransformerBlock(cfg), rope_table(cfg.head_dim, 1, 1e4)
    x = torch.randn(1, 1, cfg.dim, requires_grad=True)
    seconds = best_seconds(lambda: block(x, rope).sum().backward())
    return seconds / ((1 + BACKWARD_KERNELS) * BLOCK_KERNELS[False])


def attention_efficiency(peak: float, knee: float) -> float:
    """Fraction of peak SDPA (causal) reaches fwd + bwd, net of the shape factor the planner applies."""
    batch, heads, seq, head_dim = 2, 4, 256, 64
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = 3.5 * 2 * batch * seq * seq * heads * head_dim  # fwd + 2.5× bwd, causal half of 4·b·s²·w
    return flops / best_seconds(step) / (peak * seq / (seq + knee))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _best(collective: Callable[[], object]) -> float:
    """Best time of a collective over a fixed count of calls (the same on every rank, so they match)."""
    samples = []
    for _ in range(COLLECTIVE_REPEATS):
        dist.barrier()
        began = time.perf_counter()
        collective()
        samples.append(time.perf_counter() - began)
    return min(samples[1:])


def _compute_share_seconds(world: int) -> float:
    """Seconds per matmul when every rank computes at once: the slowest rank's (a step waits for it),
    in the best of a few windows (the host's own share, not a neighbour's burst)."""
    a, b = torch.randn(SHARE_SIZE, SHARE_SIZE), torch.randn(SHARE_SIZE, SHARE_SIZE)
    windows = []
    for _ in range(SHARE_WINDOWS):
        dist.barrier()
        began = time.perf_counter()
        for _ in range(SHARE_REPEATS):
            a @ b
        slowest = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        windows.append(slowest.item() / SHARE_REPEATS)
    return min(windows)


def _round_trip_seconds(block: torch.nn.Module, x: torch.Tensor, rope: torch.Tensor) -> float:
    """Median process CPU seconds of forward + backward (every rank runs the same count)."""
    samples = []
    for _ in range(FSDP_REPEATS):
        dist.barrier()
        began = time.process_time()  # CPU, not wall: the gloo thread's work counts, a neighbour's does not
        block(x, rope).sum().backward()
        samples.append(time.process_time() - began)
    return statistics.median(samples[2:])


def _fsdp_round_trips() -> list[dict[str, float]]:
    """FSDP2's round trip of one unit over this process group: forward + backward of a transformer
    block (trainer/model.py) under ``fully_shard`` (all-gather, reshard, all-gather again,
    reduce-scatter) less the same block unsharded, for each of ``FSDP_UNITS``."""
    from torch.distributed.fsdp import fully_shard

    from trainer.config import ModelConfig
    from trainer.model import TransformerBlock, rope_table

    rows = []
    for preset in FSDP_UNITS:
        cfg = ModelConfig(preset=preset)
        plain, sharded = TransformerBlock(cfg), fully_shard(TransformerBlock(cfg))
        rope = rope_table(cfg.head_dim, FSDP_TOKENS, cfg.rope_theta)
        x = torch.randn(1, FSDP_TOKENS, cfg.dim)
        rows.append(
            {
                "param_bytes": 4 * sum(p.numel() for p in plain.parameters()),
                "seconds": _round_trip_seconds(sharded, x, rope) - _round_trip_seconds(plain, x, rope),
            }
        )
    return rows


def fit_round_trip(rows: list[dict[str, float]]) -> tuple[float, float]:
    """(λ, r) of t = λ + P·r through the smallest and largest unit measured (P: parameter bytes),
    neither below zero (a noisy small unit can fall under the line)."""
    small, large = min(rows, key=lambda r: r["param_bytes"]), max(rows, key=lambda r: r["param_bytes"])
    per_byte = max(0.0, (large["seconds"] - small["seconds"]) / (large["param_bytes"] - small["param_bytes"]))
    return max(0.0, small["seconds"] - per_byte * small["param_bytes"]), per_byte


def _collective_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gemm_s = _compute_share_seconds(world)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    timings = []
    for size in COLLECTIVE_BYTES:
        shard = torch.zeros(size // 4 // world)
        gathered = torch.empty(shard.numel() * world)
        seconds = _best(lambda shard=shard, gathered=gathered: gather(gathered, shard))
        timings.append({"bytes": shard.numel() * world * 4, "seconds": seconds})
    full = torch.zeros(COLLECTIVE_BYTES[-1] // 4)
    # The library's reduce-scatter and all-reduce against the ring model's time for them.
    reduce_scatter = _best(lambda: dist.reduce_scatter_tensor(shard, full)) / timings[-1]["seconds"]
    all_reduce = _best(lambda: dist.all_reduce(full)) / (2 * timings[-1]["seconds"])
    fsdp = _fsdp_round_trips()
    if rank == 0:
        result = {
            "gemm_flops_per_s": 2 * SHARE_SIZE**3 / gemm_s,
            "fsdp": fsdp,
            "timings": timings,
            "reduce_scatter_factor": reduce_scatter,
            "all_reduce_factor": all_reduce,
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def collective_link(world: int, alone_flops: float) -> dict[str, Any]:
    """α from the smallest all-gather (all latency: t = (n−1)·α), β from the largest after removing it:
    t = (n−1)·α + S·(n−1)/n / B (two points: a shared host's timings are too noisy for a fit); and the
    share of one process's matmul rate each of ``world`` processes gets when all compute at once
    (``alone_flops``: the same matmul in one process); and FSDP2's round trip of a unit as
    t = λ + P·r over its fp32 parameter bytes P, through the two units measured."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        mp.spawn(_collective_worker, args=(world, _free_port(), out), nprocs=world, join=True)
        result = json.loads(Path(out).read_text())
    timings = result["timings"]
    latency = timings[0]["seconds"] / (world - 1)
    largest = timings[-1]
    moved = largest["bytes"] * (world - 1) / world
    bandwidth = moved / max(largest["seconds"] - (world - 1) * latency, 1e-9)
    fsdp_latency, fsdp_per_byte = fit_round_trip(result["fsdp"])
    cores = os.cpu_count() or world
    share = min(1.0, cores / world, result["gemm_flops_per_s"] / alone_flops)  # never above its cores
    return {
        "ranks": world,
        "latency_s": latency,
        "bandwidth": bandwidth,
        "reduce_scatter_factor": result["reduce_scatter_factor"],
        "all_reduce_factor": result["all_reduce_factor"],
        "compute_share": share,
        "fsdp_latency_s": fsdp_latency,
        "fsdp_s_per_byte": fsdp_per_byte,
        "raw": timings,
        "raw_fsdp": result["fsdp"],
    }


def measure(max_ranks: int = 4) -> dict[str, Any]:
    """Every figure of the profile, measured in this process (one thread) and in gloo groups of 2..max_ranks."""
    torch.set_num_threads(1)
    grids = {name: gemm_grid(dtype) for name, dtype in DTYPES.items()}
    peaks = {name: max(row["flops_per_s"] for row in rows) for name, rows in grids.items()}
    knee = fit_knee(grids["fp32"], peaks["fp32"])
    ranks = [n for n in (2, 4, 8) if n <= max_ranks]
    alone = next(r["flops_per_s"] for r in grids["fp32"] if r["m"] == r["n"] == r["k"] == SHARE_SIZE)
    return {
        "chip": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name().lower(),
        "host": platform.node(),
        "host_cores": os.cpu_count(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "peak_flops": peaks,
        "gemm_efficiency": 1.0,  # the peak above is the measured best, so η_max is 1 by construction
        "gemm_knee": knee,
        "attention_efficiency": attention_efficiency(peaks["fp32"], knee),
        "hbm_bandwidth": memory_bandwidth(),
        "kernel_overhead_s": kernel_overhead(),
        "collectives": [collective_link(n, alone) for n in ranks],
        "gemm_grid": grids,
    }


def calibrate(out: Path, max_ranks: int = 4) -> Path:
    """Measure and write the profile to ``out`` (for ``tessera plan --profile``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(measure(max_ranks), indent=2) + "\n")
    return out
