"""``tessera calibrate``: measure this machine's figures for the time model and write a chip profile.

Microbenchmarks on whatever backend the process has (plain torch, no Prefect):

- matmul throughput over a grid of shapes (the peak and the knee of ``kernels.gemm_efficiency``),
  memory bandwidth (a large copy), per-op dispatch cost and fused attention's efficiency;
- a real transformer block: what its matmuls reach of the peak, and the bandwidth its element-wise
  work reaches;
- per process-group size (one gloo group each, via torch.multiprocessing): collective α and β
  (all-gathers of growing buffers), the share of the host's compute and of its memory bandwidth each
  process gets when all run at once, FSDP2's round trip of one transformer block (``fully_shard``: its
  gathers, reduce-scatter and own work around them, in a stack of blocks as the trainer wraps them) at
  two block sizes, and a tensor-parallel block's cost over its unsplit twin at two token counts.

On CPU each figure is per process with one thread, as torchrun runs the trainer's workers
(OMP_NUM_THREADS=1).

Every figure a step's time is made of is a rate the step sustains, not the host's best: the median
over windows of back-to-back calls (``sustained_seconds``), the median collective, the slowest rank's
median window with all of a group's processes busy at once. The matmul grid alone keeps its best
samples (``best_seconds``): it gives the roofline's shape, and the sustained block measures its level.

The probe block (``PROBE_BLOCK``) is shaped unlike the ``tiny``, ``small`` and benchmark models, so a
plan for those extrapolates from it rather than replays it.

The JSON is what ``trainer.plan.profile.load_profile`` reads.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.backends.chips import get_chip
from trainer.config import ModelConfig, ParallelConfig, TrainConfig
from trainer.local_tensor import local_tensor
from trainer.plan.compute import block_matmuls, block_seconds, elementwise_bytes
from trainer.plan.kernels import gemm_seconds
from trainer.plan.layout import Geometry
from trainer.plan.profile import HardwareProfile, catalog_profile

GEMM_SIZES = (32, 128, 512, 1024)  # each of m, n, k; the largest square sets the peak
COLLECTIVE_BYTES = (2**10, 2**14, 2**18, 2**20, 2**22)
COLLECTIVE_REPEATS = 21
# Sustained rates: the median over SUSTAIN_WINDOWS of the mean time per call in a window of back-to-back
# calls lasting at least SUSTAIN_S (see sustained_seconds). A quarter second is of the order of the
# benchmark models' CPU steps (0.05–3 s) and spans tens of scheduler ticks, so a window sees what
# interrupts a step.
SUSTAIN_S, SUSTAIN_WINDOWS = 0.25, 5
SHARE_SIZE = 512  # the matmul every process runs at once to measure its share
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_BYTES = 4
COPY_ELEMENTS = 16 * 2**20  # a 64 MiB fp32 copy: far past any cache
# Units FSDP2 shards in the round-trip microbenchmark: the ``tiny`` and ``small`` presets' transformer
# blocks (0.8 and 11.8 MB of fp32 parameters in 9 tensors), run on two sequences of a training length
# (each rank's compute between its collectives lasts as long as in training, and so do their waits),
# FSDP_STACK of them in a row under a root unit, as the trainer wraps a model: each unit's all-gather
# is then prefetched while its predecessor computes, and its reduce-scatter runs while its successor's
# backward does, so the measured cost includes those collectives' contention with compute for the
# host's cores (a lone unit's has nothing to contend with, and costs about half as much on 2 cores).
FSDP_UNITS, FSDP_STACK, FSDP_BATCH, FSDP_SEQ = ("tiny", "small"), 4, 2, 128
# Round trips (FSDP's, TP's) are the median of REPEATS wall-time samples after WARMUP, each sample of
# the wrapped module next to one of its plain twin (see _wall_extra_seconds).
REPEATS, WARMUP = 15, 2
# The block whose matmuls and element-wise work calibrate the compute figures, and which tensor
# parallelism splits (its heads, key/value heads and hidden width divide by 2 and 4).
PROBE_BLOCK: dict[str, Any] = dict(
    preset="custom", n_layers=1, dim=640, n_heads=8, n_kv_heads=4, ffn_dim=1792, vocab_size=8, rope_theta=1e4
)
PROBE_BATCH, PROBE_SEQ = 2, 256
TP_SEQ, TP_BATCHES = 128, (2, 8)  # the two points of the TP line (sequences of a training length)


def best_seconds(fn: Callable[[], object], repeats: int = 5, min_time: float = 0.02) -> float:
    """Best over ``repeats`` of the mean time of enough calls to last ``min_time`` (after a warm-up).

    The best, for the matmul grid only: its peak and knee are the shape of the roofline (ratios between
    shapes), measured in short windows on a shared host; the level a step sustains is set against that
    ceiling by ``block_figures`` (sustained), which the gemm efficiency carries."""
    return min(_window_means(fn, _calls_lasting(fn, min_time), repeats))


def _calls_lasting(fn: Callable[[], object], window_s: float) -> int:
    """How many back-to-back calls of ``fn`` last ``window_s`` (after one warm-up call)."""
    fn()
    calls, began = 1, time.perf_counter()
    while time.perf_counter() - began < window_s:
        fn()
        calls += 1
    return calls


def sustained_seconds(
    fn: Callable[[], object], window_s: float = SUSTAIN_S, windows: int = SUSTAIN_WINDOWS
) -> float:
    """Median over ``windows`` of the mean time per call in a window of back-to-back calls lasting
    ``window_s`` (after a warm-up).

    For the rates a training step sustains: a step's time is the sum of its calls, with whatever
    interrupts them (scheduler ticks, gloo's threads, the host's daemons), and the benchmark reports the
    median step; a window's mean includes those interruptions, and the median over windows, like the
    step median, leaves out a rare burst. (``best_seconds`` keeps the fastest window: a ceiling, which
    a step does not sustain.)"""
    return _window_median(fn, _calls_lasting(fn, window_s), windows)


def _window_median(fn: Callable[[], object], calls: int, windows: int = SUSTAIN_WINDOWS) -> float:
    """Median over ``windows`` of the mean seconds per call in ``calls`` back-to-back calls."""
    return statistics.median(_window_means(fn, calls, windows))


def _window_means(fn: Callable[[], object], calls: int, windows: int) -> list[float]:
    """The mean seconds per call of ``windows`` windows, each ``calls`` back-to-back calls."""
    means = []
    for _ in range(windows):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - began) / calls)
    return means


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


def share_work() -> dict[str, Callable[[], object]]:
    """The work whose rate, alone and with every process of a group running it at once, gives each
    process's share of the host: a SHARE_SIZE² fp32 matmul (compute) and a 64 MiB copy, far past any
    cache (memory: read + write, the streaming rate element-wise kernels see)."""
    a, b = torch.randn(SHARE_SIZE, SHARE_SIZE), torch.randn(SHARE_SIZE, SHARE_SIZE)
    source, target = torch.randn(COPY_ELEMENTS), torch.empty(COPY_ELEMENTS)
    return {"gemm": lambda: a @ b, "copy": lambda: target.copy_(source)}


def alone_rates() -> dict[str, dict[str, float]]:
    """``share_work`` in this process alone, sustained: for each, the calls that last ``SUSTAIN_S`` (the
    groups run the same count) and the median seconds per call over windows of them."""
    rates = {}
    for name, work in share_work().items():
        calls = _calls_lasting(work, SUSTAIN_S)
        rates[name] = {"calls": calls, "seconds": _window_median(work, calls)}
    return rates


def share(alone_s: float, concurrent_s: float, world: int, cores: int) -> float:
    """Each of ``world`` busy processes' share of one alone: the sustained rate ratio, never above the
    cores each can have (min(1, cores / world))."""
    return min(1.0, cores / world, alone_s / concurrent_s)


def kernel_overhead() -> float:
    """Seconds of host work per kernel: one tiny Transformer block (trainer/model.py, dim 8, one token)
    forward and backward, whose device work is nil, over the kernels the planner counts for it."""
    from trainer.plan.compute import BACKWARD_KERNELS, BLOCK_KERNELS

    cfg = ModelConfig(
        preset="custom", n_layers=1, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=8, rope_theta=1e4
    )
    block, x, rope = _block_input(cfg, 1, 1)
    seconds = sustained_seconds(lambda: block(x, rope).sum().backward())
    return seconds / ((1 + BACKWARD_KERNELS) * BLOCK_KERNELS[False])


def attention_efficiency(peak: float, knee: float) -> float:
    """Fraction of peak SDPA (causal) reaches fwd + bwd, net of the shape factor the planner applies."""
    batch, heads, seq, head_dim = 2, 4, 256, 64
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = 3.5 * 2 * batch * seq * seq * heads * head_dim  # fwd + 2.5× bwd, causal half of 4·b·s²·w
    return flops / sustained_seconds(step) / (peak * seq / (seq + knee))


def _probe_geometry(batch: int, seq: int) -> Geometry:
    """The planner's view of the probe block on one fp32 process."""
    model = ModelConfig(**PROBE_BLOCK)
    train = TrainConfig(steps=1, seq_len=seq, micro_batch_size=batch, global_batch_size=batch)
    return Geometry(model=model, parallel=ParallelConfig(), train=train, accelerator="cpu")


