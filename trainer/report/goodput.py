"""Goodput accounting: where every second of a run's wall time went.

Definitions follow Google's ML Productivity Goodput (cloud.google.com, "ML Goodput measurement"):

* **scheduling goodput** — the share of the run's wall time in which it held the resources it asked
  for. tessera sees only the time from each launch of the training job (recorded by the train task)
  to its first worker process: pod scheduling, image pull, agent start-up. Time a flow run waits in
  a work-pool queue before its train task starts is invisible to it.
* **runtime goodput** — of the time it held them, the share spent in training steps whose result was
  kept. The rest is badput: start-up, checkpoint stalls, restarts (fault → training resumed: failure
  detection, relaunch, start-up, restore), steps recomputed because they were lost with a failure.
* **program goodput** — how well a kept step used the chips: model FLOPs utilisation against the
  chip catalog's peak, the mean of ``metrics.jsonl``'s ``mfu``. The catalog peak, not what the
  hardware can reach on this model, so it is a lower bound of Google's "ideal step time" ratio.

``effective training time`` (Llama 3's figure) = scheduling × runtime goodput = productive / wall.
Evaluations and checkpoint validation run beside training (``tasks/checkpoints.py``) and cost the
training job no wall time, so they have no line here.

The trainer's rank 0 and the train task write ``goodput.jsonl`` (:mod:`trainer.goodput_log`);
:func:`account` turns the file into a :class:`Breakdown`. A ``kill -9``
leaves no line: the time from an attempt's last line to the next attempt's restore is its restart.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.goodput_log import read_events
from trainer.metrics import read_metrics

CATEGORIES = (
    "productive",
    "checkpoint",
    "memory_snapshot",
    "startup",
    "restart",
    "recomputed",
    "scheduling",
    "other",
)


@dataclass
class Attempt:
    """One trainer process lifetime (rank 0's): what it restored, which steps it ran, when it was last seen."""

    started: float
    restored: float
    resumed_step: int = 0
    spans: list[dict[str, Any]] = field(default_factory=list)
    stalls: list[dict[str, Any]] = field(default_factory=list)
    last_seen: float = 0.0


@dataclass(frozen=True)
class Breakdown:
    """Seconds per category (they sum to ``wall_s``), steps lost, and Google's three goodputs."""

    wall_s: float
    seconds: dict[str, float]
    restarts: int
    steps_lost: int
    steps_kept: int
    program_goodput: float | None

    @property
    def effective_training_time(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s else 0.0

    @property
    def scheduling_goodput(self) -> float:
        return 1 - self.seconds["scheduling"] / self.wall_s if self.wall_s else 0.0

    @property
    def runtime_goodput(self) -> float:
        held = self.wall_s - self.seconds["scheduling"]
        return self.seconds["productive"] / held if held else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "seconds": self.seconds,
            "fractions": {k: v / self.wall_s if self.wall_s else 0.0 for k, v in self.seconds.items()},
            "restarts": self.restarts,
            "steps_lost": self.steps_lost,
            "steps_kept": self.steps_kept,
            "effective_training_time": self.effective_training_time,
            "scheduling_goodput": self.scheduling_goodput,
            "runtime_goodput": self.runtime_goodput,
            "program_goodput": self.program_goodput,
        }


def attempts_of(events: list[dict[str, Any]]) -> list[Attempt]:
    """Group the trainer's lines by process: each ``startup`` line opens an attempt."""
    attempts: list[Attempt] = []
    for event in events:
        kind = event["kind"]
        if kind == "startup":
            attempts.append(Attempt(event["t0"], event["t1"], last_seen=event["t1"]))
        elif kind != "launch" and attempts:
            current = attempts[-1]
            current.last_seen = max(current.last_seen, event["t1"])
            if kind == "restore":
                current.restored, current.resumed_step = event["t1"], event["step"]
            elif kind == "steps":
                current.spans.append(event)
            elif kind in ("checkpoint", "snapshot"):
                current.stalls.append(event)
    return attempts


def _steps_after(span: dict[str, Any], step: int) -> float:
    """The share of a span's steps numbered above ``step``: those a later attempt trained again."""
    n = span["last"] - span["first"] + 1
    return min(n, max(0, span["last"] - step)) / n


def account(events: list[dict[str, Any]], mfu: float | None = None) -> Breakdown:
    """Split the run's wall time (first launch or process start → last line) into :data:`CATEGORIES`.

    A step counts as productive in the attempt whose result the run kept; in an earlier attempt, any
    step past the checkpoint a later attempt resumed from was ``recomputed``. Each attempt after the
    first is a ``restart`` from the previous attempt's last line to its own restore; the first
    attempt's start-up and restore are ``startup``; a launch → first process gap is ``scheduling``.
    """
    attempts = attempts_of(events)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    if not attempts:
        return Breakdown(0.0, seconds, 0, 0, 0, mfu)
    launches = [e["t"] for e in events if e["kind"] == "launch"]
    begin = min([attempts[0].started, *launches])
    wall = max(a.last_seen for a in attempts) - begin
    steps_lost = 0
    for i, attempt in enumerate(attempts):
        later = [a.resumed_step for a in attempts[i + 1 :]]
        kept_until = min(later) if later else None  # a later attempt that resumed earlier redid these too
        for span in attempt.spans:
            lost = 0.0 if kept_until is None else _steps_after(span, kept_until)
            steps_lost += round(lost * (span["last"] - span["first"] + 1))
            seconds["recomputed"] += lost * (span["t1"] - span["t0"])
            seconds["productive"] += (1 - lost) * (span["t1"] - span["t0"])
        for stall in attempt.stalls:
            seconds["checkpoint" if stall["kind"] == "checkpoint" else "memory_snapshot"] += (
                stall["t1"] - stall["t0"]
            )
        if i == 0:
            launched = _last_launch(launches, attempt)
            if launched is not None:
                seconds["scheduling"] += attempt.started - launched
            seconds["startup"] += attempt.restored - attempt.started
        else:
            restart, waited = _restart(attempts[i - 1], attempt, launches)
            seconds["scheduling"] += waited
            seconds["restart"] += restart
    seconds["other"] = max(0.0, wall - sum(seconds.values()))
    kept = max((s["last"] for s in attempts[-1].spans), default=attempts[-1].resumed_step)
    return Breakdown(wall, seconds, len(attempts) - 1, steps_lost, kept, mfu)


def _restart(previous: Attempt, attempt: Attempt, launches: list[float]) -> tuple[float, float]:
    """(restart, waited): from ``previous``'s last line to ``attempt``'s restore, less the time from a
    retry's launch to its process (scheduling, not restarting). torchrun's own restarts launch nothing:
    all of their gap is restart."""
    launched = _last_launch(launches, attempt)
    waited = 0.0
    if launched is not None and launched >= previous.last_seen:
        waited = attempt.started - launched
    return attempt.restored - previous.last_seen - waited, waited


def _last_launch(launches: list[float], attempt: Attempt) -> float | None:
    """The last launch before ``attempt``'s process started (None: it was never launched, e.g. a bare
    torchrun)."""
    return max((t for t in launches if t <= attempt.started), default=None)


def restart_seconds(events: list[dict[str, Any]]) -> list[float]:
    """Each restart's seconds from fault to training resumed, in order (their sum is ``restart``)."""
    attempts = attempts_of(events)
    launches = [e["t"] for e in events if e["kind"] == "launch"]
    return [_restart(a, b, launches)[0] for a, b in itertools.pairwise(attempts)]


def account_run(goodput_file: Path, metrics_file: Path) -> Breakdown:
    """The breakdown of a run directory's ``goodput.jsonl``, with program goodput from its metrics."""
    mfus = [m["mfu"] for m in read_metrics(metrics_file) if "mfu" in m]
    return account(read_events(goodput_file), sum(mfus) / len(mfus) if mfus else None)


LABELS = {
    "productive": "productive steps",
    "checkpoint": "checkpoint stalls (storage)",
    "memory_snapshot": "in-memory snapshot stalls",
    "startup": "start-up (first attempt, incl. restore)",
    "restart": "restarts (fault → training resumed)",
    "recomputed": "recomputed (lost) steps",
    "scheduling": "waiting for capacity (launch → first process)",
    "other": "other (logging, final barrier, unrecorded)",
}


def format_markdown(breakdown: Breakdown) -> str:
    """The report's goodput section: the time table, then the three goodputs and their product."""
    if not breakdown.wall_s:
        return (
            "## Goodput\n\nNo trainer intervals in the run directory's goodput.jsonl (a run on Kubernetes "
            "keeps them in its pods: they are not copied back yet)."
        )
    rows = [f"| {LABELS[k]} | {v:.1f} | {v / breakdown.wall_s:.1%} |" for k, v in breakdown.seconds.items()]
    program = breakdown.program_goodput
    ml = (
        f"{breakdown.scheduling_goodput * breakdown.runtime_goodput * program:.1%}"
        if program is not None
        else "–"
    )
    return "\n".join(
        [
            "## Goodput",
            "",
            "| wall time | seconds | share |",
            "|---|---|---|",
            *rows,
            f"| **total** | {breakdown.wall_s:.1f} | 100% |",
            "",
            f"Effective training time {breakdown.effective_training_time:.1%}; "
            f"{breakdown.restarts} restart(s), {breakdown.steps_lost} step(s) recomputed. "
            f"Goodput (Google ML Productivity): scheduling {breakdown.scheduling_goodput:.1%} × runtime "
            f"{breakdown.runtime_goodput:.1%} × program (MFU vs catalog peak) "
            f"{'–' if program is None else f'{program:.1%}'} = {ml}. "
            "Evaluations run beside training and take none of its time.",
        ]
    )
