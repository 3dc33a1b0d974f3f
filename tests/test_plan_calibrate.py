"""The planner's calibrated host terms: FSDP2's and TP's measured round trips, less what the plan prices
already, the element-wise bandwidth a real block reaches, the shares of a host its processes get, and
how calibration turns timings into the rates a step sustains."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trainer.backends.chips import chip_for_device, get_chip
from trainer.config import CheckpointConfig, HardwareConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.models.llama.model import TransformerBlock, rope_table
from trainer.plan import calibrate, make_plan
from trainer.plan.calibrate import PROBE_BLOCK, fit_round_trip, narrow_to_one_tp_rank
from trainer.plan.comms import collective_seconds, fsdp_placement, layer_comms, link_of, place
from trainer.plan.compute import block_seconds, elementwise_bytes, fsdp_copy_bytes, optimizer_seconds
from trainer.plan.kernels import memory_seconds
from trainer.plan.layout import Geometry
from trainer.plan.profile import HardwareProfile, catalog_profile, load_profile
from trainer.plan.timers import CudaEventTimer, HostTimer, device_timer
from trainer.plan.timing import fsdp_host_seconds, tp_host_seconds

LATENCY, PER_BYTE = 2e-3, 3e-9  # a round trip of λ = 2 ms + 3 ns per fp32 parameter byte
TP_LATENCY, TP_PER_BYTE = 20e-3, 2e-8  # a TP block: 20 ms + 20 ns per fp32 activation byte
TRAIN = TrainConfig(seq_len=128, global_batch_size=8, micro_batch_size=1)
HARDWARE = HardwareConfig(chips_per_node=2)


def cpu_profile(
    tmp_path: Path, fsdp: bool = True, tp: bool = True, alone: bool = False, **figures: float
) -> HardwareProfile:
    """The catalog CPU with one calibrated 2-rank group (as `tessera calibrate` writes it), and with
    ``alone`` FSDP's round trip on a one-process mesh at half the group's."""
    group = {"ranks": 2, "latency_s": 2e-4, "bandwidth": 1.5e9, "reduce_scatter_factor": 1.3}
    group |= {"compute_share": 1.0}
    if fsdp:
        group |= {"fsdp_latency_s": LATENCY, "fsdp_s_per_byte": PER_BYTE}
    if tp:
        group |= {"tp_latency_s": TP_LATENCY, "tp_s_per_byte": TP_PER_BYTE}
    if alone:
        figures |= {"fsdp_alone": {"latency_s": LATENCY / 2, "s_per_byte": PER_BYTE / 2}}  # type: ignore[dict-item]
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"chip": "cpu", "collectives": [group], **figures}))
    return load_profile(get_chip("cpu"), path)


def test_fit_round_trip_is_the_line_through_the_two_units() -> None:
    rows = [{"bytes": 1e6, "seconds": 5e-3}, {"bytes": 11e6, "seconds": 35e-3}]
    assert fit_round_trip(rows) == pytest.approx((2e-3, 3e-9))
    # a noisy small unit above the line's origin never gives a negative latency or rate
    assert fit_round_trip([{"bytes": 1e6, "seconds": 9e-3}, {"bytes": 2e6, "seconds": 8e-3}]) == (
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


def test_a_layout_wrapped_in_fsdp_on_one_rank_pays_its_own_round_trip_every_micro_batch(
    tmp_path: Path,
) -> None:
    """TP alone: the trainer wraps the model in FSDP on a one-process mesh anyway, whose round trip
    calibration measures alone (a group's includes its ranks waiting for each other), and it gathers on
    every micro-batch. DDP holds no FSDP."""
    model = ModelConfig(preset="small")
    alone, without = cpu_profile(tmp_path, alone=True), cpu_profile(tmp_path)
    assert alone.fsdp_round_trip(1) == (LATENCY / 2, PER_BYTE / 2) and without.fsdp_round_trip(1) == (0, 0)
    assert alone.fsdp_round_trip(2) == alone.fsdp_round_trip(4) == (LATENCY, PER_BYTE)

    def dp_shard_s(profile: HardwareProfile, parallel: ParallelConfig) -> float:
        plan = make_plan(model, parallel, TRAIN, HARDWARE, CheckpointConfig(), profile=profile)
        return plan.time_breakdown.exposed_comm_s["dp_shard"]

    tp = ParallelConfig(tp=2)
    geo = Geometry(model, tp, TRAIN, "cpu")
    placed = fsdp_placement({p.dim: p for p in place(geo, alone, HARDWARE)})
    one_round = geo.layers_per_stage * fsdp_host_seconds(geo, alone, placed, geo.layer_params_tp)
    one_round += fsdp_host_seconds(geo, alone, placed, geo.root_params_tp)
    assert one_round > 0
    # 8 micro-batches (global 8, micro 1, no data parallelism)
    assert dp_shard_s(alone, tp) - dp_shard_s(without, tp) == pytest.approx(8 * one_round)
    ddp = ParallelConfig(dp_replicate=2)
    assert dp_shard_s(alone, ddp) == dp_shard_s(without, ddp) == 0


def test_round_trips_scale_with_the_hosts_share_beyond_what_they_were_measured_under(tmp_path: Path) -> None:
    """A round trip measured in a group of n busy processes already includes their contention: a host
    running more processes (each with a smaller share) slows it by the share measured for n over its
    own, and one running n processes not at all (four processes on two cores are not slowed twice)."""
    hw = replace(cpu_profile(tmp_path), compute_share_by_ranks={2: 1.0, 4: 0.5})
    four_ranks = {2: (LATENCY, PER_BYTE), 4: (3 * LATENCY, 2 * PER_BYTE)}
    hw = replace(hw, fsdp_round_trip_by_ranks=four_ranks, tp_round_trip_by_ranks=four_ranks)
    assert hw.on_node(2).fsdp_round_trip(2) == pytest.approx((LATENCY, PER_BYTE))
    four = hw.on_node(4)
    assert four.fsdp_round_trip(4) == pytest.approx((3 * LATENCY, 2 * PER_BYTE))
    assert four.fsdp_round_trip(2) == pytest.approx((2 * LATENCY, 2 * PER_BYTE))  # HSDP's 2-rank shards
    assert four.tp_round_trip(2) == pytest.approx((2 * LATENCY, 2 * PER_BYTE))
    assert hw.on_node(8).fsdp_round_trip(4) == pytest.approx((6 * LATENCY, 4 * PER_BYTE))
    assert hw.fsdp_round_trip(1) == (0.0, 0.0)


def test_fsdp_round_trips_slow_with_the_memory_share_and_tp_round_trips_with_the_compute_share(
    tmp_path: Path,
) -> None:
    """FSDP2's own work is copies, allocation and first touch; TP's is DTensor's dispatch. Two processes
    with a core each get all of the compute but 70% of the memory bandwidth: FSDP on a one-process
    mesh, measured alone, runs 1/0.7 slower beside another process; TP, measured with both busy, not."""
    hw = replace(
        cpu_profile(tmp_path),
        compute_share_by_ranks={2: 1.0, 4: 0.5},
        memory_share_by_ranks={2: 0.7, 4: 0.35},
        fsdp_round_trip_by_ranks={1: (LATENCY, PER_BYTE), 2: (LATENCY, PER_BYTE)},
        tp_round_trip_by_ranks={2: (LATENCY, PER_BYTE)},
    )
    two = hw.on_node(2)
    assert two.fsdp_round_trip(1) == pytest.approx((LATENCY / 0.7, PER_BYTE / 0.7))
    assert two.fsdp_round_trip(2) == pytest.approx((LATENCY, PER_BYTE))
    assert two.tp_round_trip(2) == pytest.approx((LATENCY, PER_BYTE))
    four = hw.on_node(4)
    assert four.fsdp_round_trip(2) == pytest.approx((2 * LATENCY, 2 * PER_BYTE))  # 0.7 / 0.35
    assert four.tp_round_trip(2) == pytest.approx((2 * LATENCY, 2 * PER_BYTE))  # 1.0 / 0.5


def test_a_host_optimizer_step_streams_the_per_tensor_loops_passes(tmp_path: Path) -> None:
    """CPU: torch's per-tensor AdamW (80 B per parameter) plus clipping (12 B); accelerators keep the
    foreach count (40 B), so catalog chips' plans do not move."""
    hw = replace(cpu_profile(tmp_path, hbm_bandwidth=20e9), kernel_overhead_s=0.0)
    geo = Geometry(ModelConfig(preset="small"), ParallelConfig(), TRAIN, "cpu")
    assert optimizer_seconds(geo, hw) == pytest.approx(92 * geo.chip_params / 20e9)
    gpu = replace(catalog_profile(get_chip("h100-sxm")), kernel_overhead_s=0.0)
    gpu_geo = Geometry(ModelConfig(preset="small"), ParallelConfig(), TRAIN, "h100-sxm")
    assert optimizer_seconds(gpu_geo, gpu) == pytest.approx(40 * gpu_geo.chip_params / gpu.hbm_bandwidth)


class FakeClock:
    """``time.perf_counter`` for a function whose calls take the listed seconds in turn."""

    def __init__(self, costs: list[float]) -> None:
        self.now, self.costs = 0.0, iter(costs)

    def perf_counter(self) -> float:
        return self.now

    def call(self) -> None:
        self.now += next(self.costs)


def test_sustained_time_is_the_median_window_with_its_interruptions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each window's mean counts what interrupts it (a step's time does), the median over windows
    leaves out a window a neighbour's burst fell in (as the step median does), and the best window is
    not what a step sustains."""
    # windows of 4 calls: one interrupted call each (1 + 1 + 1 + 5), except a burst window and a quiet one
    windows = [[1, 1, 1, 5], [1, 1, 5, 1], [9, 9, 9, 9], [1, 5, 1, 1], [1, 1, 1, 1]]
    clock = FakeClock([c for window in windows for c in window])
    monkeypatch.setattr(calibrate.time, "perf_counter", clock.perf_counter)
    assert calibrate._window_median(clock.call, calls=4, windows=5) == pytest.approx(2.0)


def test_calls_lasting_a_window_count_the_warm_up_call(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock([100.0] + [1.0] * 10)  # a slow first call (warm-up), then 1 s calls
    monkeypatch.setattr(calibrate.time, "perf_counter", clock.perf_counter)
    assert calibrate._calls_lasting(clock.call, window_s=3.0) == 4


def test_a_processs_share_is_its_sustained_rate_never_above_its_cores() -> None:
    assert calibrate.share(1.0, 1.25, world=2, cores=2) == pytest.approx(0.8)
    assert calibrate.share(1.0, 0.9, world=2, cores=2) == 1.0  # faster together: noise, not a gain
    assert calibrate.share(1.0, 1.6, world=4, cores=2) == 0.5  # four processes on two cores
    assert calibrate.share(1.0, 3.0, world=4, cores=2) == pytest.approx(1 / 3)


def test_the_fsdp_round_trip_stack_runs_its_blocks_in_a_row() -> None:
    """Calibration shards a stack of blocks (so each unit's gather is prefetched behind its
    predecessor's compute, as in training): the stack is the blocks applied in turn."""
    cfg = ModelConfig(preset="tiny")
    stack = calibrate.BlockStack(cfg, calibrate.FSDP_STACK)
    assert len(stack.layers) == calibrate.FSDP_STACK > 1
    rope = rope_table(cfg.head_dim, 16, cfg.rope_theta)
    x = torch.randn(2, 16, cfg.dim)
    expected = x
    for block in stack.layers:
        expected = block(expected, rope)
    torch.testing.assert_close(stack(x, rope), expected)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_tp_host_work_is_the_measured_block_cost_less_its_collectives(
    tmp_path: Path, checkpointing: str
) -> None:
    """Per block and micro-batch: λ + T·d·4·r, a recomputing layout's extra forward at the forward's
    share (4 of 8 collectives more), less the TP collectives the plan prices (α–β)."""
    hw = cpu_profile(tmp_path)
    parallel = ParallelConfig(tp=2, activation_checkpointing=checkpointing)
    geo = Geometry(ModelConfig(preset="small"), parallel, TRAIN, "cpu")
    by_dim = {p.dim: p for p in place(geo, hw, HARDWARE)}
    comms = layer_comms(geo, by_dim)
    measured = (TP_LATENCY + TP_PER_BYTE * geo.microbatch_tokens * geo.model.dim * 4) * (
        1.5 if checkpointing == "full" else 1.0
    )
    expected = measured - comms.tp_forward - comms.tp_backward
    assert 0 < expected < measured
    assert tp_host_seconds(geo, hw, by_dim["tp"], comms) == pytest.approx(expected)
    # nothing where TP was not measured, or where there is no TP
    assert tp_host_seconds(geo, cpu_profile(tmp_path, tp=False), by_dim["tp"], comms) == 0
    untp = Geometry(geo.model, ParallelConfig(dp_shard=2), TRAIN, "cpu")
    untp_dims = {p.dim: p for p in place(untp, hw, HARDWARE)}
    assert tp_host_seconds(untp, hw, untp_dims["tp"], layer_comms(untp, untp_dims)) == 0


def test_tp_host_work_is_on_every_micro_batchs_critical_path(tmp_path: Path) -> None:
    model = ModelConfig(preset="small")

    def tp_s(profile: HardwareProfile) -> float:
        plan = make_plan(model, ParallelConfig(tp=2), TRAIN, HARDWARE, CheckpointConfig(), profile=profile)
        return plan.time_breakdown.exposed_comm_s["tp"]

    hw = cpu_profile(tmp_path)
    geo = Geometry(model, ParallelConfig(tp=2), TRAIN, "cpu")
    by_dim = {p.dim: p for p in place(geo, hw, HARDWARE)}
    per_block = tp_host_seconds(geo, hw, by_dim["tp"], layer_comms(geo, by_dim))
    # 8 micro-batches (global 8, micro 1, no data parallelism) × 8 blocks
    assert tp_s(hw) - tp_s(cpu_profile(tmp_path, tp=False)) == pytest.approx(8 * 8 * per_block)


def test_block_elementwise_work_runs_at_the_measured_bandwidth_and_nothing_else_does(tmp_path: Path) -> None:
    """Calibration's element-wise bandwidth prices the blocks' element-wise bytes; copies, the loss and
    the optimizer stream at the memory bandwidth. The catalog takes HBM's for both."""
    assert catalog_profile(get_chip("h100-sxm")).elementwise_bandwidth == get_chip("h100-sxm").hbm_bandwidth
    fast = cpu_profile(tmp_path, hbm_bandwidth=20e9, elementwise_bandwidth=20e9)
    slow = cpu_profile(tmp_path, hbm_bandwidth=20e9, elementwise_bandwidth=5e9)
    assert slow.sources["elementwise_bandwidth"].startswith("calibrated")
    geo = Geometry(ModelConfig(preset="small"), ParallelConfig(), TRAIN, "cpu")
    fast_block, slow_block = block_seconds(geo, fast), block_seconds(geo, slow)
    extra = elementwise_bytes(geo) * (1 / 5e9 - 1 / 20e9)
    assert slow_block.forward - fast_block.forward == pytest.approx(extra)
    assert slow_block.backward - fast_block.backward == pytest.approx(2 * extra)
    assert optimizer_seconds(geo, slow) == optimizer_seconds(geo, fast)


def test_the_tp_twin_has_one_ranks_projections() -> None:
    """Calibration's unsplit twin of a TP block: 1/world of the heads (same head size) and hidden width,
    so its matmuls are one TP rank's."""
    cfg = ModelConfig(**PROBE_BLOCK)
    block = TransformerBlock(cfg)
    narrow_to_one_tp_rank(block, 4)
    shapes = {name: tuple(p.shape) for name, p in block.named_parameters() if p.ndim == 2}
    d, head, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
    assert shapes == {
        "attention.wq.weight": (cfg.n_heads * head // 4, d),
        "attention.wk.weight": (cfg.n_kv_heads * head // 4, d),
        "attention.wv.weight": (cfg.n_kv_heads * head // 4, d),
        "attention.wo.weight": (d, cfg.n_heads * head // 4),
        "feed_forward.w1.weight": (f // 4, d),
        "feed_forward.w3.weight": (f // 4, d),
        "feed_forward.w2.weight": (d, f // 4),
    }
    rope = rope_table(cfg.head_dim, 16, cfg.rope_theta)
    assert block(torch.randn(2, 16, d), rope).shape == (2, 16, d)


def test_bandwidths_scale_with_the_memory_share_and_compute_with_the_compute_share(tmp_path: Path) -> None:
    """Two processes with a core each still share the memory channels: calibration measures both shares
    and a plan for n processes per host scales each figure by its own."""
    hw = replace(
        cpu_profile(tmp_path, hbm_bandwidth=20e9, elementwise_bandwidth=6e9),
        compute_share_by_ranks={2: 1.0},
        memory_share_by_ranks={2: 0.7},
    )
    two = hw.on_node(2)
    assert two.peak("fp32") == hw.peak("fp32")
    assert (two.hbm_bandwidth, two.elementwise_bandwidth) == pytest.approx((14e9, 4.2e9))
    four = hw.on_node(4)  # more processes than measured: each gets half of that again
    assert four.peak("fp32") == pytest.approx(hw.peak("fp32") / 2)
    assert four.elementwise_bandwidth == pytest.approx(6e9 * 0.35)


@pytest.mark.parametrize(
    ("name", "memory_gib", "chip"),
    [
        ("NVIDIA H200", 139.8, "h200"),  # what the H200 lent here said
        ("NVIDIA H100 80GB HBM3", 79.6, "h100-sxm"),
        ("NVIDIA H100", 94.5, "h100-96gb"),
        ("NVIDIA H100 NVL", 93.6, "h100-nvl"),
        ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
        ("Tesla V100-SXM2-32GB", 31.7, "v100-32gb"),
        ("NVIDIA B200", 178.4, "b200"),
        ("NVIDIA H100 PCIe", 79.6, None),
        ("NVIDIA GeForce RTX 4090", 23.6, None),
    ],
)
def test_a_gpu_is_named_as_the_catalog_names_it(name: str, memory_gib: float, chip: str | None) -> None:
    assert chip_for_device(name, memory_gib * 2**30) == chip


def test_a_profile_of_an_unrecognised_device_says_so_and_how_to_name_it(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"chip": "nvidia foo", "unrecognised_device": "NVIDIA Foo"}))
    with pytest.raises(ValueError, match=r"did not recognise the device 'NVIDIA Foo'.*--chip h200"):
        load_profile(get_chip("h200"), path)


def test_the_plan_prices_checkpoint_writes_at_the_measured_disk_where_a_profile_has_it(
    tmp_path: Path,
) -> None:
    model, parallel, train = ModelConfig(preset="small"), ParallelConfig(), TRAIN
    hardware, checkpoint = HardwareConfig(chips_per_node=1), CheckpointConfig(write_bandwidth_gbps=2.0)
    catalog = make_plan(model, parallel, train, hardware, checkpoint)
    assert catalog.checkpoint_write_s == pytest.approx(catalog.checkpoint_bytes / 2e9)
    profile = cpu_profile(tmp_path, checkpoint_write_bandwidth=5e8)
    assert profile.sources["checkpoint_write_bandwidth"].startswith("calibrated")
    measured = make_plan(model, parallel, train, hardware, checkpoint, profile=profile)
    assert measured.checkpoint_write_s == pytest.approx(measured.checkpoint_bytes / 5e8)


def test_calibration_times_the_host_on_its_clock_and_a_gpu_on_cuda_events() -> None:
    assert isinstance(device_timer(torch.device("cpu")), HostTimer)
    assert isinstance(device_timer(torch.device("cuda", 0)), CudaEventTimer)  # built lazily: no GPU needed
    ticks = []
    assert HostTimer(torch.device("cpu")).seconds(lambda: ticks.append(1), 3) >= 0 and len(ticks) == 3


def test_a_link_is_alpha_from_the_smallest_all_gather_and_beta_from_the_largest() -> None:
    # 4 ranks: α = 10 µs per ring step; 3/4 of 1 GB moved at 100 GB/s after 3 α
    timings = [{"bytes": 1024, "seconds": 30e-6}, {"bytes": 1e9, "seconds": 30e-6 + 0.75e9 / 100e9}]
    latency, bandwidth = calibrate.fit_link(timings, 4)
    assert (latency, bandwidth) == pytest.approx((10e-6, 100e9))