def _block_input(
    cfg: ModelConfig, batch: int, seq: int
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    from trainer.model import TransformerBlock, rope_table

    x = torch.randn(batch, seq, cfg.dim, requires_grad=True)  # a block's input needs its gradient too
    return TransformerBlock(cfg), x, rope_table(cfg.head_dim, seq, cfg.rope_theta)


def block_figures(hw: HardwareProfile) -> dict[str, float]:
    """What a real block reaches on this machine, as the planner's figures.

    ``gemm_efficiency`` (η_max): the probe block's matmuls, each in the three orientations forward and
    backward run (x·Wᵀ, g·W, gᵀ·x), timed alone at the rate they sustain, against their time at the
    grid's peak and knee (the grid's best: so η_max also carries sustained over best).
    ``elementwise_bandwidth``: the bytes the planner counts for the block's element-wise work forward
    and backward (compute.elementwise_bytes, ×3), over what the whole block's forward + backward takes
    beyond the planner's price for everything else in it (matmuls at that η, attention, launches). So the
    planner's block equals the measured one for the probe's shape; other shapes extrapolate from it.
    Never faster than a plain copy (``hw.hbm_bandwidth``). Both at the rates a step sustains
    (``sustained_seconds``).
    """
    geo = _probe_geometry(PROBE_BATCH, PROBE_SEQ)
    ideal = measured = 0.0
    for m, n, k in block_matmuls(geo):
        x, w, g = torch.randn(int(m), int(k)), torch.randn(int(n), int(k)), torch.randn(int(m), int(n))
        for matmul in (
            lambda x=x, w=w: torch.nn.functional.linear(x, w),
            lambda g=g, w=w: g @ w,
            lambda g=g, x=x: g.t() @ x,
        ):
            measured += sustained_seconds(matmul, window_s=SUSTAIN_S / 2)
        ideal += sum(gemm_seconds(*shape, hw, "fp32") for shape in ((m, n, k), (m, k, n), (k, n, m)))
    efficiency = hw.gemm_efficiency * ideal / measured
    block, x, rope = _block_input(geo.model, PROBE_BATCH, PROBE_SEQ)
    whole = sustained_seconds(lambda: block(x, rope).sum().backward())
    rest = block_seconds(geo, replace(hw, gemm_efficiency=efficiency, elementwise_bandwidth=math.inf))
    elementwise = 3 * elementwise_bytes(geo)
    spare = whole - rest.forward - rest.backward
    bandwidth = elementwise / spare if spare > elementwise / hw.hbm_bandwidth else hw.hbm_bandwidth
    return {"gemm_efficiency": efficiency, "elementwise_bandwidth": bandwidth}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _median_collective(collective: Callable[[], object]) -> float:
    """Median time of a collective over a fixed count of calls (the same on every rank, so they match),
    after the first: a step runs each collective once, at whatever the host gives it then, and the
    benchmark reports the median step."""
    samples = []
    for _ in range(COLLECTIVE_REPEATS):
        dist.barrier()
        began = time.perf_counter()
        collective()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples[1:])


