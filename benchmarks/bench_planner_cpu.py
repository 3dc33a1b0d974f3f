"""The planner against measured steps: predicted vs measured step time of the real trainer on CPU.

``tessera calibrate`` first measures this machine (writes runs/calibration/cpu.json);
then each layout below trains the ``tiny`` or ``small`` preset under torchrun on 1–4 CPU processes
over gloo, and its median step time after warm-up is compared with ``make_plan(..., profile=...)``:

- layouts: DDP-like (dp_replicate), FSDP, HSDP, TP, PP (GPipe and 1F1B), activation checkpointing
  modes and micro-batch sizes. Goals: each within ±20%, Spearman rank correlation ≥ 0.8 (so that
  ``--search`` ranks layouts as they really run);
- scaling: three model sizes over 1, 2 and 4 processes (FSDP, same global batch), predicted and
  measured side by side in ``benchmarks/results/planner_cpu_scaling.png``.

A CPU box shared with other work is noisy. Calibration measures the rates a step sustains (medians of
windows of back-to-back calls, every process of a group busy at once) and a step's time is the median
of what it did, so a rare burst falls out of both; load that lasts shows as measured above predicted:
the load average before and after is recorded, and a run should be repeated.
Minutes, not seconds (one torchrun per row).

    python -m benchmarks.bench_planner_cpu   # writes benchmarks/results/planner_cpu.json (+ .png)
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, Goal, Headline, main
from trainer.backends.chips import get_chip
from trainer.config import (
    CheckpointConfig,
    HardwareConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from trainer.job import resolve_job
from trainer.metrics import read_metrics
from trainer.plan import make_plan
from trainer.plan.calibrate import calibrate
from trainer.plan.profile import load_profile
from trainer.rundir import RunDir
from trainer.runtime.launch import launch_env, torchrun_command

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "runs" / "calibration" / "cpu.json"
STEPS, WARMUP = 10, 3
# A tiny step lasts ~60 ms, about as long as one scheduler hiccup of a shared host: its median over 7
# steps moved by 20% between two quiet runs (0.075 and 0.061 s), so it is taken over more of them.
STEPS_BY_PRESET = {"tiny": 40}
SEQ_LEN, GLOBAL_BATCH = 128, 8
HEADLINE = Headline(
    ratio="layouts.spearman",
    baseline="measured median step time of the real trainer (CPU, gloo)",
    goal=Goal("layouts.spearman", ">=", 0.8),
)
MEDIUM: dict[str, Any] = dict(
    preset="custom",
    n_layers=8,
    dim=768,
    n_heads=12,
    n_kv_heads=4,
    ffn_dim=2048,
    vocab_size=8192,
    rope_theta=1e4,
)
# (name, model, processes, parallel, micro-batch size)
LAYOUTS: list[tuple[str, dict[str, Any], int, dict[str, Any], int]] = [
    ("tiny fsdp", {"preset": "tiny"}, 2, {"dp_shard": 2}, 4),
    ("small ddp", {"preset": "small"}, 2, {"dp_replicate": 2}, 4),
    ("small fsdp mb=1", {"preset": "small"}, 2, {"dp_shard": 2}, 1),
    ("small fsdp", {"preset": "small"}, 2, {"dp_shard": 2}, 4),
    (
        "small fsdp ac=selective",
        {"preset": "small"},
        2,
        {"dp_shard": 2, "activation_checkpointing": "selective"},
        4,
    ),
    ("small fsdp ac=full", {"preset": "small"}, 2, {"dp_shard": 2, "activation_checkpointing": "full"}, 4),
    ("small hsdp 2x2", {"preset": "small"}, 4, {"dp_replicate": 2, "dp_shard": 2}, 2),
    ("small tp=2", {"preset": "small"}, 2, {"tp": 2}, 4),
    ("small pp=2 gpipe", {"preset": "small"}, 2, {"pp": 2, "pp_schedule": "gpipe"}, 2),
    ("small pp=2 1f1b", {"preset": "small"}, 2, {"pp": 2, "pp_schedule": "1f1b"}, 2),
]
SCALING_MODELS = {"tiny": {"preset": "tiny"}, "small": {"preset": "small"}, "medium": MEDIUM}


def job_for(model: dict[str, Any], processes: int, parallel: dict[str, Any], micro: int) -> JobConfig:
    steps = STEPS_BY_PRESET.get(model["preset"], STEPS)
    return JobConfig(
        name="bench-planner",
        model=ModelConfig(**model),
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(
            steps=steps, seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro
        ),
        hardware=HardwareConfig(chips_per_node=processes),
        checkpoint=CheckpointConfig(interval=10 * steps),  # only the final save, after the timed steps
        loader_workers=0,
    )


def measured_step_s(job: JobConfig, work: Path) -> float:
    """Median step time after warm-up of ``python -m trainer.train`` under torchrun."""
    work.mkdir(parents=True)
    job_json = work / "job.json"
    run_dir = work / "run"
    job_json.write_text(resolve_job(job, RunDir(run_dir)).model_dump_json())
    cmd = torchrun_command(job_json, run_dir, job.hardware.chips_per_node)
    done = subprocess.run(cmd, env=launch_env(job), cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"trainer failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    times = [line["step_time_s"] for line in read_metrics(run_dir / "metrics.jsonl")]
    return statistics.median(times[WARMUP:])


def predicted_step_s(job: JobConfig) -> tuple[float, dict[str, float]]:
    profile = load_profile(get_chip("cpu"), PROFILE)
    plan = make_plan(job.model, job.parallel, job.train, job.hardware, job.checkpoint, profile=profile)
    time = plan.time_breakdown
    parts = {"compute": time.compute_s, "bubble": time.bubble_s, "optimizer": time.optimizer_s}
    parts.update({f"comm_{dim}": s for dim, s in time.exposed_comm_s.items() if s})
    return plan.step_time_s, {k: round(v, 4) for k, v in parts.items()}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation, tied values sharing their mean rank (the planner prices the GPipe and 1F1B
    rows alike), as Pearson's correlation of the ranks."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
                end += 1
            for i in order[start : end + 1]:
                result[i] = (start + end) / 2
            start = end + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def compare(name: str, job: JobConfig, work: Path, measured_by_job: dict[str, float]) -> dict[str, Any]:
    """One row; a job already measured (a scaling point that is also a layout row) is not run again."""
    key = job.model_dump_json()
    if key not in measured_by_job:
        measured_by_job[key] = measured_step_s(job, work / name.replace(" ", "_").replace("=", ""))
    measured = measured_by_job[key]
    predicted, parts = predicted_step_s(job)
    print(
        f"{name:28s} measured {measured:.4f} s  predicted {predicted:.4f} s  ratio {predicted / measured:.3f}"
    )
    return {
        "name": name,
        "processes": job.hardware.chips_per_node,
        "measured_s": round(measured, 4),
        "predicted_s": round(predicted, 4),
        "ratio": round(predicted / measured, 3),
        "predicted_parts_s": parts,
    }


def plot_scaling(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for model in SCALING_MODELS:
        mine = [r for r in rows if r["model"] == model]
        procs = [r["processes"] for r in mine]
        (line,) = ax.plot(procs, [r["measured_s"] for r in mine], "o-", label=f"{model} measured")
        ax.plot(
            procs, [r["predicted_s"] for r in mine], "x--", color=line.get_color(), label=f"{model} predicted"
        )
    ax.set(xlabel="CPU processes (FSDP, same global batch)", ylabel="step time (s)", xticks=[1, 2, 4])
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("tessera planner vs measured step time (CPU, gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run() -> dict[str, Any]:
    load_before = load()
    calibrate(PROFILE)  # `tessera calibrate`, under the same conditions as the measurements
    measured: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as tmp:
        work = Path(tmp)
        layouts = [compare(name, job_for(m, n, p, mb), work, measured) for name, m, n, p, mb in LAYOUTS]
        scaling = [
            {
                "model": model,
                **compare(
                    f"{model} x{n}", job_for(spec, n, {"dp_shard": n}, GLOBAL_BATCH // n), work, measured
                ),
            }
            for model, spec in SCALING_MODELS.items()
            for n in (1, 2, 4)
        ]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot = plot_scaling(scaling, RESULTS_DIR / "planner_cpu_scaling.png")
    errors = [abs(r["ratio"] - 1) for r in layouts]
    return {
        "profile": str(PROFILE.relative_to(REPO)),
        "load_average_before": load_before,
        "load_average_after": load(),
        "cpu_count": os.cpu_count(),
        "layouts": {
            "rows": layouts,
            "spearman": round(
                spearman([r["predicted_s"] for r in layouts], [r["measured_s"] for r in layouts]), 3
            ),
            "within_20_percent": sum(e <= 0.2 for e in errors),
            "of": len(errors),
            "median_error": round(statistics.median(errors), 3),
            "worst_error": round(max(errors), 3),
        },
        "scaling": {"rows": scaling, "plot": str(plot.relative_to(REPO))},
    }


if __name__ == "__main__":
    main("planner_cpu", run)
