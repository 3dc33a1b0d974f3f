"""Seconds of one kernel on one chip: matmuls, fused attention, memory-bound element-wise work.

Each is a roofline: the larger of the compute-bound and the HBM-bound time. Kernel launch cost is
added per kernel on CPU, where dispatch is serial, and only where it outlasts the device work on
accelerators, whose launch queue runs ahead of the device (see :func:`with_launches`).
"""

from __future__ import annotations

from trainer.config import Precision
from trainer.plan.profile import HardwareProfile, MatmulPrecision


def gemm_efficiency(m: float, n: float, k: float, hw: HardwareProfile) -> float:
    """Fraction of peak an (m×k)·(k×n) matmul reaches: η_max · x / (x + knee), x = min(m, n, k).

    Small or skinny matmuls leave tensor cores idle (too few output tiles to fill the SMs, too short
    an inner loop to amortise loads): NVIDIA's "Matrix Multiplication Background" guide, and the MAMF
    sweeps the catalog cites for η_max. The knee is the smallest dimension at half of η_max.
    """
    smallest = min(m, n, k)
    return hw.gemm_efficiency * smallest / (smallest + hw.gemm_knee)


ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
# torchao's dynamic fp8 scaling before each fp8 matmul, per operand element: read the bf16 operand for
# its amax, read it again and write the fp8 copy (unfused; compile fuses some of it: an upper bound).
FP8_CAST_BYTES = 2 + 2 + 1


def gemm_seconds(m: float, n: float, k: float, hw: HardwareProfile, precision: MatmulPrecision) -> float:
    """max(2mnk / (peak · η), e · (mk + kn + mn) / HBM bandwidth): compute- or memory-bound; fp8 at the
    chip's fp8 peak plus the memory-bound casts of both operands."""
    compute = 2 * m * n * k / (hw.peak(precision) * gemm_efficiency(m, n, k, hw))
    memory = ELEMENT_BYTES[precision] * (m * k + k * n + m * n) / hw.hbm_bandwidth
    cast = FP8_CAST_BYTES * (m * k + k * n) / hw.hbm_bandwidth if precision == "fp8" else 0.0
    return max(compute, memory) + cast


def attention_flops(batch: float, seq: int, width: float) -> float:
    """Forward FLOPs of causal flash attention: QKᵀ and PV, 2·2·b·s²·width, halved because the kernel
    skips the masked upper triangle's tiles (FlashAttention-2, Dao 2023, §3.1). ``width`` = heads·head_dim
    on this chip. Backward is 2.5× forward: it recomputes QKᵀ and runs four more matmuls (ibid., §3.1.2).
    """
    return 2 * batch * seq * seq * width


def attention_seconds(
    batch: float, seq: int, width: float, hw: HardwareProfile, precision: Precision
) -> float:
    """Forward time of flash attention at the chip's attention efficiency (it reads q, k, v and writes o
    once, so it is compute-bound at training sequence lengths)."""
    efficiency = hw.attention_efficiency * seq / (seq + hw.gemm_knee)
    return attention_flops(batch, seq, width) / (hw.peak(precision) * efficiency)


def memory_seconds(nbytes: float, hw: HardwareProfile) -> float:
    """Memory-bound streams (copies, casts, the loss, the optimizer) at HBM bandwidth."""
    return nbytes / hw.hbm_bandwidth


def elementwise_seconds(nbytes: float, hw: HardwareProfile) -> float:
    """A block's element-wise work (norms, RoPE, activations, residuals), counted in the bytes of
    ``compute.elementwise_bytes``, at the bandwidth such work reaches: HBM's on accelerators; on a
    calibrated host, what the probe block's measured time implies (eager kernels on small tensors,
    and the layout copies around attention, run well below a plain copy)."""
    return nbytes / hw.elementwise_bandwidth


def with_launches(device_s: float, kernels: float, hw: HardwareProfile) -> float:
    """Device time plus launch cost: summed on CPU (each op dispatches before it runs), the larger of
    the two on accelerators (an async queue hides launches behind kernels that outlast them)."""
    launches = kernels * hw.kernel_overhead_s
    return device_s + launches if hw.host_bound else max(device_s, launches)
