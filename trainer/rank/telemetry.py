"""Per-rank step telemetry: find the straggler a synchronous job hides.

Every rank's total step time is the same — the fast ranks wait for the slow one inside the step's
collectives — so the signal is the time each rank spends *before* its first collective: fetching
the batch and host-side work, where a slow host, loader or disk shows. On log steps the ranks
all-gather that one float; rank 0 writes the slowest rank into ``metrics.jsonl`` and warns.
"""

from __future__ import annotations

import logging
import resource
import statistics

import torch
import torch.distributed as dist

log = logging.getLogger("tessera.telemetry")

STRAGGLER_RATIO = 2.0  # slowest over median host time
STRAGGLER_MIN_GAP_S = 0.05  # ignore jitter on steps that take milliseconds


def gather_host_times(host_s: float, device: torch.device) -> list[float]:
    """Every rank's host time for this step, by rank (a collective: all ranks call it)."""
    mine = torch.tensor([host_s], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.item() for t in everyone]


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory so far, for planned vs measured: the accelerator allocator's high-water
    mark, or on CPU the process's peak resident set (which also counts the Python runtime and torch's
    libraries, so it reads above the planner's per-chip figure)."""
    if device.type == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return torch.accelerator.max_memory_allocated(device)


def straggler_fields(step: int, host_times: list[float]) -> dict[str, float | int | bool]:
    """The metrics.jsonl fields for one step; logs a warning naming the rank when one lags."""
    slowest = max(range(len(host_times)), key=host_times.__getitem__)
    others = host_times[:slowest] + host_times[slowest + 1 :]
    # The median of the *other* ranks: with two ranks, a median over all would halve the gap.
    worst, median = host_times[slowest], statistics.median(others) if others else host_times[slowest]
    lagging = worst > STRAGGLER_RATIO * median and worst - median > STRAGGLER_MIN_GAP_S
    if lagging:
        log.warning(
            "straggler: rank %d spent %.3fs before step %d's first collective (other ranks' median "
            "%.3fs); every other rank waited for it",
            slowest,
            worst,
            step,
            median,
        )
    return {
        "slowest_rank": slowest,
        "straggler": lagging,
        "host_time_max_s": worst,
        "host_time_others_median_s": median,
    }
