"""The planner's calibrated host terms: FSDP2's measured round trip, less what the plan prices already."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from trainer.backends.chips import get_chip
from trainer.config import CheckpointConfig, HardwareConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.plan import make_plan
from trainer.plan.calibrate import fit_round_trip
from trainer.plan.comms import collective_seconds, link_of, place
from trainer.plan.compute import fsdp_copy_bytes
from trainer.plan.kernels import memory_seconds
from trainer.plan.layout import Geometry
from trainer.plan.profile import HardwareProfile, catalog_profile, load_profile
from trainer.plan.timing import fsdp_host_seconds

LATENCY, PER_BYTE = 2e-3, 3e-9  # a round trip of λ = 2 ms + 3 ns per fp32 parameter byte
TRAIN = TrainConfig(seq_len=128, global_batch_size=8, micro_batch_size=1)
HARDWARE = HardwareConfig(chips_per_node=2)


def cpu_profile(tmp_path: Path, fsdp: bool = True) -> HardwareProfile:
    """The catalog CPU with one calibrated 2-rank group (as `tessera calibrate` writes it)."""
    group = {"ranks": 2, "latency_s": 2e-4, "bandwidth": 1.5e9, "reduce_scatter_factor": 1.3}
    group |= {"compute_share": 1.0}
    if fsdp:
        group |= {"fsdp_latency_s": LATENCY, "fsdp_s_per_byte": PER_BYTE}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"chip": "cpu", "collectives": [group]}))
    return load_profile(get_chip("cpu"), path)


def test_fit_round_trip_is_the_line_through_the_two_units() -> None:
    rows = [{"param_bytes": 1e6, "seconds": 5e-3}, {"param_bytes": 11e6, "seconds": 35e-3}]
    assert fit_round_trip(rows) == pytest.approx((2e-3, 3e-9))
    # a noisy small unit above the line's origin never gives a negative latency or rate
    assert fit_round_trip([{"param_bytes": 1e6, "seconds": 9e-3}, {"param_bytes": 2e6, "seconds": 8e-3}]) == (
        9e-3,
        0.0,
    )


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_host_work_is_the_measured_round_trip_less_its_collectives_and_copies(
    tmp_path: Path, reshard: bool
) -> None:
    """Per unit and sync: λ + 4P·r − (2 all-gathers + reduce-scatter, α–β) − copies at memory
    bandwidth, scaled by the layout's gathers·e + 4 bytes against the measured 2·4 + 4."""
    hw = cpu_profile(tmp_path)
    parallel = ParallelConfig(dp_shard=2, reshard_after_forward=reshard)
    geo = Geometry(ModelConfig(preset="small"), parallel, TRAIN, "cpu")
    shard = {p.dim: p for p in place(geo, hw, HARDWARE)}["dp_shard"]
    unit = geo.layer_params_tp
    size, link = 4 * unit, link_of(shard)
    priced = 2 * collective_seconds("all_gather", size, 2, link) + collective_seconds(
        "reduce_scatter", size, 2, link
    )
    priced += memory_seconds(fsdp_copy_bytes(geo), hw)
    share = (2 if reshard else 1) * 4 + 4
    expected = (LATENCY + PER_BYTE * size - priced) * share / 12
    assert expected > 0
    assert fsdp_host_seconds(geo, hw, shard, unit) == pytest.approx(expected)


def test_fsdp_host_work_adds_per_unit_and_sync_and_only_where_measured(tmp_path: Path) -> None:
    model = ModelConfig(preset="small")

    def dp_shard_s(profile: HardwareProfile, parallel: ParallelConfig, train: TrainConfig = TRAIN) -> float:
        plan = make_plan(model, parallel, train, HARDWARE, CheckpointConfig(), profile=profile)
        return plan.time_breakdown.exposed_comm_s["dp_shard"]

    measured, unmeasured = cpu_profile(tmp_path), cpu_profile(tmp_path, fsdp=False)
    fsdp = ParallelConfig(dp_shard=2)
    geo = Geometry(model, fsdp, TRAIN, "cpu")
    shard = {p.dim: p for p in place(geo, measured, HARDWARE)}["dp_shard"]
    per_sync = geo.layers_per_stage * fsdp_host_seconds(geo, measured, shard, geo.layer_params_tp)
    per_sync += fsdp_host_seconds(geo, measured, shard, geo.root_params_tp)
    # 4 micro-batches per rank: one gradient sync each
    assert dp_shard_s(measured, fsdp) - dp_shard_s(unmeasured, fsdp) == pytest.approx(4 * per_sync)
    assert fsdp_host_seconds(geo, catalog_profile(get_chip("cpu")), shard, geo.layer_params_tp) == 0
    # DDP has no FSDP units; pure TP none either
    for other in (ParallelConfig(dp_replicate=2), ParallelConfig(tp=2)):
        assert dp_shard_s(measured, other) == dp_shard_s(unmeasured, other)


def test_fsdp_round_trip_scales_with_the_hosts_share(tmp_path: Path) -> None:
    """Four processes on a host that gives each half of it take twice as long for the same work."""
    hw = cpu_profile(tmp_path)
    halved = replace(hw, compute_share_by_ranks={2: 0.5})
    assert halved.on_node(2).fsdp_round_trip(2) == pytest.approx((2 * LATENCY, 2 * PER_BYTE))
    assert hw.fsdp_round_trip(1) == (0.0, 0.0)
