"""What every benchmark shares: its headline (ratio, baseline, goal) and how its results are written.

Each ``benchmarks/bench_<area>.py`` exposes ``run() -> dict`` and a module-level ``HEADLINE``; its
``__main__`` block is ``main(AREA, run)``, which writes ``benchmarks/results/<area>.json``. The
summary (``python -m benchmarks``) reads those files back, so a benchmark run alone and one run by
``make bench`` leave the same record.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

RESULTS_DIR = Path(__file__).parent / "results"
_COMPARE = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, "==": operator.eq}


def lookup(results: dict[str, Any], metric: str) -> Any:
    """``results["full"]["flops_ratio"]`` for ``metric="full.flops_ratio"``."""
    value: Any = results
    for part in metric.split("."):
        value = value[part]
    return value


@dataclass(frozen=True)
class Goal:
    """A target on one metric of a benchmark's results, e.g. ``ratio <= 0.1``."""

    metric: str
    op: Literal["<=", ">=", "<", "=="]
    target: float

    def met(self, results: dict[str, Any]) -> bool:
        return bool(_COMPARE[self.op](lookup(results, self.metric), self.target))

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.target:g}"


@dataclass(frozen=True)
class Headline:
    """The one number to compare across commits: ``ratio`` (a metric path) against ``baseline``."""

    ratio: str
    baseline: str
    goal: Goal


def results_path(area: str) -> Path:
    return RESULTS_DIR / f"{area}.json"


def write_results(area: str, results: dict[str, Any]) -> Path:
    path = results_path(area)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def main(area: str, run: Callable[[], dict[str, Any]]) -> None:
    """The ``python -m benchmarks.bench_<area>`` entry point: run, write the JSON, print it."""
    results = run()
    write_results(area, results)
    print(json.dumps(results, indent=2))
