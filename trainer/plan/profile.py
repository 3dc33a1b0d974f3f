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
    "elementwise_bandwidth",
    "kernel_overhead_s",
)

# The checkpoint disk's raw write speed, where calibration measured it (plan.checkpoint_fields).
CHECKPOINT_FIGURE = "checkpoint_write_bandwidth"

# Per-layout host costs only calibration measures (timing.fsdp_host_seconds, timing.tp_host_seconds).
HOST_TERMS = ("fsdp_round_trip_by_ranks", "tp_round_trip_by_ranks")


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
    # What a block's element-wise work reaches (kernels.elementwise_seconds): HBM's on accelerators;
    # measured on a real block by ``tessera calibrate``.
    elementwise_bandwidth: float
    kernel_overhead_s: float
    links: dict[Domain, Link]
    # Measured links by process-group size (calibrated profiles): the α–β the nearest size measured.
    links_by_ranks: dict[int, Link] = field(default_factory=dict)
    # Calibrated CPU hosts: the share of one process's compute each gets when n run at once.
    compute_share_by_ranks: dict[int, float] = field(default_factory=dict)
    # ... and the share of its memory bandwidth (caches and memory channels are shared even when cores
    # are not).
    memory_share_by_ranks: dict[int, float] = field(default_factory=dict)
    # Calibrated hosts: FSDP2's measured round trip of one unit, (latency s, s per fp32 parameter byte),
    # by process-group size (see timing.fsdp_host_seconds).
    fsdp_round_trip_by_ranks: dict[int, tuple[float, float]] = field(default_factory=dict)
    # Calibrated hosts: a tensor-parallel block's measured cost over its unsplit twin, (latency s, s per
    # fp32 activation byte), by process-group size (see timing.tp_host_seconds).
    tp_round_trip_by_ranks: dict[int, tuple[float, float]] = field(default_factory=dict)
    # Calibrated: the raw sequential write speed (bytes/s, with fsync) of the checkpoint directory's
    # disk, which the plan's checkpoint write time uses in place of checkpoint.write_bandwidth_gbps.
    checkpoint_write_bandwidth: float | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def host_bound(self) -> bool:
        """CPU processes dispatch every op serially; accelerators queue kernels asynchronously."""
        return self.chip.accelerator == "cpu"

    def on_node(self, processes: int) -> HardwareProfile:
        """This profile for ``processes`` per host: where calibration measured how much of the host
        each of n busy processes gets (CPU: cores, memory bandwidth, and whatever else runs there),
        scale the compute and dispatch rate by the compute share measured for the nearest n, the
        bandwidths by the memory share, and the FSDP and TP round trips by what the host's share falls
        short of the one they were measured under (:func:`_slowed`): FSDP's by the memory share (its
        own work is copies into and out of gathered buffers, allocation and first touch), TP's by the
        compute share (DTensor's dispatch around every op)."""
        if processes == 1 or not self.compute_share_by_ranks:
            return self
        shares = self.compute_share_by_ranks
        memory_shares = self.memory_share_by_ranks or shares
        share, memory = _share(shares, processes), _share(memory_shares, processes)
        return replace(
            self,
            peak_flops={name: flops * share for name, flops in self.peak_flops.items()},
            hbm_bandwidth=self.hbm_bandwidth * memory,
            elementwise_bandwidth=self.elementwise_bandwidth * memory,
            kernel_overhead_s=self.kernel_overhead_s / share,
            fsdp_round_trip_by_ranks=_slowed(self.fsdp_round_trip_by_ranks, memory_shares, memory),
            tp_round_trip_by_ranks=_slowed(self.tp_round_trip_by_ranks, shares, share),
        )

    def peak(self, precision: MatmulPrecision) -> float:
        return self.peak_flops[precision]

    def fsdp_round_trip(self, ranks: int) -> tuple[float, float]:
        """(latency s, s per fp32 parameter byte) of FSDP2's measured round trip for the nearest group
        size calibrated; (0, 0) where none was (accelerators: see timing.fsdp_host_seconds)."""
        return _nearest(self.fsdp_round_trip_by_ranks, ranks)

    def tp_round_trip(self, ranks: int) -> tuple[float, float]:
        """(latency s, s per fp32 activation byte) of a TP block's measured cost for the nearest group
        size calibrated; (0, 0) where none was (see timing.tp_host_seconds)."""
        return _nearest(self.tp_round_trip_by_ranks, ranks)

    def link(self, domain: Domain, ranks: int) -> Link:
        if self.links_by_ranks and domain == "intra":
            nearest = min(self.links_by_ranks, key=lambda n: (abs(n - ranks), -n))
            return self.links_by_ranks[nearest]
        return self.links[domain]


