"""The pipeline bubble of each schedule, from the forward and the two halves of backward.

One rank's share of one micro-batch is F (forward), B (backward to the inputs, on the critical path)
and W (backward to the weights, which can wait). GPipe and 1F1B idle (p−1)(F+B+W) per step
(Narayanan et al. 2021, §2.2); interleaving v chunks per rank divides that by v. The zero-bubble
schedules move W into the idle slots (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR 2024):

- interleaved_zero_bubble is ZB-H1 (ZB1P, §2.1): (p−1)(F+B−W), a third of 1F1B's at F=B=W, at 1F1B's
  memory; with v chunks per rank divided by v, as interleaving divides 1F1B's (our assumption).
- zbv_zero_bubble is ZB-V (§6): two chunks per rank in a V, zero bubble at F=B=W at 1F1B's activation
  memory. For unequal passes we take ZB-H2's (p−1)(F+B−2W) (§2.2), floored at 0.
- dualpipev is DualPipeV (DeepSeek-V3 technical report, 2024, Table 2; the DualPipe repository):
  (PP/2−1)(F&B+B−3W) in chunk times, with PP = 2p chunks on p ranks. F&B, a forward and a backward run
  overlapped, is F+B here: the overlap hides expert-parallel all-to-alls, not compute. Per rank:
  (p−1)(F+2B−3W)/2, floored at 0.

The V-shaped schedules hold two chunks per rank (v = 2), so their chunk times are the rank's over v.
"""

from __future__ import annotations

from trainer.config import PipelineSchedule


def bubble_passes(schedule: PipelineSchedule, f: float, b: float, w: float) -> float:
    """The bracket of each schedule's (p−1)(…)/v bubble, in the units of f, b and w."""
    return {
        "gpipe": f + b + w,
        "1f1b": f + b + w,
        "interleaved_1f1b": f + b + w,
        "interleaved_zero_bubble": f + b - w,
        "zbv_zero_bubble": max(0.0, f + b - 2 * w),
        "dualpipev": max(0.0, f + 2 * b - 3 * w),
    }[schedule]


def bubble_share(schedule: PipelineSchedule, f: float, b: float, w: float) -> float:
    """The schedule's bubble as a fraction of 1F1B's (with the same v), for passes f, b, w."""
    return bubble_passes(schedule, f, b, w) / (f + b + w)


def bubble_fraction(schedule: PipelineSchedule, p: int, m: int, v: int) -> float:
    """Idle time over compute time of one step at F = B = W, the papers' tables: (p−1)/(v·m) for
    1F1B, a third of that for ZB1P, 0 for ZB-V and DualPipeV."""
    return (p - 1) / (v * m) * bubble_share(schedule, 1.0, 1.0, 1.0)