def _concurrent_seconds(work: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``work`` when every rank runs it at once: the slowest rank's (a step waits
    for it), as ``sustained_seconds`` measures it alone (the median of windows of ``calls`` back-to-back
    calls, which every rank runs together), so that the share is sustained against sustained."""
    windows = []
    for _ in range(SUSTAIN_WINDOWS):
        dist.barrier()
        began = time.perf_counter()
        for _ in range(calls):
            work()
        slowest = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        windows.append(slowest.item() / calls)
    return statistics.median(windows)


class BlockStack(torch.nn.Module):
    """``blocks`` transformer blocks (trainer/model.py) in a row, called as one block is."""

    def __init__(self, cfg: ModelConfig, blocks: int) -> None:
        from trainer.model import TransformerBlock

        super().__init__()
        self.layers = torch.nn.ModuleList(TransformerBlock(cfg) for _ in range(blocks))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x, rope)
        return x


def shard_stack(stack: BlockStack) -> BlockStack:
    """``fully_shard`` each block, then the stack as the root unit (as trainer/parallel/fsdp.py does)."""
    from torch.distributed.fsdp import fully_shard

    for block in stack.layers:
        fully_shard(block)
    return fully_shard(stack)


def _fsdp_round_trips() -> list[dict[str, float]]:
    """FSDP2's round trip of one unit over this process group: forward + backward of ``FSDP_STACK``
    transformer blocks under ``fully_shard`` (each: all-gather, reshard, all-gather again,
    reduce-scatter) less the same blocks unsharded, per block, for each of ``FSDP_UNITS``."""
    from trainer.model import rope_table

    rows = []
    for preset in FSDP_UNITS:
        cfg = ModelConfig(preset=preset)
        plain, sharded = BlockStack(cfg, FSDP_STACK), shard_stack(BlockStack(cfg, FSDP_STACK))
        rope = rope_table(cfg.head_dim, FSDP_SEQ, cfg.rope_theta)
        x = torch.randn(FSDP_BATCH, FSDP_SEQ, cfg.dim)
        extra = _wall_extra_seconds((sharded, x), (plain, x), rope)
        rows.append(
            {
                "bytes": FP32_BYTES * sum(p.numel() for p in plain.layers[0].parameters()),
                "seconds": extra / FSDP_STACK,
            }
        )
    return rows


def _wall_extra_seconds(
    wrapped: tuple[torch.nn.Module, torch.Tensor],
    plain: tuple[torch.nn.Module, torch.Tensor],
    rope: torch.Tensor,
) -> float:
    """What forward + backward of ``wrapped`` (a module and its input) takes beyond ``plain``'s: the
    median wall seconds of each, their samples interleaved so that a slow stretch of a shared host
    falls on both alike rather than on one of them."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(REPEATS):
        for (module, x), times in zip((wrapped, plain), samples, strict=True):
            times.append(_wall_round_trip_seconds(module, x, rope))
    return statistics.median(samples[0][WARMUP:]) - statistics.median(samples[1][WARMUP:])


