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

On an accelerator the same functions run on the device, at the trainer's compute dtype (bf16) and at
sizes that fill it (``DEVICE_SHAPES``), timed by the device (``trainer.plan.timers``: CUDA events on
GPUs): the matmul grid (and an fp8 one where the GPU has fp8 matmuls), HBM bandwidth from a
device-to-device copy, fused attention, a real block's matmul and element-wise rates, and per group of
2, 4, 8 GPUs NCCL's all-gather α and β and its reduce-scatter and all-reduce against the ring model.
Nothing there measures the host: its share, FSDP and TP round-trip terms are host costs an
accelerator's queue hides, so a device profile leaves them out (the catalog's zero). The profile names
the catalog's chip from the device's name (``chips.chip_for_device``), or says which name it did not
recognise. TPU and Trainium: their runtimes expose no event timer or device name here, so the
host clock around a synchronised queue times them, ``--chip`` names them, and collectives are not
measured (the catalog's links stay).

The checkpoint directory's raw write speed (``trainer.plan.disk``) becomes the profile's
``checkpoint_write_bandwidth``, which the plan's checkpoint write time uses.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.backends.chips import chip_for_device, chips_for, get_chip
from trainer.config import ModelConfig, ParallelConfig, TrainConfig
from trainer.plan.compute import block_matmuls, block_seconds, elementwise_bytes
from trainer.plan.disk import raw_disk_speed
from trainer.plan.kernels import gemm_seconds
from trainer.plan.layout import Geometry
from trainer.plan.profile import HardwareProfile, MatmulPrecision, catalog_profile
from trainer.plan.timers import HostTimer, Timer, device_timer
from trainer.rank.local_tensor import local_tensor
from trainer.units import GiB, MiB

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
# An accelerator's probe block: sized like a billion-parameter model's (a GPU's matmuls reach their
# plateau there) but shaped unlike the benchmark rows', so their plans extrapolate from it too.
DEVICE_PROBE_BLOCK: dict[str, Any] = dict(
    preset="custom",
    n_layers=1,
    dim=3072,
    n_heads=24,
    n_kv_heads=8,
    ffn_dim=8192,
    vocab_size=8,
    rope_theta=5e5,
)
# NCCL's collectives: from latency-bound to well past the size where the links saturate.
DEVICE_COLLECTIVE_BYTES = (2**16, 2**20, 2**24, 2**28)
ACCELERATORS = {"cpu": "cpu", "cuda": "gpu", "tpu": "tpu", "neuron": "trainium"}  # torch device → family
CHECKPOINT_PROBE_BYTES = {"cpu": 256 * MiB, "device": 4 * GiB, "quick": 16 * MiB}


@dataclass(frozen=True)
class Shapes:
    """The sizes calibration measures at, and for how long it samples each sustained rate."""

    gemm_sizes: tuple[int, ...]
    copy_elements: int
    attention: tuple[int, int, int, int]  # batch, heads, sequence, head dim
    block: dict[str, Any]
    block_batch: int
    block_seq: int
    precision: MatmulPrecision  # what the trainer's matmuls compute in there
    sustain_s: float = SUSTAIN_S
    windows: int = SUSTAIN_WINDOWS


HOST_SHAPES = Shapes(GEMM_SIZES, COPY_ELEMENTS, (2, 4, 256, 64), PROBE_BLOCK, PROBE_BATCH, PROBE_SEQ, "fp32")
# A device's sustained windows are short: its rates hardly vary, and no scheduler ticks interrupt it.
DEVICE_SHAPES = Shapes(
    (512, 2048, 4096, 8192), 2**28, (2, 16, 4096, 128), DEVICE_PROBE_BLOCK, 1, 4096, "bf16", 0.05, 5
)
# `make test`'s dry run of the GPU benchmark: the host's code path in seconds, its figures rough.
QUICK_SHAPES = replace(HOST_SHAPES, gemm_sizes=(32, 128, 256), sustain_s=0.02, windows=3)


@dataclass(frozen=True)
class Probe:
    """Where calibration measures: the device, the timer it reads, and the shapes it measures at."""

    device: torch.device
    timer: Timer
    shapes: Shapes

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.shapes.precision]

    def sustained(self, fn: Callable[[], object], window_s: float | None = None) -> float:
        window = self.shapes.sustain_s if window_s is None else window_s
        return sustained_seconds(fn, window, self.shapes.windows, self.timer)