def _share(by_ranks: dict[int, float], processes: int) -> float:
    """The share measured for the nearest group size, less where more processes than that share it."""
    nearest = min(by_ranks, key=lambda n: (abs(n - processes), -n))
    return by_ranks[nearest] * min(1.0, nearest / processes)


def _slowed(
    by_ranks: dict[int, tuple[float, float]], shares: dict[int, float], share: float
) -> dict[int, tuple[float, float]]:
    """Round trips measured in a group of n busy processes (or in one process alone), for a host running
    processes at ``share`` each: slowed by the share measured for n (1 alone) over ``share`` (the
    n-process figure already includes the n processes' own contention, so only the difference applies)."""
    slowed = {}
    for n, (latency, per_byte) in by_ranks.items():
        factor = (1.0 if n == 1 else _share(shares, n)) / share
        slowed[n] = (latency * factor, per_byte * factor)
    return slowed


def _nearest(by_ranks: dict[int, tuple[float, float]], ranks: int) -> tuple[float, float]:
    """The figure of the nearest group size measured; a lone process (FSDP on a 1-rank mesh) only its
    own, since a group's figures include its ranks waiting for each other."""
    if ranks == 1:
        return by_ranks.get(1, (0.0, 0.0))
    groups = [n for n in by_ranks if n > 1]
    if not groups:
        return 0.0, 0.0
    return by_ranks[min(groups, key=lambda n: (abs(n - ranks), -n))]


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
        elementwise_bandwidth=chip.hbm_bandwidth,
        kernel_overhead_s=chip.kernel_overhead_s,
        links={
            "intra": Link(chip.intra_latency_s, chip.intra_bandwidth),
            "inter": Link(chip.inter_latency_s, chip.inter_bandwidth),
        },
        sources={
            **{name: f"catalog ({chip.source})" for name in figures},
            **{name: "catalog: none (an accelerator's host runs ahead of it)" for name in HOST_TERMS},
            CHECKPOINT_FIGURE: "catalog: none (the spec's checkpoint.write_bandwidth_gbps)",
        },
    )


def load_profile(chip: Chip, path: str | Path | None) -> HardwareProfile:
    """The catalog's figures for ``chip``, with those a calibration file measured put in their place.

    The file is what ``tessera calibrate`` writes: ``peak_flops`` per precision, the figures named in
    ``CALIBRATED_FIGURES``, and ``collectives`` as ``[{"ranks", "latency_s", "bandwidth", ...}]``, each
    with its reduce-scatter and all-reduce factors, compute share, and FSDP2 and TP round trips
    (``fsdp_latency_s``, ``fsdp_s_per_byte``, ``tp_latency_s``, ``tp_s_per_byte``) where measured, and
    ``fsdp_alone``, FSDP2's round trip on a one-process mesh.
    """
    profile = catalog_profile(chip)
    if path is None:
        return profile
    data = json.loads(Path(path).read_text())
    if data.get("chip", chip.name) != chip.name:
        unrecognised = data.get("unrecognised_device")
        fix = (
            f"calibration did not recognise the device {unrecognised!r}: rerun `tessera calibrate --chip "
            f"{chip.name}` if it is one"
            if unrecognised
            else "calibrate on the spec's chip"
        )
        raise ValueError(f"{path} calibrates {data['chip']!r}, but the spec's chip is {chip.name!r}; {fix}")
    origin = f"calibrated ({Path(path).name})"
    updates: dict[str, object] = {k: data[k] for k in (*CALIBRATED_FIGURES, CHECKPOINT_FIGURE) if k in data}
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
        for kind in ("compute", "memory"):
            updates[f"{kind}_share_by_ranks"] = {
                c["ranks"]: c[f"{kind}_share"] for c in data["collectives"] if f"{kind}_share" in c
            }
        # FSDP on a one-process mesh, where measured (see calibrate.fsdp_alone), and in each group.
        alone = data.get("fsdp_alone")
        fsdp = {1: (alone["latency_s"], alone["s_per_byte"])} if alone else {}
        for kind, by_ranks in (("fsdp", fsdp), ("tp", {})):
            updates[f"{kind}_round_trip_by_ranks"] = by_ranks | {
                c["ranks"]: (c[f"{kind}_latency_s"], c[f"{kind}_s_per_byte"])
                for c in data["collectives"]
                if f"{kind}_s_per_byte" in c
            }
        updates["links"] = {
            **profile.links,
            "intra": updates["links_by_ranks"][max(updates["links_by_ranks"])],
        }
    sources = {**profile.sources, **{name: origin for name in updates if name in profile.sources}}
    return replace(profile, **updates, sources=sources)