def _wall_round_trip_seconds(block: torch.nn.Module, x: torch.Tensor, rope: torch.Tensor) -> float:
    """Wall seconds of one forward + backward, every rank starting together (the same count on each):
    ranks wait for each other at every collective of an FSDP unit or a TP block, and that wait is part
    of its cost."""
    dist.barrier()
    began = time.perf_counter()
    out = block(x, rope)
    local_tensor(out).sum().backward()
    return time.perf_counter() - began


def narrow_to_one_tp_rank(block: torch.nn.Module, world: int) -> None:
    """Give ``block`` one TP rank's projections: 1/world of the heads (same head size) and hidden width."""
    for name, module in list(block.named_modules()):
        if isinstance(module, torch.nn.Linear):
            out_features, in_features = module.out_features, module.in_features
            if name.endswith(("wo", "w2")):
                in_features //= world
            else:
                out_features //= world
            parent, _, attr = name.rpartition(".")
            setattr(block.get_submodule(parent), attr, torch.nn.Linear(in_features, out_features, bias=False))


def _tp_round_trips(world: int) -> list[dict[str, float]]:
    """The probe block under tensor + sequence parallelism over this group (trainer/parallel/tensor.py:
    DTensor, two all-gathers and two reduce-scatters each way) less its unsplit twin (1/world of the
    heads and hidden width: the same local matmuls) on the same tokens, for each of ``TP_BATCHES``."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.tensor import apply_tp_block

    full = ModelConfig(**PROBE_BLOCK)
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for batch in TP_BATCHES:
        plain, x, rope = _block_input(full, batch, TP_SEQ)
        narrow_to_one_tp_rank(plain, world)
        split, _, _ = _block_input(full, batch, TP_SEQ)
        apply_tp_block(split, mesh)
        local = torch.randn(batch, TP_SEQ // world, full.dim, requires_grad=True)  # this rank's shard
        rows.append(
            {
                "bytes": FP32_BYTES * batch * TP_SEQ * full.dim,  # the activation a TP collective assembles
                "seconds": _wall_extra_seconds((split, local), (plain, x), rope),
            }
        )
    return rows


def fit_round_trip(rows: list[dict[str, float]]) -> tuple[float, float]:
    """(λ, r) of t = λ + P·r through the smallest and largest point measured (P: the bytes the cost
    grows with), neither below zero (a noisy small point can fall under the line)."""
    small, large = min(rows, key=lambda r: r["bytes"]), max(rows, key=lambda r: r["bytes"])
    per_byte = max(0.0, (large["seconds"] - small["seconds"]) / (large["bytes"] - small["bytes"]))
    return max(0.0, small["seconds"] - per_byte * small["bytes"]), per_byte


def fsdp_alone() -> dict[str, float]:
    """FSDP2's round trip on a one-process mesh, as t = λ + P·r: what a layout that splits the model
    but not its data (TP, PP, CP or EP with dp_shard = 1) pays, since the trainer wraps those in FSDP
    too, for one parameter type and mixed precision (``trainer/parallel/parallelize.py``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "fsdp.json")
        mp.spawn(_fsdp_alone_worker, args=(_free_port(), out), nprocs=1, join=True)
        latency, per_byte = fit_round_trip(json.loads(Path(out).read_text()))
    return {"latency_s": latency, "s_per_byte": per_byte}