HOST = HostTimer(torch.device("cpu"))


def host_probe(quick: bool = False) -> Probe:
    return Probe(torch.device("cpu"), HOST, QUICK_SHAPES if quick else HOST_SHAPES)


def best_seconds(
    fn: Callable[[], object], repeats: int = 5, min_time: float = 0.02, timer: Timer = HOST
) -> float:
    """Best over ``repeats`` of the mean time of enough calls to last ``min_time`` (after a warm-up).

    The best, for the matmul grid only: its peak and knee are the shape of the roofline (ratios between
    shapes), measured in short windows on a shared host; the level a step sustains is set against that
    ceiling by ``block_figures`` (sustained), which the gemm efficiency carries."""
    return min(_window_means(fn, _calls_lasting(fn, min_time, timer), repeats, timer))


def _calls_lasting(fn: Callable[[], object], window_s: float, timer: Timer = HOST) -> int:
    """How many back-to-back calls of ``fn`` last ``window_s`` (after one warm-up call), counted in
    doubling batches, each timed as a whole (a device's timer synchronises once per batch)."""
    fn()
    calls, elapsed = 1, 0.0
    while elapsed < window_s:
        elapsed += calls * timer.seconds(fn, calls)
        calls *= 2
    return calls


def sustained_seconds(
    fn: Callable[[], object],
    window_s: float = SUSTAIN_S,
    windows: int = SUSTAIN_WINDOWS,
    timer: Timer = HOST,
) -> float:
    """Median over ``windows`` of the mean time per call in a window of back-to-back calls lasting
    ``window_s`` (after a warm-up).

    For the rates a training step sustains: a step's time is the sum of its calls, with whatever
    interrupts them (scheduler ticks, gloo's threads, the host's daemons), and the benchmark reports the
    median step; a window's mean includes those interruptions, and the median over windows, like the
    step median, leaves out a rare burst. (``best_seconds`` keeps the fastest window: a ceiling, which
    a step does not sustain.)"""
    return _window_median(fn, _calls_lasting(fn, window_s, timer), windows, timer)


def _window_median(
    fn: Callable[[], object], calls: int, windows: int = SUSTAIN_WINDOWS, timer: Timer = HOST
) -> float:
    """Median over ``windows`` of the mean seconds per call in ``calls`` back-to-back calls."""
    return statistics.median(_window_means(fn, calls, windows, timer))


def _window_means(fn: Callable[[], object], calls: int, windows: int, timer: Timer = HOST) -> list[float]:
    """The mean seconds per call of ``windows`` windows, each ``calls`` back-to-back calls."""
    return [timer.seconds(fn, calls) for _ in range(windows)]


def gemm_grid(dtype: torch.dtype, probe: Probe) -> list[dict[str, float]]:
    rows = []
    sizes = probe.shapes.gemm_sizes
    for m in sizes:
        for n in sizes:
            for k in sizes:
                a = torch.randn(m, k, dtype=dtype, device=probe.device)
                b = torch.randn(k, n, dtype=dtype, device=probe.device)
                seconds = best_seconds(lambda a=a, b=b: a @ b, repeats=3, timer=probe.timer)
                rows.append({"m": m, "n": n, "k": k, "flops_per_s": 2 * m * n * k / seconds})
    return rows


def fp8_grid(probe: Probe) -> list[dict[str, float]]:
    """The square shapes of the grid as fp8 (e4m3) matmuls with bf16 output, the kernel torchao's
    ``Float8Linear`` runs (``torch._scaled_mm``; its second operand column-major)."""
    rows = []
    one = torch.tensor(1.0, device=probe.device)
    for size in probe.shapes.gemm_sizes:
        a = torch.randn(size, size, device=probe.device).to(torch.float8_e4m3fn)
        b = torch.randn(size, size, device=probe.device).to(torch.float8_e4m3fn).t()

        def matmul(a: torch.Tensor = a, b: torch.Tensor = b) -> object:
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        seconds = best_seconds(matmul, repeats=3, timer=probe.timer)
        rows.append({"m": size, "n": size, "k": size, "flops_per_s": 2 * size**3 / seconds})
    return rows


