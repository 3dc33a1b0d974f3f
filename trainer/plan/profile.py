"""The hardware figures the time model uses: the chip catalog's defaults, or a calibrated profile.

``tessera calibrate`` (``trainer/plan/calibrate.py``) measures this machine and writes a JSON profile;
``tessera plan SPEC --profile FILE`` plans with it. Each figure remembers where it came from, so the
plan can say which numbers were measured and which are catalog defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from trainer.backends.chips import Chip

Domain = Literal["intra", "inter"]
# What a matmul computes in: the FSDP compute dtypes, and fp8 where parallel.float8 converts a layer.
MatmulPrecision = Literal["fp32", "bf16", "fp8"]
# fp32 matmuls run at half the bf16 rate where the catalog gives no fp32 peak (assumed).
FP32_SLOWDOWN = 2.0
CALIBRATED_FIGURES = (
    "gemm_efficiency",
    "gemm_knee",
    "attention_efficiency",
    "hbm_bandwidth",
    "kernel_overhead_s",
)


@dataclass(frozen=True)
class Link:
    """α–β cost of one interconnect domain: α per ring step, B bytes/s one direction per chip, and
    how much slower than a ring a library's reduce-scatter and all-reduce run (NCCL: 1; gloo builds
    its reduce-scatter from an all-reduce, so ~2: `tessera calibrate` measures it)."""

    latency_s: float
    bandwidth: float
    reduce_scatter_factor: float = 1.0
    all_reduce_factor: float = 1.0


@dataclass(frozen=True)
class HardwareProfile:
    """One chip's figures for the time model; ``sources`` names each figure's origin."""

    chip: Chip
    peak_flops: dict[str, float]  # dense matmul FLOP/s per compute precision
    gemm_efficiency: float
    gemm_knee: float
    attention_efficiency: float
    hbm_bandwidth: float
    kernel_overhead_s: float
    links: dict[Domain, Link]
    # Measured links by process-group size (calibrated profiles): the α–β the nearest size measured.
    links_by_ranks: dict[int, Link] = field(default_factory=dict)
    # Calibrated CPU hosts: the share of one process's compute each gets when n run at once.
    compute_share_by_ranks: dict[int, float] = field(default_factory=dict)
    # Calibrated hosts: FSDP2's measured round trip of one unit, (latency s, s per fp32 parameter byte),
    # by process-group size (see timing.fsdp_host_seconds).
    fsdp_round_trip_by_ranks: dict[int, tuple[float, float]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def host_bound(self) -> bool:
        """CPU processes dispatch every op serially; accelerators queue kernels asynchronously."""
        return self.chip.accelerator == "cpu"

    def on_node(self, processes: int) -> HardwareProfile:
        """This profile for ``processes`` per host: where calibration measured how much of the host
        each of n busy processes gets (CPU: cores, and whatever else runs there), scale the compute,
        bandwidth, dispatch rate and FSDP round trip by the share measured for the nearest n."""
        if processes == 1 or not self.compute_share_by_ranks:
            return self
        nearest = min(self.compute_share_by_ranks, key=lambda n: (abs(n - processes), -n))
        share = self.compute_share_by_ranks[nearest] * min(1.0, nearest / processes)
        return replace(
            self,
            peak_flops={name: flops * share for name, flops in self.peak_flops.items()},
            hbm_bandwidth=self.hbm_bandwidth * share,
            kernel_overhead_s=self.kernel_overhead_s / share,
            fsdp_round_trip_by_ranks={
                n: (latency / share, per_byte / share)
                for n, (latency, per_byte) in self.fsdp_round_trip_by_ranks.items()
            },
        )

    def peak(self, precision: MatmulPrecision) -> float:
        return self.peak_flops[precision]

    def fsdp_round_trip(self, ranks: int) -> tuple[float, float]:
        """(latency s, s per fp32 parameter byte) of FSDP2's measured round trip for the nearest group
        size calibrated; (0, 0) where none was (accelerators: see timing.fsdp_host_seconds)."""
        if ranks == 1 or not self.fsdp_round_trip_by_ranks:
            return 0.0, 0.0
        return self.fsdp_round_trip_by_ranks[
            min(self.fsdp_round_trip_by_ranks, key=lambda n: (abs(n - ranks), -n))
        ]

    def link(self, domain: Domain, ranks: int) -> Link:
        if self.links_by_ranks and domain == "intra":
            nearest = min(self.links_by_ranks, key=lambda n: (abs(n - ranks), -n))
            return self.links_by_ranks[nearest]
        return self.links[domain]


def catalog_profile(chip: Chip) -> HardwareProfile:
    fp32 = chip.peak_fp32_flops or chip.peak_bf16_flops / FP32_SLOWDOWN
    figures = ("peak_flops", "links", *CALIBRATED_FIGURES)
    return HardwareProfile(
        chip=chip,
        peak_flops={
            "bf16": chip.peak_bf16_flops,
            "fp32": fp32,
            **({"fp8": chip.peak_fp8_flops} if chip.peak_fp8_flops else {}),
        },
        gemm_efficiency=chip.gemm_efficiency,
        gemm_knee=chip.gemm_knee,
        attention_efficiency=chip.attention_efficiency,
        hbm_bandwidth=chip.hbm_bandwidth,
        kernel_overhead_s=chip.kernel_overhead_s,
        links={
            "intra": Link(chip.intra_latency_s, chip.intra_bandwidth),
            "inter": Link(chip.inter_latency_s, chip.inter_bandwidth),
        },
        sources={name: f"catalog ({chip.source})" for name in figures},
    )


def load_profile(chip: Chip, path: str | Path | None) -> HardwareProfile:
    """The catalog's figures for ``chip``, with those a calibration file measured put in their place.

    The file is what ``tessera calibrate`` writes: ``peak_flops`` per precision, the figures named in
    ``CALIBRATED_FIGURES``, and ``collectives`` as ``[{"ranks", "latency_s", "bandwidth", ...}]``, each
    with its reduce-scatter and all-reduce factors, compute share and FSDP2 round trip
    (``fsdp_latency_s``, ``fsdp_s_per_byte``) where measured.
    """
    profile = catalog_profile(chip)
    if path is None:
        return profile
    data = json.loads(Path(path).read_text())
    if data.get("chip", chip.name) != chip.name:
        raise ValueError(f"{path} calibrates {data['chip']!r}, but the spec's chip is {chip.name!r}")
    origin = f"calibrated ({Path(path).name})"
    updates: dict[str, object] = {k: data[k] for k in CALIBRATED_FIGURES if k in data}
    if "peak_flops" in data:
        updates["peak_flops"] = {**profile.peak_flops, **data["peak_flops"]}
    if data.get("collectives"):
        updates["links_by_ranks"] = {
            c["ranks"]: Link(
                c["latency_s"],
                c["bandwidth"],
                c.get("reduce_scatter_factor", 1.0),
                c.get("all_reduce_factor", 1.0),
            )
            for c in data["collectives"]
        }
        updates["compute_share_by_ranks"] = {
            c["ranks"]: c["compute_share"] for c in data["collectives"] if "compute_share" in c
        }
        updates["fsdp_round_trip_by_ranks"] = {
            c["ranks"]: (c["fsdp_latency_s"], c["fsdp_s_per_byte"])
            for c in data["collectives"]
            if "fsdp_s_per_byte" in c
        }
        updates["links"] = {
            **profile.links,
            "intra": updates["links_by_ranks"][max(updates["links_by_ranks"])],
        }
    sources = {**profile.sources, **{name: origin for name in updates if name in profile.sources}}
    return replace(profile, **updates, sources=sources)
