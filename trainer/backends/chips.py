"""Chip catalog: the hardware figures the planner and the spec validation use.

Bandwidths here are **one-direction per chip** (B in the nccl-tests formulas): NVLink and TPU ICI
are published bidirectional, so they are halved. Sources are the vendors' public pages, gathered in
``shared/CHIPS.md``; figures marked *assumed* have no single public number and are our estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GiB = 2**30
TFLOPS = 1e12

# Llama 3 405B (Dubey et al. 2024, §3.3.4): 419 unexpected interruptions in 54 days on 16,384 H100s
# → 419 / (54 × 24 × 16384) ≈ 1.97e-5 failures per chip-hour (≈ 50,700 h MTBF per chip). We use it for
# every accelerator for lack of published figures for the others.
LLAMA3_FAILURES_PER_CHIP_HOUR = 419 / (54 * 24 * 16384)


@dataclass(frozen=True)
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
    failures_per_chip_hour: float = LLAMA3_FAILURES_PER_CHIP_HOUR
    interconnect: str = ""
    source: str = ""


CHIPS: dict[str, Chip] = {
    c.name: c
    for c in [
        # Host CPU stands in for a chip in local runs; figures are a modest 2-core dev box (assumed).
        Chip(
            "cpu",
            "cpu",
            hbm_bytes=16 * GiB,
            hbm_bandwidth=20 * GB,
            peak_bf16_flops=0.2 * TFLOPS,
            peak_fp8_flops=None,
            intra_bandwidth=5 * GB,
            inter_bandwidth=1 * GB,
            domain_chips=64,
            chips_per_node=64,
            intra_latency_s=20e-6,
            inter_latency_s=100e-6,
            interconnect="shared memory / loopback (gloo)",
            source="assumed",
        ),
        # NVIDIA A100 datasheet: 80 GB, 2.0 TB/s, 312 TF bf16, NVLink 600 GB/s bidir; HDR IB 200 Gb/s per GPU.
        Chip(
            "a100-80gb",
            "gpu",
            80 * GB,
            2.0e12,
            312 * TFLOPS,
            None,
            300 * GB,
            25 * GB,
            8,
            8,
            interconnect="NVLink3/NVSwitch + HDR InfiniBand",
            source="NVIDIA A100 datasheet",
        ),
        # NVIDIA H100 page: 80 GB, 3.35 TB/s, 989 TF bf16 dense, 1979 fp8; NVLink 900 GB/s bidir.
        # p5.48xlarge: 3,200 Gbps EFA for 8 GPUs = 50 GB/s per GPU.
        Chip(
            "h100-sxm",
            "gpu",
            80 * GB,
            3.35e12,
            989 * TFLOPS,
            1979 * TFLOPS,
            450 * GB,
            50 * GB,
            8,
            8,
            interconnect="NVLink4/NVSwitch + EFA/NDR InfiniBand",
            source="NVIDIA H100 page; AWS p5",
        ),
        # NVIDIA H200 / MLPerf v4.1: 141 GB, 4.8 TB/s, same compute and NVLink as H100.
        Chip(
            "h200",
            "gpu",
            141 * GB,
            4.8e12,
            989 * TFLOPS,
            1979 * TFLOPS,
            450 * GB,
            50 * GB,
            8,
            8,
            interconnect="NVLink4/NVSwitch + EFA/NDR InfiniBand",
            source="NVIDIA H200; MLPerf v4.1",
        ),
        # MLPerf v6.0 system file: 180 GB, 8 TB/s, 2.25 PF bf16, 4.5 PF fp8; NVLink5 1.8 TB/s bidir.
        Chip(
            "b200",
            "gpu",
            180 * GB,
            8.0e12,
            2250 * TFLOPS,
            4500 * TFLOPS,
            900 * GB,
            50 * GB,
            8,
            8,
            interconnect="NVLink5/NVSwitch + XDR InfiniBand",
            source="MLPerf v6.0 system file",
        ),
        # cloud.google.com/tpu/docs/v5e: 16 GB, 819 GB/s, 197 TF; ICI 400 GB/s bidir, 2-D torus, 256/pod.
        # DCN across slices ~50 Gbps per chip (v5p docs; assumed the same for v5e).
        Chip(
            "tpu-v5e",
            "tpu",
            16 * GB,
            819 * GB,
            197 * TFLOPS,
            None,
            200 * GB,
            6.25 * GB,
            256,
            4,
            interconnect="ICI 2-D torus + DCN",
            source="cloud.google.com/tpu/docs/v5e",
        ),
        # cloud.google.com/tpu/docs/v5p: 95 GB, 2765 GB/s, 459 TF; ICI 1200 GB/s bidir 3-D torus; DCN ~50 Gbps.
        Chip(
            "tpu-v5p",
            "tpu",
            95 * GB,
            2765 * GB,
            459 * TFLOPS,
            None,
            600 * GB,
            6.25 * GB,
            6144,
            4,
            interconnect="ICI 3-D torus + DCN",
            source="cloud.google.com/tpu/docs/v5p",
        ),
        # cloud.google.com/tpu/docs/v6e: 32 GB, 1638 GB/s, 918 TF; ICI 800 GB/s bidir; 256/pod; 8 chips/host.
        Chip(
            "tpu-v6e",
            "tpu",
            32 * GB,
            1638 * GB,
            918 * TFLOPS,
            None,
            400 * GB,
            6.25 * GB,
            256,
            8,
            interconnect="ICI 2-D torus + DCN",
            source="cloud.google.com/tpu/docs/v6e",
        ),
        # AWS Neuron docs (trainium arch): 32 GiB, 820 GiB/s, 190 TF bf16; trn1.32xlarge 16 chips,
        # EFA 800 Gbps / 16 = 6.25 GB/s per chip. NeuronLink-v2 per-chip bandwidth: assumed 192 GB/s.
        Chip(
            "trainium1",
            "trainium",
            32 * GiB,
            820 * GiB,
            190 * TFLOPS,
            None,
            192 * GB,
            6.25 * GB,
            16,
            16,
            interconnect="NeuronLink-v2 + EFA",
            source="AWS Neuron docs: trainium arch",
        ),
        # AWS Neuron docs (trainium2 arch): 96 GiB, 2.9 TB/s, 667 TF bf16, 1299 fp8; NeuronLink-v3
        # 1,024 GB/s intra-instance (bidir) → 512 GB/s; trn2.48xlarge 16 chips, EFAv3 3,200 Gbps = 25 GB/s/chip.
        Chip(
            "trainium2",
            "trainium",
            96 * GiB,
            2.9e12,
            667 * TFLOPS,
            1299 * TFLOPS,
            512 * GB,
            25 * GB,
            16,
            16,
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