def has_fp8_matmul(device: torch.device) -> bool:
    """CUDA devices of compute capability 8.9 (Ada) or later run fp8 matmuls."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fit_knee(rows: list[dict[str, float]], peak: float) -> float:
    """Knee of η = x / (x + knee): the median of x·(1 − r)/r over shapes, r = throughput / peak."""
    knees = []
    for row in rows:
        ratio = min(row["flops_per_s"] / peak, 0.999)
        knees.append(min(row["m"], row["n"], row["k"]) * (1 - ratio) / ratio)
    return statistics.median(knees)


def copy_bandwidth(probe: Probe) -> float:
    """Bytes per second a plain copy moves (read + write) on the device, far past any cache: HBM's
    bandwidth on an accelerator (a device-to-device copy), the memory's on a host."""
    source = torch.randn(probe.shapes.copy_elements, device=probe.device)
    target = torch.empty_like(source)
    seconds = probe.sustained(lambda: target.copy_(source))
    return 2 * FP32_BYTES * probe.shapes.copy_elements / seconds


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


def kernel_overhead(probe: Probe) -> float:
    """Seconds of host work per kernel: one tiny Transformer block (trainer/models/llama/model.py, dim 8, one token)
    forward and backward, whose device work is nil, over the kernels the planner counts for it. On the
    host's clock (a device timer would see the nil device work, not the launches)."""
    from trainer.plan.compute import BACKWARD_KERNELS, BLOCK_KERNELS

    cfg = ModelConfig(
        preset="custom", n_layers=1, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=8, rope_theta=1e4
    )
    block, x, rope = _block_input(cfg, 1, 1, probe)
    host = replace(probe, timer=HostTimer(probe.device))
    seconds = host.sustained(lambda: block(x, rope).sum().backward())
    return seconds / ((1 + BACKWARD_KERNELS) * BLOCK_KERNELS[False])


def attention_efficiency(peak: float, knee: float, probe: Probe) -> float:
    """Fraction of peak SDPA (causal) reaches fwd + bwd, net of the shape factor the planner applies."""
    batch, heads, seq, head_dim = probe.shapes.attention
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, device=probe.device, dtype=probe.dtype, requires_grad=True)
        for _ in range(3)
    )

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = 3.5 * 2 * batch * seq * seq * heads * head_dim  # fwd + 2.5× bwd, causal half of 4·b·s²·w
    return flops / probe.sustained(step) / (peak * seq / (seq + knee))


def _probe_geometry(batch: int, seq: int, probe: Probe) -> Geometry:
    """The planner's view of the probe block on one process, in the probe's compute dtype."""
    shapes = probe.shapes
    model = ModelConfig(**shapes.block)
    train = TrainConfig(steps=1, seq_len=seq, micro_batch_size=batch, global_batch_size=batch)
    parallel = ParallelConfig(mixed_precision="bf16" if shapes.precision == "bf16" else "fp32")
    accelerator = ACCELERATORS[probe.device.type]
    return Geometry(model=model, parallel=parallel, train=train, accelerator=accelerator)