def _join_gloo(rank: int, world: int, port: int) -> None:
    """A spawned worker's one-thread process, in a gloo group of ``world`` on this host."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _fsdp_alone_worker(rank: int, port: int, out: str) -> None:
    _join_gloo(rank, 1, port)
    Path(out).write_text(json.dumps(_fsdp_round_trips()))
    dist.destroy_process_group()


def _collective_worker(rank: int, world: int, port: int, out: str, calls: dict[str, int]) -> None:
    _join_gloo(rank, world, port)
    concurrent = {name: _concurrent_seconds(work, calls[name]) for name, work in share_work().items()}
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    timings = []
    for size in COLLECTIVE_BYTES:
        shard = torch.zeros(size // 4 // world)
        gathered = torch.empty(shard.numel() * world)
        seconds = _median_collective(lambda shard=shard, gathered=gathered: gather(gathered, shard))
        timings.append({"bytes": shard.numel() * world * 4, "seconds": seconds})
    full = torch.zeros(COLLECTIVE_BYTES[-1] // 4)
    # The library's reduce-scatter and all-reduce against the ring model's time for them.
    reduce_scatter = _median_collective(lambda: dist.reduce_scatter_tensor(shard, full))
    reduce_scatter /= timings[-1]["seconds"]
    all_reduce = _median_collective(lambda: dist.all_reduce(full)) / (2 * timings[-1]["seconds"])
    fsdp = _fsdp_round_trips()
    tp = _tp_round_trips(world)
    if rank == 0:
        result = {
            "concurrent_s": concurrent,
            "fsdp": fsdp,
            "tp": tp,
            "timings": timings,
            "reduce_scatter_factor": reduce_scatter,
            "all_reduce_factor": all_reduce,
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def collective_link(world: int, alone: dict[str, dict[str, float]]) -> dict[str, Any]:
    """α from the smallest all-gather (all latency: t = (n−1)·α), β from the largest after removing it:
    t = (n−1)·α + S·(n−1)/n / B (two points: a shared host's timings are too noisy for a fit); and the
    share of one process's matmul rate each of ``world`` processes gets when all compute at once
    (against ``alone``: ``alone_rates``, the same work in one process, sustained), and of its memory
    bandwidth (a copy: the memory sockets and caches are shared, so n streaming processes each get
    less, even with a core each); FSDP2's round trip of a unit as t = λ + P·r over
    its fp32 parameter bytes P, through the two units measured; and a TP block's cost over its unsplit
    twin as t = λ + A·r over the fp32 bytes A of the activation its collectives assemble."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        calls = {name: int(rate["calls"]) for name, rate in alone.items()}
        mp.spawn(_collective_worker, args=(world, _free_port(), out, calls), nprocs=world, join=True)
        result = json.loads(Path(out).read_text())
    timings = result["timings"]
    latency = timings[0]["seconds"] / (world - 1)
    largest = timings[-1]
    moved = largest["bytes"] * (world - 1) / world
    bandwidth = moved / max(largest["seconds"] - (world - 1) * latency, 1e-9)
    fsdp_latency, fsdp_per_byte = fit_round_trip(result["fsdp"])
    tp_latency, tp_per_byte = fit_round_trip(result["tp"])
    cores = os.cpu_count() or world
    concurrent = result["concurrent_s"]
    compute_share = share(alone["gemm"]["seconds"], concurrent["gemm"], world, cores)
    memory_share = share(alone["copy"]["seconds"], concurrent["copy"], world, cores)
    return {
        "ranks": world,
        "latency_s": latency,
        "bandwidth": bandwidth,
        "reduce_scatter_factor": result["reduce_scatter_factor"],
        "all_reduce_factor": result["all_reduce_factor"],
        "compute_share": compute_share,
        "memory_share": memory_share,
        "fsdp_latency_s": fsdp_latency,
        "fsdp_s_per_byte": fsdp_per_byte,
        "tp_latency_s": tp_latency,
        "tp_s_per_byte": tp_per_byte,
        "raw": timings,
        "raw_share_s": {
            name: {"alone": alone[name]["seconds"], "concurrent": concurrent[name]} for name in alone
        },
        "raw_fsdp": result["fsdp"],
        "raw_tp": result["tp"],
    }


def measure(max_ranks: int = 4) -> dict[str, Any]:
    """Every figure of the profile, measured in this process (one thread) and in gloo groups of 2..max_ranks."""
    torch.set_num_threads(1)
    grids = {name: gemm_grid(dtype) for name, dtype in DTYPES.items()}
    peaks = {name: max(row["flops_per_s"] for row in rows) for name, rows in grids.items()}
    knee = fit_knee(grids["fp32"], peaks["fp32"])
    ranks = [n for n in (2, 4, 8) if n <= max_ranks]
    alone = alone_rates()
    bandwidth = 2 * FP32_BYTES * COPY_ELEMENTS / alone["copy"]["seconds"]
    kernels = {
        "gemm_efficiency": 1.0,  # of the grid's best; block_figures measures what a block's matmuls reach
        "gemm_knee": knee,
        "attention_efficiency": attention_efficiency(peaks["fp32"], knee),
        "hbm_bandwidth": bandwidth,
        "kernel_overhead_s": kernel_overhead(),
    }
    cpu = catalog_profile(get_chip("cpu"))
    probe = replace(
        cpu, peak_flops={**cpu.peak_flops, **peaks}, **kernels, elementwise_bandwidth=kernels["hbm_bandwidth"]
    )
    return {
        "chip": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name().lower(),
        "host": platform.node(),
        "host_cores": os.cpu_count(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "peak_flops": peaks,
        **kernels,
        **block_figures(probe),
        "collectives": [collective_link(n, alone) for n in ranks],
        "fsdp_alone": fsdp_alone(),
        "gemm_grid": grids,
    }


def calibrate(out: Path, max_ranks: int = 4) -> Path:
    """Measure and write the profile to ``out`` (for ``tessera plan --profile``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(measure(max_ranks), indent=2) + "\n")
    return out
