"""Layout search: every valid (dp_replicate, dp_shard, tp, pp, micro-batch, AC) for the chip count,
and refusals that say what would fit when nothing does."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from trainer.backends.chips import get_chip
from trainer.config import (
    ActivationCheckpointing,
    CheckpointConfig,
    HardwareConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from trainer.divisors import divisors
from trainer.layout_checks import layout_errors
from trainer.plan.comms import fast_domain_chips
from trainer.plan.hbm import STATE_BYTES, estimate_memory
from trainer.plan.layout import Geometry
from trainer.plan.plan import USABLE_HBM_FRACTION, Plan, make_plan
from trainer.plan.profile import HardwareProfile

AC_CHOICES: tuple[ActivationCheckpointing, ...] = ("none", "selective", "full")
MAX_MICRO_BATCH = 16  # larger micro-batches only add activation memory once matmuls are saturated
MAX_NODES = 2**20  # how far a refusal looks for a cluster that fits


def degree_splits(chips: int, tp_limit: int) -> Iterator[dict[str, int]]:
    """Every dp_replicate × dp_shard × tp × pp = chips (the chips per cp group), with TP inside the fast
    domain (it talks every layer)."""
    for tp in divisors(chips, tp_limit):
        for pp in divisors(chips // tp):
            for dp_shard in divisors(chips // (tp * pp)):
                yield dict(dp_replicate=chips // (tp * pp * dp_shard), dp_shard=dp_shard, tp=tp, pp=pp)


def candidate_layouts(
    model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hardware: HardwareConfig
) -> Iterator[tuple[ParallelConfig, TrainConfig]]:
    """Valid layouts (``layout_errors`` is empty); knobs not searched keep the spec's values.

    The spec's cp is kept (it is chosen for the sequence length); the other degrees split the rest.
    """
    tp_limit = fast_domain_chips(get_chip(hardware.chip), hardware)
    for degrees in degree_splits(max(1, hardware.world_size // parallel.cp), tp_limit):
        dp = degrees["dp_replicate"] * degrees["dp_shard"]
        if train.global_batch_size % dp:
            continue
        micro_batches = divisors(train.global_batch_size // dp, MAX_MICRO_BATCH)
        for micro, ac in itertools.product(micro_batches, AC_CHOICES):
            cand_parallel = parallel.model_copy(update={**degrees, "activation_checkpointing": ac})
            cand_train = train.model_copy(update={"micro_batch_size": micro})
            if not layout_errors(model, cand_parallel, cand_train, hardware):
                yield cand_parallel, cand_train


def fitting_layouts(
    model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hardware: HardwareConfig
) -> Iterator[tuple[ParallelConfig, TrainConfig]]:
    """Candidates whose memory fits in usable HBM (a cheap check, before any time estimate)."""
    usable = USABLE_HBM_FRACTION * get_chip(hardware.chip).hbm_bytes
    for cand_parallel, cand_train in candidate_layouts(model, parallel, train, hardware):
        if estimate_memory(Geometry(model, cand_parallel, cand_train, hardware.accelerator)).total <= usable:
            yield cand_parallel, cand_train


def search_layouts(
    model: ModelConfig,
    parallel: ParallelConfig,
    train: TrainConfig,
    hardware: HardwareConfig,
    checkpoint: CheckpointConfig,
    top: int | None = None,
    profile: HardwareProfile | None = None,
) -> list[Plan]:
    """Layouts that fit in HBM, fastest estimated step first, then least memory."""
    plans = [
        make_plan(model, cand_parallel, cand_train, hardware, checkpoint, profile)
        for cand_parallel, cand_train in fitting_layouts(model, parallel, train, hardware)
    ]
    plans.sort(key=lambda plan: (plan.step_time_s, plan.memory_per_chip_bytes.total))
    return plans[:top]


def smallest_fitting_cluster(
    model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hardware: HardwareConfig
) -> tuple[int, str] | None:
    """The fewest nodes (of the spec's chips per node) on which some layout fits, and that layout;
    None if none up to ``MAX_NODES`` does. Doubles the node count until one fits, then bisects back
    (memory only falls as chips are added, bar batch divisibility, so the bisection is a good guide).
    """

    def first_fit(nodes: int) -> str | None:
        bigger = hardware.model_copy(update={"nodes": nodes})
        found = next(fitting_layouts(model, parallel, train, bigger), None)
        if found is None:
            return None
        p, t = found
        return (
            f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp} pp={p.pp} "
            f"micro_batch_size={t.micro_batch_size} activation_checkpointing={p.activation_checkpointing}"
        )

    low, high = hardware.nodes, hardware.nodes * 2
    while first_fit(high) is None:
        if high >= MAX_NODES:
            return None
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if first_fit(middle) else (middle, high)
    return high, str(first_fit(high))


def fit_error(
    model: ModelConfig,
    parallel: ParallelConfig,
    train: TrainConfig,
    hardware: HardwareConfig,
    checkpoint: CheckpointConfig,
) -> str | None:
    """None if the layout fits in HBM; else the spec error: the figures, then the best layout of these
    chips that fits, or — when none does — the smallest cluster that would, and what limits it."""
    chip = get_chip(hardware.chip)
    usable = USABLE_HBM_FRACTION * chip.hbm_bytes
    needed = estimate_memory(Geometry(model, parallel, train, hardware.accelerator)).total
    if needed <= usable:
        return None
    problem = (
        f"parallel: needs {needed / 1e9:,.1f} GB per chip but {chip.name} has {chip.hbm_bytes / 1e9:,.0f} GB "
        f"({USABLE_HBM_FRACTION:.0%} usable)"
    )
    best = search_layouts(model, parallel, train, hardware, checkpoint, top=1)
    if best:
        return f"{problem}; try {best[0].layout} (tessera plan --search), or set allow_oversubscribe: true"
    return f"{problem}, and no layout of {hardware.world_size} chips fits; {nothing_fits_advice(model, parallel, train, hardware)}"


def nothing_fits_advice(
    model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hardware: HardwareConfig
) -> str:
    """What to change when no layout of the spec's chips fits: the minimum cluster, and the batch only
    when model states would fit fully sharded (otherwise no batch is small enough)."""
    usable = USABLE_HBM_FRACTION * get_chip(hardware.chip).hbm_bytes
    params = Geometry(model, parallel, train, hardware.accelerator).counts.total
    states = sum(STATE_BYTES.values()) * params
    smallest = smallest_fitting_cluster(model, parallel, train, hardware)
    cluster = f"no cluster up to {MAX_NODES:,} nodes fits this batch"
    if smallest:
        nodes, layout = smallest
        cluster = (
            f"the smallest cluster that fits is {nodes} × {hardware.chips_per_node} chips "
            f"(cluster.nodes={nodes}), e.g. with {layout}"
        )
    if states / hardware.world_size > usable:
        return (
            f"model states alone (16 B/param × {params / 1e9:,.2f} B = {states / 1e9:,.0f} GB) exceed "
            f"{hardware.world_size} chips' usable HBM even fully sharded, so add chips: {cluster}"
        )
    return f"add chips: {cluster}; or lower train.seq_len / train.micro_batch_size"