def _block_input(
    cfg: ModelConfig, batch: int, seq: int, probe: Probe | None = None
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A block, its input and its RoPE table, on the probe's device in its compute dtype (the
    trainer's FSDP casts parameters to it)."""
    from trainer.models.llama.model import TransformerBlock, rope_table

    probe = probe or host_probe()
    block = TransformerBlock(cfg).to(probe.device, probe.dtype)
    # a block's input needs its gradient too
    x = torch.randn(batch, seq, cfg.dim, device=probe.device, dtype=probe.dtype, requires_grad=True)
    return block, x, rope_table(cfg.head_dim, seq, cfg.rope_theta, scaling=cfg.rope_scaling).to(probe.device)


def block_figures(hw: HardwareProfile, probe: Probe) -> dict[str, float]:
    """What a real block reaches on this machine, as the planner's figures.

    ``gemm_efficiency`` (η_max): the probe block's matmuls, each in the three orientations forward and
    backward run (x·Wᵀ, g·W, gᵀ·x), timed alone at the rate they sustain, against their time at the
    grid's peak and knee (the grid's best: so η_max also carries sustained over best).
    ``elementwise_bandwidth``: the bytes the planner counts for the block's element-wise work forward
    and backward (compute.elementwise_bytes, ×3), over what the whole block's forward + backward takes
    beyond the planner's price for everything else in it (matmuls at that η, attention, launches). So the
    planner's block equals the measured one for the probe's shape; other shapes extrapolate from it.
    Never faster than a plain copy (``hw.hbm_bandwidth``). Both at the rates a step sustains
    (``sustained_seconds``), in the trainer's compute dtype on the probe's device.
    """
    shapes = probe.shapes
    geo = _probe_geometry(shapes.block_batch, shapes.block_seq, probe)
    ideal = measured = 0.0
    for m, n, k in block_matmuls(geo):
        x, w, g = (
            torch.randn(int(rows), int(cols), device=probe.device, dtype=probe.dtype)
            for rows, cols in ((m, k), (n, k), (m, n))
        )
        for matmul in (
            lambda x=x, w=w: torch.nn.functional.linear(x, w),
            lambda g=g, w=w: g @ w,
            lambda g=g, x=x: g.t() @ x,
        ):
            measured += probe.sustained(matmul, window_s=shapes.sustain_s / 2)
        ideal += sum(
            gemm_seconds(*shape, hw, shapes.precision) for shape in ((m, n, k), (m, k, n), (k, n, m))
        )
    efficiency = hw.gemm_efficiency * ideal / measured
    block, x, rope = _block_input(geo.model, shapes.block_batch, shapes.block_seq, probe)
    whole = probe.sustained(lambda: block(x, rope).sum().backward())
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
    """``blocks`` transformer blocks (trainer/models/llama/model.py) in a row, called as one block is."""

    def __init__(self, cfg: ModelConfig, blocks: int) -> None:
        from trainer.models.llama.model import TransformerBlock

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
    from trainer.models.llama.model import rope_table

    rows = []
    for preset in FSDP_UNITS:
        cfg = ModelConfig(preset=preset)
        plain, sharded = BlockStack(cfg, FSDP_STACK), shard_stack(BlockStack(cfg, FSDP_STACK))
        rope = rope_table(cfg.head_dim, FSDP_SEQ, cfg.rope_theta, scaling=cfg.rope_scaling)
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

    from trainer.models.llama.parallelize import apply_tp_block

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
    """α and β of gloo's all-gathers (``fit_link``); the
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
    fsdp_latency, fsdp_per_byte = fit_round_trip(result["fsdp"])
    tp_latency, tp_per_byte = fit_round_trip(result["tp"])
    cores = os.cpu_count() or world
    concurrent = result["concurrent_s"]
    compute_share = share(alone["gemm"]["seconds"], concurrent["gemm"], world, cores)
    memory_share = share(alone["copy"]["seconds"], concurrent["copy"], world, cores)
    return {
        **link_figures(result, world),
        "compute_share": compute_share,
        "memory_share": memory_share,
        "fsdp_latency_s": fsdp_latency,
        "fsdp_s_per_byte": fsdp_per_byte,
        "tp_latency_s": tp_latency,
        "tp_s_per_byte": tp_per_byte,
        "raw_share_s": {
            name: {"alone": alone[name]["seconds"], "concurrent": concurrent[name]} for name in alone
        },
        "raw_fsdp": result["fsdp"],
        "raw_tp": result["tp"],
    }


def _device_collective_worker(rank: int, world: int, port: int, out: str) -> None:
    """One GPU's process in an NCCL group of ``world``: all-gathers of growing buffers, then the largest
    buffer's reduce-scatter and all-reduce, each the mean of back-to-back calls on CUDA events."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    timer = device_timer(device)

    def seconds(collective: Callable[[], object]) -> float:
        collective()  # NCCL builds its communicator on the first call
        dist.barrier()
        return timer.seconds(collective, COLLECTIVE_REPEATS)

    timings = []
    for size in DEVICE_COLLECTIVE_BYTES:
        shard = torch.zeros(size // 4 // world, device=device)
        gathered = torch.empty(shard.numel() * world, device=device)
        gathering = seconds(
            lambda shard=shard, gathered=gathered: dist.all_gather_into_tensor(gathered, shard)
        )
        timings.append({"bytes": shard.numel() * world * 4, "seconds": gathering})
    full = torch.zeros(DEVICE_COLLECTIVE_BYTES[-1] // 4, device=device)
    reduce_scatter = seconds(lambda: dist.reduce_scatter_tensor(shard, full)) / timings[-1]["seconds"]
    all_reduce = seconds(lambda: dist.all_reduce(full)) / (2 * timings[-1]["seconds"])
    if rank == 0:
        result = {
            "timings": timings,
            "reduce_scatter_factor": reduce_scatter,
            "all_reduce_factor": all_reduce,
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def device_link(world: int) -> dict[str, Any]:
    """α and β of NCCL over ``world`` GPUs of this host, as ``collective_link`` fits gloo's (the two
    end points of the all-gathers), and its reduce-scatter and all-reduce against the ring model.
    Nothing of the host: an accelerator's queue hides its shares and round trips."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        mp.spawn(_device_collective_worker, args=(world, _free_port(), out), nprocs=world, join=True)
        result = json.loads(Path(out).read_text())
    return link_figures(result, world)


def link_figures(result: dict[str, Any], world: int) -> dict[str, Any]:
    """What gloo's and NCCL's workers both measure, as the profile stores it: α and β of the
    all-gathers (``fit_link``), the reduce-scatter and all-reduce factors, and the raw timings."""
    latency, bandwidth = fit_link(result["timings"], world)
    return {
        "ranks": world,
        "latency_s": latency,
        "bandwidth": bandwidth,
        "reduce_scatter_factor": result["reduce_scatter_factor"],
        "all_reduce_factor": result["all_reduce_factor"],
        "raw": result["timings"],
    }


def fit_link(timings: list[dict[str, float]], world: int) -> tuple[float, float]:
    """α from the smallest all-gather (all latency: t = (n−1)·α), β from the largest after removing it:
    t = (n−1)·α + S·(n−1)/n / B (two points: a shared host's timings are too noisy for a fit)."""
    latency = timings[0]["seconds"] / (world - 1)
    largest = timings[-1]
    moved = largest["bytes"] * (world - 1) / world
    return latency, moved / max(largest["seconds"] - (world - 1) * latency, 1e-9)


def device_name(device: torch.device) -> str:
    """What the runtime calls the device: CUDA's name, else the device type (TPU and Trainium expose
    none here)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def catalog_chip(device: torch.device) -> str | None:
    """The catalog's chip for ``device``: ``cpu`` for the host, a GPU by its name and memory, None
    where the catalog has no such name (and for TPU and Trainium, which ``--chip`` names)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return chip_for_device(device_name(device), torch.cuda.get_device_properties(device).total_memory)
    return None


def measure_device(probe: Probe, max_ranks: int) -> dict[str, Any]:
    """The compute and memory figures on ``probe``'s device, and the collectives of this host's groups:
    gloo processes on CPU (with their shares and round trips, see ``collective_link``), NCCL on GPUs."""
    grids = {name: gemm_grid(dtype, probe) for name, dtype in DTYPES.items()}
    if has_fp8_matmul(probe.device):
        grids["fp8"] = fp8_grid(probe)
    peaks = {name: max(row["flops_per_s"] for row in rows) for name, rows in grids.items()}
    knee = fit_knee(grids[probe.shapes.precision], peaks[probe.shapes.precision])
    kernels = {
        "gemm_efficiency": 1.0,  # of the grid's best; block_figures measures what a block's matmuls reach
        "gemm_knee": knee,
        "attention_efficiency": attention_efficiency(peaks[probe.shapes.precision], knee, probe),
        "hbm_bandwidth": copy_bandwidth(probe),
        "kernel_overhead_s": kernel_overhead(probe),
    }
    figures: dict[str, Any] = {"peak_flops": peaks, **kernels, "gemm_grid": grids}
    if probe.shapes is QUICK_SHAPES:  # no process groups: their start-up alone takes seconds each
        figures["collectives"] = []
    elif probe.device.type == "cpu":
        ranks = [n for n in (2, 4, 8) if n <= max_ranks]
        alone = alone_rates() if ranks else {}
        figures["collectives"] = [collective_link(n, alone) for n in ranks]
        figures["fsdp_alone"] = fsdp_alone()
    elif probe.device.type == "cuda":
        gpus = min(max_ranks, torch.cuda.device_count())
        figures["collectives"] = [device_link(n) for n in (2, 4, 8) if n <= gpus]
    return figures


def measure(
    max_ranks: int = 4,
    device: torch.device | None = None,
    chip: str | None = None,
    quick: bool = False,
    checkpoint_dir: Path | None = None,
) -> dict[str, Any]:
    """Every figure of the profile, measured on ``device`` (default: the GPU where there is one, else
    this host, one thread) and in groups of 2..max_ranks of them; ``chip`` names the catalog's chip
    where the device's name does not (TPU, Trainium, a GPU the catalog calls otherwise); ``quick``
    (host only): fewer shapes, short windows and no process groups, for the GPU benchmark's dry run."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
        probe = host_probe(quick)
    else:
        probe = Probe(device, device_timer(device), DEVICE_SHAPES)
    name = device_name(device)
    chip = chip or catalog_chip(device)
    figures = measure_device(probe, max_ranks)
    # The figures calibration does not measure (links across hosts, HBM size) are the named chip's, or
    # an unnamed device's family's first.
    base = catalog_profile(get_chip(chip or chips_for(ACCELERATORS[device.type])[0]))
    measured = replace(
        base,
        peak_flops={**base.peak_flops, **figures["peak_flops"]},
        **{key: figures[key] for key in ("gemm_efficiency", "gemm_knee", "attention_efficiency")},
        hbm_bandwidth=figures["hbm_bandwidth"],
        kernel_overhead_s=figures["kernel_overhead_s"],
        elementwise_bandwidth=figures["hbm_bandwidth"],
    )
    figures |= block_figures(measured, probe)
    if "fp8" not in figures["peak_flops"] and base.chip.peak_fp8_flops and device.type != "cpu":
        # Not measured (no fp8 matmul on this runtime): the catalog's, at the share of its bf16 peak
        # this device reached, so that fp8 and bf16 rows keep their ratio against the measured η.
        figures["peak_flops"]["fp8"] = (
            base.chip.peak_fp8_flops * figures["peak_flops"]["bf16"] / (base.chip.peak_bf16_flops)
        )
    disk = checkpoint_dir or Path(tempfile.gettempdir())
    probe_bytes = CHECKPOINT_PROBE_BYTES["quick" if quick else "cpu" if device.type == "cpu" else "device"]
    raw = raw_disk_speed(disk, probe_bytes)
    grid = figures.pop("gemm_grid")
    return {
        "chip": chip or name.lower(),
        **({} if chip else {"unrecognised_device": name}),
        "device_name": name,
        "host": platform.node(),
        "host_cores": os.cpu_count(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        **figures,
        "checkpoint_write_bandwidth": raw["write_gbps"] * 1e9,
        "checkpoint_disk": {"directory": str(disk), **raw},
        "gemm_grid": grid,
    }


def calibrate(
    out: Path,
    max_ranks: int = 4,
    device: torch.device | None = None,
    chip: str | None = None,
    quick: bool = False,
    checkpoint_dir: Path | None = None,
) -> dict[str, Any]:
    """Measure (see :func:`measure`) and write the profile to ``out`` (for ``tessera plan --profile``);
    returns it."""
    profile = measure(max_ranks, device, chip, quick, checkpoint_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile
