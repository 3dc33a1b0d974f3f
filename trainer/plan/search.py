"""Layout search: every valid (dp_replicate, dp_shard, tp, pp, micro-batch, AC) for the chip count."""

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
    layout_errors,
)
from trainer.plan.comms import fast_domain_chips
from trainer.plan.layout import Geometry
from trainer.plan.memory import estimate_memory
from trainer.plan.plan import USABLE_HBM_FRACTION, Plan, make_plan

AC_CHOICES: tuple[ActivationCheckpointing, ...] = ("none", "selective", "full")
MAX_MICRO_BATCH = 16  # larger micro-batches only add activation memory once matmuls are saturated


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_splits(chips: int, tp_limit: int) -> Iterator[dict[str, int]]:
    """Every dp_replicate × dp_shard × tp × pp = chips, with TP inside the fast domain (it talks every layer)."""
    for tp in (t for t in _divisors(chips) if t <= tp_limit):
        for pp in _divisors(chips // tp):
            for dp_shard in _divisors(chips // (tp * pp)):
                yield dict(dp_replicate=chips // (tp * pp * dp_shard), dp_shard=dp_shard, tp=tp, pp=pp)


def candidate_layouts(
    model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hardware: HardwareConfig
) -> Iterator[tuple[ParallelConfig, TrainConfig]]:
    """Valid layouts (``layout_errors`` is empty); knobs not searched keep the spec's values."""
    tp_limit = fast_domain_chips(get_chip(hardware.chip), hardware)
    for degrees in degree_splits(hardware.world_size, tp_limit):
        per_rank = train.global_batch_size // (degrees["dp_replicate"] * degrees["dp_shard"])
        micro_batches = [m for m in _divisors(per_rank) if m <= MAX_MICRO_BATCH]
        for micro, ac in itertools.product(micro_batches, AC_CHOICES):
            cand_parallel = parallel.model_copy(update={**degrees, "activation_checkpointing": ac})
            cand_train = train.model_copy(update={"micro_batch_size": micro})
            if not layout_errors(model, cand_parallel, cand_train, hardware):
                yield cand_parallel, cand_train


def search_layouts(
    model: ModelConfig,
    parallel: ParallelConfig,
    train: TrainConfig,
    hardware: HardwareConfig,
    checkpoint: CheckpointConfig,
    top: int | None = None,
) -> list[Plan]:
    """Layouts that fit in HBM, fastest estimated step first, then least memory (checked before the full plan)."""
    usable = USABLE_HBM_FRACTION * get_chip(hardware.chip).hbm_bytes
    plans = [
        make_plan(model, cand_parallel, cand_train, hardware, checkpoint)
        for cand_parallel, cand_train in candidate_layouts(model, parallel, train, hardware)
        if estimate_memory(Geometry(model, cand_parallel, cand_train, hardware.accelerator)).total <= usable
    ]
    plans.sort(key=lambda plan: (plan.step_time_s, plan.memory_per_chip_bytes.total))
    return plans[:top]


def fit_error(
    model: ModelConfig,
    parallel: ParallelConfig,
    train: TrainConfig,
    hardware: HardwareConfig,
    checkpoint: CheckpointConfig,
) -> str | None:
    """None if the layout fits in HBM; else the spec error, naming the figures and the best layout that fits."""
    chip = get_chip(hardware.chip)
    needed = estimate_memory(Geometry(model, parallel, train, hardware.accelerator)).total
    if needed <= USABLE_HBM_FRACTION * chip.hbm_bytes:
        return None
    problem = (
        f"parallel: needs {needed / 1e9:,.1f} GB per chip but {chip.name} has {chip.hbm_bytes / 1e9:,.0f} GB "
        f"({USABLE_HBM_FRACTION:.0%} usable)"
    )
    best = search_layouts(model, parallel, train, hardware, checkpoint, top=1)
    if best:
        return f"{problem}; try {best[0].layout} (tessera plan --search), or set allow_oversubscribe: true"
    return (
        f"{problem}, and no layout of {hardware.world_size} chips fits; add chips (cluster.nodes) or "
        f"lower train.seq_len / train.global_batch_size"
    )
