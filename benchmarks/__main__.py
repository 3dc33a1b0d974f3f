"""``python -m benchmarks [--only data,trainer]`` (``make bench``): run the benchmarks, then summarise.

Each benchmark runs in its own process (``python -m benchmarks.bench_<area>``), as it would alone, so
one's environment (a Prefect server, ``TESSERA_RUNS_DIR``) cannot leak into the next. The summary
covers every area with a results file, so a partial ``--only`` run still reports the others' last
figures; each row says whether it was measured in this invocation.

Writes ``benchmarks/results/summary.json`` and ``benchmarks/results/summary.md``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, Headline, lookup, results_path

BENCH_DIR = Path(__file__).parent
REPO_ROOT = BENCH_DIR.parent


# Benchmarks with a runner of their own: bench_gpu needs a CUDA host (``make bench-gpu``).
SEPARATE = {"gpu"}


def areas() -> list[str]:
    return sorted(
        area for p in BENCH_DIR.glob("bench_*.py") if (area := p.stem.removeprefix("bench_")) not in SEPARATE
    )


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def git_commit() -> str:
    """HEAD, with ``-dirty`` when the tree has uncommitted changes (results then are not of HEAD alone)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    return f"{commit}-dirty" if git("status", "--porcelain", "--untracked-files=no") else commit


def machine() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": git_commit(),
    }


def run_benchmark(area: str) -> float:
    """Run one benchmark in a fresh interpreter; return its wall time. Its output streams through."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", f"benchmarks.bench_{area}"], cwd=REPO_ROOT, check=True)
    return time.perf_counter() - start


def summarise(area: str, wall_s: float | None) -> dict[str, Any]:
    headline: Headline = importlib.import_module(f"benchmarks.bench_{area}").HEADLINE
    figures = json.loads(results_path(area).read_text())
    return {
        "area": area,
        "ratio_metric": headline.ratio,
        "ratio": lookup(figures, headline.ratio),
        "baseline": headline.baseline,
        "goal": str(headline.goal),
        "goal_met": headline.goal.met(figures),
        "measured_now": wall_s is not None,
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "figures": figures,
    }


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown(summary: dict[str, Any]) -> str:
    m = summary["machine"]
    lines = [
        "# Benchmarks",
        "",
        f"{m['cpu_count']} × {m['cpu_model']} · Python {m['python']} · torch {m['torch']} · "
        f"commit `{m['git_commit']}` · {summary['date']}",
        "",
        "| benchmark | ratio | value | baseline | goal | met | measured now |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary["benchmarks"]:
        measured = f"yes ({row['wall_s']} s)" if row["measured_now"] else "no (last results file)"
        lines.append(
            f"| {row['area']} | `{row['ratio_metric']}` | {_cell(row['ratio'])} | {row['baseline']} | "
            f"`{row['goal']}` | {'yes' if row['goal_met'] else '**no**'} | "
            f"{measured} |"
        )
    for row in summary["benchmarks"]:
        lines += ["", f"## {row['area']}", "", "```json", json.dumps(row["figures"], indent=2), "```"]
    return "\n".join(lines) + "\n"


def parse_only(value: str | None) -> list[str]:
    known = areas()
    if not value:
        return known
    chosen = [name.strip() for name in value.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise SystemExit(
            f"error: --only: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated subset of: {', '.join(areas())}")
    parser.add_argument(
        "--summary-only", action="store_true", help="run nothing; rebuild the summary from the results files"
    )
    args = parser.parse_args()
    chosen = [] if args.summary_only else parse_only(args.only)
    walls = {area: run_benchmark(area) for area in chosen}
    if not any(results_path(area).exists() for area in areas()):  # a fresh clone: results are not committed
        raise SystemExit(
            f"no benchmark results in {RESULTS_DIR} yet; run `python -m benchmarks` (or --only AREA) first"
        )
    summary = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "benchmarks": [summarise(area, walls.get(area)) for area in areas() if results_path(area).exists()],
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (RESULTS_DIR / "summary.md").write_text(markdown(summary))
    print(markdown(summary).split("\n## ")[0])


if __name__ == "__main__":
    main()
