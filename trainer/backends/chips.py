"""Chip catalog: the hardware figures the planner and the spec validation use.

Bandwidths here are **one-direction per chip** (B in the nccl-tests formulas): NVLink and TPU ICI
are published bidirectional, so they are halved. Sources are the vendors' public pages, gathered in
``shared/CHIPS.md``; figures marked *assumed* have no single public number and are our estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.units import GiB

GB = 1e9
TFLOPS = 1e12

# Llama 3 405B (Dubey et al. 2024, §3.3.4): 419 unexpected interruptions in 54 days on 16,384 H100s
# → 419 / (54 × 24 × 16384) ≈ 1.97e-5 failures per chip-hour (≈ 50,700 h MTBF per chip). We use it for
# every accelerator for lack of published figures for the others.
LLAMA3_FAILURES_PER_CHIP_HOUR = 419 / (54 * 24 * 16384)


@dataclass(frozen=True, kw_only=True)
class Chip:
    """One accelerator type. ``domain_chips`` is the size of the fast (scale-up) interconnect domain."""

    name: str
    accelerator: str
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    peak_bf16_flops: float  # dense FLOP/s
    peak_fp8_flops: float | None
    intra_bandwidth: float  # bytes/s per chip, one direction, inside the scale-up domain
    inter_bandwidth: float  # bytes/s per chip, one direction, across domains (IB/EFA/DCN)
    domain_chips: int  # chips reachable over the scale-up link (NVLink domain, ICI slice, NeuronLink)
    chips_per_node: int  # chips per host in the usual instance type
    intra_latency_s: float = 5e-6  # α per ring step in the fast domain (assumed)
    inter_latency_s: float = 20e-6  # α per ring step across domains (assumed)
    # The time model's kernel figures (trainer/plan/kernels.py); `tessera calibrate` measures them.
    gemm_efficiency: float = 0.8  # fraction of peak the largest GEMMs reach (MAMF, see GEMM_SOURCES)
    gemm_knee: float = 384  # a GEMM's smallest dimension at which it reaches half of gemm_efficiency
    attention_efficiency: float = 0.5  # fraction of peak fused (flash) attention reaches, fwd + bwd
    kernel_overhead_s: float = 5e-6  # host cost to launch one kernel (hidden by async queues on accelerators)
    peak_fp32_flops: float | None = None  # dense fp32 matmuls (TF32 on NVIDIA); None: half of bf16
    failures_per_chip_hour: float = LLAMA3_FAILURES_PER_CHIP_HOUR
    interconnect: str = ""
    source: str = ""


# Kernel figures per family (defaults of the fields above; `tessera calibrate` replaces them).
# - gemm_efficiency: the Maximum Achievable Matmul FLOPS (MAMF) the ml-engineering book's
#   mamf-finder.py measured over a sweep of bf16 shapes (Bekman, "Machine Learning Engineering",
#   compute/accelerator): A100 SXM 267.9 of 312 TFLOP/s (86%), H100 SXM 792.1 of 989 (80%). V100 has no
#   published MAMF: cuBLAS fp16 GEMMs reach ~100 of 125 TFLOP/s (80%, assumed as for H100). TPUs have
#   no MAMF either: 0.94 is the value the published-runs table's calibration rows fit (MaxText reports
#   up to 71% *end-to-end* MFU on v5p, so the matmuls alone run well above that).
# - gemm_knee: GEMMs with a small dimension (skinny matmuls, small micro-batches) fall below the peak;
#   η = gemm_efficiency · x / (x + knee) with x the smallest dimension. 384 for GPUs is the value fit
#   to the calibration rows; NVIDIA's "Matrix Multiplication Background" guide shows the same shape
#   (throughput saturating once every dimension is a few hundred tiles of 128).
# - attention_efficiency: FlashAttention-2 reaches 50–73% of peak on A100 fwd+bwd (Dao 2023, §4.1);
#   on H100 FA2 (what torch SDPA runs) reaches ~35%, FA3 ~75% fwd (Shah et al. 2024, Fig. 5–6);
#   Megatron-LM 2021 materialised the scores (no flash), so A100 uses the lower end.
# - kernel_overhead_s: a CUDA launch costs ~5 µs of host time (PyTorch CUDA Graphs docs); on
#   accelerators it overlaps device work, on CPU every op's dispatch is serial (see kernels.py).
GPU_KERNELS = dict(gemm_knee=384, kernel_overhead_s=5e-6)
TPU_KERNELS = dict(gemm_efficiency=0.94, gemm_knee=128, attention_efficiency=0.6, kernel_overhead_s=2e-6)

CHIPS: dict[str, Chip] = {
    c.name: c
    for c in [
        # Host CPU stands in for a chip in local runs; figures are a modest 2-core dev box (assumed):
        # run `tessera calibrate` for this machine's own.
        Chip(
            name="cpu",
            accelerator="cpu",
            hbm_bytes=16 * GiB,
            hbm_bandwidth=10 * GB,
            peak_bf16_flops=0.1 * TFLOPS,
            peak_fp8_flops=None,
            peak_fp32_flops=0.1 * TFLOPS,
            intra_bandwidth=2 * GB,
            inter_bandwidth=1 * GB,
            domain_chips=64,
            chips_per_node=64,
            intra_latency_s=50e-6,
            inter_latency_s=100e-6,
            gemm_efficiency=0.7,
            gemm_knee=32,
            attention_efficiency=0.3,
            kernel_overhead_s=15e-6,
            interconnect="shared memory / loopback (gloo)",
            source="assumed",
        ),
        # NVIDIA A100 datasheet: 40 GB HBM2 1,555 GB/s or 80 GB HBM2e 2,039 GB/s; 312 TF bf16 dense,
        # 156 TF TF32; NVLink3 600 GB/s bidir; DGX A100 / Selene: 8 × HDR 200 Gb/s per node = 25 GB/s/GPU.
        Chip(
            name="a100-80gb",
            accelerator="gpu",
            hbm_bytes=80 * GB,
            hbm_bandwidth=2.039e12,
            peak_bf16_flops=312 * TFLOPS,
            peak_fp8_flops=None,
            intra_bandwidth=300 * GB,
            inter_bandwidth=25 * GB,
            domain_chips=8,
            chips_per_node=8,
            peak_fp32_flops=156 * TFLOPS,
            gemm_efficiency=0.86,
            attention_efficiency=0.5,
            **GPU_KERNELS,
            interconnect="NVLink3/NVSwitch + HDR InfiniBand",
            source="NVIDIA A100 datasheet",
        ),
        # NVIDIA V100 datasheet: SXM2 32 GB HBM2, 900 GB/s, 125 TF fp16 tensor (no bf16: mixed precision
        # is fp16 there), NVLink2 300 GB/s bidir; DGX-1: 8 GPUs, 4 × EDR 100 Gb/s per node = 6.25 GB/s/GPU.
        Chip(
            name="v100-32gb",
            accelerator="gpu",
            hbm_bytes=32 * GB,
            hbm_bandwidth=900 * GB,
            peak_bf16_flops=125 * TFLOPS,
            peak_fp8_flops=None,
            intra_bandwidth=150 * GB,
            inter_bandwidth=6.25 * GB,
            domain_chips=8,
            chips_per_node=8,
            peak_fp32_flops=15.7 * TFLOPS,
            gemm_efficiency=0.8,
            attention_efficiency=0.4,
            **GPU_KERNELS,
            interconnect="NVLink2 hybrid cube mesh + EDR InfiniBand",
            source="NVIDIA V100 datasheet; DGX-1",
        ),
        # A100 40 GB: the same datasheet (HBM2, 1,555 GB/s); the A100 80 GB's links and kernels.
        Chip(
            name="a100-40gb",
            accelerator="gpu",
            hbm_bytes=40 * GB,
            hbm_bandwidth=1.555e12,
            peak_bf16_flops=312 * TFLOPS,
            peak_fp8_flops=None,
            intra_bandwidth=300 * GB,
            inter_bandwidth=25 * GB,
            domain_chips=8,
            chips_per_node=8,
            peak_fp32_flops=156 * TFLOPS,
            gemm_efficiency=0.86,
            attention_efficiency=0.5,
            **GPU_KERNELS,
            interconnect="NVLink3/NVSwitch + HDR InfiniBand",
            source="NVIDIA A100 datasheet",
        ),
        # NVIDIA H100 page: 80 GB, 3.35 TB/s, 989 TF bf16 dense, 1979 fp8, 495 TF TF32; NVLink 900 GB/s
        # bidir. p5.48xlarge: 3,200 Gbps EFA for 8 GPUs = 50 GB/s per GPU.
        Chip(
            name="h100-sxm",
            accelerator="gpu",
            hbm_bytes=80 * GB,
            hbm_bandwidth=3.35e12,
            peak_bf16_flops=989 * TFLOPS,
            peak_fp8_flops=1979 * TFLOPS,
            intra_bandwidth=450 * GB,
            inter_bandwidth=50 * GB,
            domain_chips=8,
            chips_per_node=8,
            peak_fp32_flops=495 * TFLOPS,
            gemm_efficiency=0.80,
            attention_efficiency=0.35,
            **GPU_KERNELS,
            interconnect="NVLink4/NVSwitch + EFA/NDR InfiniBand",
            source="NVIDIA H100 page; AWS p5",
        ),
        # The 96 GB H100 of Meta's Grand Teton hosts (torchtitan docs/performance.md): 95 GiB HBM2e at
        # 2.4 TB/s, run at a 500 W power limit; its peak lies "between SXM and NVL" (torchtitan), so the
        # SXM's 989 TF is kept as the MFU denominator, as torchtitan does, and the power-capped clocks show
        # in gemm_efficiency, fit to the published-runs calibration rows (no MAMF at 500 W is published).
        # 400 Gb/s RDMA per GPU = 50 GB/s.
        Chip(
            name="h100-96gb",
            accelerator="gpu",
            hbm_bytes=95 * GiB,
            hbm_bandwidth=2.4e12,
            peak_bf16_flops=989 * TFLOPS,
            peak_fp8_flops=1979 * TFLOPS,
            intra_bandwidth=450 * GB,
            inter_bandwidth=50 * GB,
            domain_chips=8,
            chips_per_node=8,
            peak_fp32_flops=495 * TFLOPS,
            gemm_efficiency=0.50,
            attention_efficiency=0.22,
            **GPU_KERNELS,
            interconnect="NVLink4/NVSwitch + RoCE/InfiniBand 400 Gb/s",
            source="torchtitan docs/performance.md (Grand Teton)",
        ),
        # NVIDIA H100 NVL datasheet: 94 GB HBM3, 3.9 TB/s, 835 TF bf16 dense (1,671 with sparsity);
        # NVLink bridge 600 GB/s bidir between the two cards of a pair, so the pair is the scale-up
        # "node" here (a server's other pairs are reached over PCIe/the network).
        Chip(
            name="h100-nvl",
            accelerator="gpu",
            hbm_bytes=94 * GB,
            hbm_bandwidth=3.9e12,
            peak_bf16_flops=835 * TFLOPS,
            peak_fp8_flops=1671 * TFLOPS,
            intra_bandwidth=300 * GB,
            inter_bandwidth=50 * GB,
            domain_chips=2,
            chips_per_node=2,
            peak_fp32_flops=418 * TFLOPS,
            gemm_efficiency=0.80,
            attention_efficiency=0.35,
            **GPU_KERNELS,
            interconnect="NVLink bridge (pairs) + InfiniBand",
            source="NVIDIA H100 NVL datasheet",
        ),
        # NVIDIA H200 / MLPerf v4.1: 141 GB, 4.8 TB/s, same compute and NVLink as H100.
        Chip(
            name="h200",
            accelerator="gpu",
            hbm_bytes=141 * GB,
            hbm_bandwidth=4.8e12,
            peak_bf16_flops=989 * TFLOPS,
            peak_fp8_flops=1979 * TFLOPS,
            intra_bandwidth=450 * GB,
            inter_bandwidth=50 * GB,
            domain_chips=8,
            chips_per_node=8,
            peak_fp32_flops=495 * TFLOPS,
            gemm_efficiency=0.80,
            attention_efficiency=0.35,
            **GPU_KERNELS,
            interconnect="NVLink4/NVSwitch + EFA/NDR InfiniBand",
            source="NVIDIA H200; MLPerf v4.1",
        ),
        # MLPerf v6.0 system file: 180 GB, 8 TB/s, 2.25 PF bf16, 4.5 PF fp8; NVLink5 1.8 TB/s bidir.
        Chip(
            name="b200",
            accelerator="gpu",
            hbm_bytes=180 * GB,
            hbm_bandwidth=8.0e12,
            peak_bf16_flops=2250 * TFLOPS,
            peak_fp8_flops=4500 * TFLOPS,
            intra_bandwidth=900 * GB,
            inter_bandwidth=50 * GB,
            domain_chips=8,
            chips_per_node=8,
            peak_fp32_flops=1125 * TFLOPS,
            gemm_efficiency=0.80,
            attention_efficiency=0.35,
            **GPU_KERNELS,
            interconnect="NVLink5/NVSwitch + XDR InfiniBand",
            source="MLPerf v6.0 system file",
        ),
        # cloud.google.com/tpu/docs/v4: 32 GiB HBM2, 1,200 GB/s, 275 TF bf16, 3-D torus, 4,096 chips per
        # pod, 4 chips per host. ICI 2,400 Gbps per chip (the v5p page's comparison; assumed) = 300 GB/s
        # bidir → 150 GB/s; DCN between pods as for v5p (~50 Gbps per chip).
        Chip(
            name="tpu-v4",
            accelerator="tpu",
            hbm_bytes=32 * GiB,
            hbm_bandwidth=1200 * GB,
            peak_bf16_flops=275 * TFLOPS,
            peak_fp8_flops=None,
            intra_bandwidth=150 * GB,
            inter_bandwidth=6.25 * GB,
            domain_chips=4096,
            chips_per_node=4,
            **TPU_KERNELS,
            interconnect="ICI 3-D torus + DCN",
            source="cloud.google.com/tpu/docs/v4",
        ),
        # cloud.google.com/tpu/docs/v5e: 16 GB, 819 GB/s, 197 TF; ICI 400 GB/s bidir, 2-D torus, 256/pod.
        # DCN across slices ~50 Gbps per chip (v5p docs; assumed the same for v5e).
        Chip(
            name="tpu-v5e",
            accelerator="tpu",
            hbm_bytes=16 * GB,
            hbm_bandwidth=819 * GB,
            peak_bf16_flops=197 * TFLOPS,
            peak_fp8_flops=None,
            intra_bandwidth=200 * GB,
            inter_bandwidth=6.25 * GB,
            domain_chips=256,
            chips_per_node=4,
            **TPU_KERNELS,
            interconnect="ICI 2-D torus + DCN",
            source="cloud.google.com/tpu/docs/v5e",
        ),
        # cloud.google.com/tpu/docs/v5p: 95 GB, 2765 GB/s, 459 TF; ICI 1200 GB/s bidir 3-D torus; DCN ~50 Gbps.
        Chip(
            name="tpu-v5p",
            accelerator="tpu",
            hbm_bytes=95 * GB,
            hbm_bandwidth=2765 * GB,
            peak_bf16_flops=459 * TFLOPS,
            peak_fp8_flops=None,
            intra_bandwidth=600 * GB,
            inter_bandwidth=6.25 * GB,
            domain_chips=6144,
            chips_per_node=4,
            **TPU_KERNELS,
            interconnect="ICI 3-D torus + DCN",
            source="cloud.google.com/tpu/docs/v5p",
        ),
        # cloud.google.com/tpu/docs/v6e: 32 GB, 1638 GB/s, 918 TF; ICI 800 GB/s bidir; 256/pod; 8 chips/host.
        Chip(
            name="tpu-v6e",
            accelerator="tpu",
            hbm_bytes=32 * GB,
            hbm_bandwidth=1638 * GB,
            peak_bf16_flops=918 * TFLOPS,
            peak_fp8_flops=None,
            intra_bandwidth=400 * GB,
            inter_bandwidth=6.25 * GB,
            domain_chips=256,
            chips_per_node=8,
            **TPU_KERNELS,
            interconnect="ICI 2-D torus + DCN",
            source="cloud.google.com/tpu/docs/v6e",
        ),
        # AWS Neuron docs (trainium arch): 32 GiB, 820 GiB/s, 190 TF bf16; trn1.32xlarge 16 chips,
        # EFA 800 Gbps / 16 = 6.25 GB/s per chip. NeuronLink-v2 per-chip bandwidth: assumed 192 GB/s.
        # Kernel figures: no published microbenchmark; the TPU family's (a systolic-array compiler
        # target too) are assumed.
        Chip(
            name="trainium1",
            accelerator="trainium",
            hbm_bytes=32 * GiB,
            hbm_bandwidth=820 * GiB,
            peak_bf16_flops=190 * TFLOPS,
            peak_fp8_flops=None,
            intra_bandwidth=192 * GB,
            inter_bandwidth=6.25 * GB,
            domain_chips=16,
            chips_per_node=16,
            **TPU_KERNELS,
            interconnect="NeuronLink-v2 + EFA",
            source="AWS Neuron docs: trainium arch",
        ),
        # AWS Neuron docs (trainium2 arch): 96 GiB, 2.9 TB/s, 667 TF bf16, 1299 fp8; NeuronLink-v3
        # 1,024 GB/s intra-instance (bidir) → 512 GB/s; trn2.48xlarge 16 chips, EFAv3 3,200 Gbps = 25 GB/s/chip.
        Chip(
            name="trainium2",
            accelerator="trainium",
            hbm_bytes=96 * GiB,
            hbm_bandwidth=2.9e12,
            peak_bf16_flops=667 * TFLOPS,
            peak_fp8_flops=1299 * TFLOPS,
            intra_bandwidth=512 * GB,
            inter_bandwidth=25 * GB,
            domain_chips=16,
            chips_per_node=16,
            **TPU_KERNELS,
            interconnect="NeuronLink-v3 4×4 torus + EFAv3",
            source="AWS Neuron docs: trainium2 arch",
        ),
    ]
}


def chips_for(accelerator: str) -> list[str]:
    return [name for name, chip in CHIPS.items() if chip.accelerator == accelerator]


def get_chip(name: str) -> Chip:
    try:
        return CHIPS[name]
    except KeyError:
        raise ValueError(f"unknown chip {name!r}; known chips: {', '.join(CHIPS)}") from None


# What ``torch.cuda.get_device_name()`` says for the catalog's GPUs, most specific first, with the
# smallest memory each needs where one name covers two chips: "NVIDIA H200" (seen on an H200),
# "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB",
# "NVIDIA B200". A PCIe H100 is none of the catalog's chips.
GPU_NAMES: tuple[tuple[str, float, str | None], ...] = (
    ("H200", 0, "h200"),
    ("H100 PCIE", 0, None),
    ("H100 NVL", 0, "h100-nvl"),
    ("H100", 90 * GiB, "h100-96gb"),
    ("H100", 0, "h100-sxm"),
    ("A100", 60 * GiB, "a100-80gb"),
    ("A100", 0, "a100-40gb"),
    ("V100", 0, "v100-32gb"),
    ("B200", 0, "b200"),
)


def chip_for_device(device_name: str, memory_bytes: float) -> str | None:
    """The catalog's name of a GPU from what CUDA calls it and its memory; None if it is not in the
    catalog."""
    upper = device_name.upper()
    for fragment, least_memory, chip in GPU_NAMES:
        if fragment in upper and memory_bytes >= least_memory:
            return chip
    return None
