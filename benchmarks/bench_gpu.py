"""``make bench-gpu``: the trainer on this host's GPUs, beside a hand-written loop, the planner and the disk.

One command on any CUDA host with one to eight GPUs (``python -m benchmarks.bench_gpu``). It needs no
``.venv``: the host's own CUDA build of torch, numpy, fsspec and yaml, with pydantic and webdataset
(carried as wheels where the image lacks them, see ``benchmarks/gpu_lease.sh``). It imports nothing of
Prefect (``tasks/``, ``flows/``); fp8 rows skip, saying why, where torchao is missing.

In one run, in this order, within one global deadline (``--deadline-s``, 8 minutes: a lent accelerator
has 15, start-up included); a step that would not finish in what is left is skipped with the reason:

1. ``tessera calibrate``'s measurement of this device (``trainer.plan.calibrate``), written beside the
   results: the rows' planned steps with it sit beside those with the chip catalog's figures. It
   includes the raw speed of the disk the checkpoints go to (``--work-dir``'s): one large sequential
   write with fsync, then the same file read back after its pages are dropped from the page cache.
2. Per row (``ROWS``: 1.14B eager, compiled, compiled + fp8, the 8-layer cut of Llama 3 8B; with two or
   more GPUs FSDP and TP across them): ``tessera train``'s own launch (``Run.open`` + ``launch_local``)
   on synthetic tokens, timed from outside: time to the first step is the wall clock from launch to the
   first metrics line, compile time step 1 less the median step, the final save the last metrics
   line to the launcher's return. Then a hand-written loop over the same model class (fp32 master
   weights, bf16 autocast, fused AdamW, clipping; the same compile and fp8 conversion) in its own
   process, which also saves and loads a checkpoint of its model and optimizer through the trainer's
   ``CheckpointManager`` (GB/s beside the raw disk's) when time allows.

Tokens/s and MFU are medians after ``WARMUP`` steps; MFU is against the catalog's dense bf16 peak.
Peak memory: the trainer's allocator high-water mark beside the plan's per-chip total.

``--dry-run``: tiny shapes on CPU processes (gloo), the same code path, in minutes; ``make test`` runs it
(``tests/test_bench_gpu.py``). Compile is off there (inductor's CPU build would dominate a CPU test), and
fp8 rows skip (the CPU has no fp8 matmul), which exercises the skip path.

Writes ``<out>/gpu.json``, ``<out>/gpu.md`` and the profile ``<out>/gpu-profile.json`` (``gpu-dry-run*``
for a dry run); ``--out`` defaults to ``benchmarks/results``, ``--work-dir`` to ``runs/bench-gpu``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from benchmarks.common import RESULTS_DIR
from deployments.run import Run
from deployments.spec import TrainingSpec
from trainer.backends.chips import get_chip
from trainer.config import JobConfig
from trainer.metrics import read_metrics
from trainer.plan import make_plan
from trainer.plan.disk import drop_cached, raw_disk_speed
from trainer.plan.profile import load_profile
from trainer.plan.timers import HostTimer
from trainer.rundir import RunDir

DEADLINE_S = 480.0
STEPS, WARMUP = 15, 5  # the first steps pay for compilation, allocator growth and lazy init
DRY_STEPS, DRY_WARMUP = 4, 1
RAW_BYTES, DRY_RAW_BYTES = 4 * 2**30, 64 * 2**20  # the raw disk test's file
WORK_DIR = Path(__file__).parent.parent / "runs" / "bench-gpu"
CALIBRATE_NEED_S = 60.0  # what calibration takes on one GPU (a dry run: its quick mode, ~20 s on CPU)

LLAMA_1B = dict(n_layers=16, dim=2048, n_heads=16, n_kv_heads=8, ffn_dim=8192, vocab_size=32000)
LLAMA3_8B_CUT = dict(n_layers=8, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
DRY_MODEL = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)


@dataclass(frozen=True)
class Row:
    """One benchmark row: a model, a layout, and what it needs (GPUs, seconds on one H200)."""

    name: str
    model: dict[str, int]
    parallel: dict[str, Any] = field(default_factory=dict)
    micro_batch: int = 4
    batch: int = 8  # sequences per data-parallel rank and step (the rows: 32,768 tokens)
    gpus: int = 1  # 0: all of this host's (the multi-GPU rows), never fewer than two
    spread: Literal["dp_shard", "tp"] = "dp_shard"  # the mesh dimension a multi-GPU row spans
    need_s: float = 60.0  # trainer + hand-written loop on one H200, checkpoints excluded (estimates)

    def description(self) -> str:
        knobs = [f"{k}={v}" for k, v in self.parallel.items()]
        return f"{self.name} ({self.model['n_layers']}×{self.model['dim']}, {' '.join(knobs) or 'eager'})"


ROWS = (
    Row("1b-eager", LLAMA_1B, need_s=50),
    Row("1b-compile", LLAMA_1B, {"compile": True}, need_s=80),
    Row("1b-compile-fp8", LLAMA_1B, {"compile": True, "float8": "tensorwise"}, need_s=80),
    Row("8b-8layer-compile", LLAMA3_8B_CUT, {"compile": True}, micro_batch=2, need_s=100),
    Row("1b-fsdp", LLAMA_1B, {"compile": True}, gpus=0, need_s=80),
    Row("1b-tp", LLAMA_1B, {"compile": True}, gpus=0, spread="tp", need_s=80),
)


class OutOfTime(Exception):
    """The global deadline passed while a step ran."""


@dataclass
class Budget:
    """The global deadline: what is left of it, and whether a step estimated at ``need_s`` fits."""

    deadline_s: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.started)

    def refuse(self, need_s: float) -> str | None:
        """None if ``need_s`` fits in what is left, else the reason to skip."""
        left = self.left()
        return None if need_s <= left else f"deadline: {max(left, 0):.0f} s left, needs ~{need_s:.0f} s"

    def check(self) -> None:
        if self.left() <= 0:
            raise OutOfTime(f"the {self.deadline_s:.0f} s deadline passed")


@dataclass(frozen=True)
class Host:
    """Where the rows run: CUDA GPUs, or (a dry run) CPU processes standing in for them."""

    accelerator: str
    chip: str
    devices: int
    dry_run: bool

    @property
    def steps(self) -> tuple[int, int]:
        return (DRY_STEPS, DRY_WARMUP) if self.dry_run else (STEPS, WARMUP)


def detect_host(dry_run: bool, chip: str | None) -> Host:
    """A dry run: two CPU processes as 'devices'; else every CUDA device, as the catalog's chip that
    calibration names from the device (or ``chip``)."""
    if dry_run:
        return Host("cpu", "cpu", 2, True)
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here; `python -m benchmarks.bench_gpu --dry-run` runs on CPU")
    from trainer.plan.calibrate import catalog_chip, device_name

    device = torch.device("cuda", 0)
    chip = chip or catalog_chip(device)
    if chip is None:
        raise SystemExit(
            f"error: the chip catalog has no {device_name(device)!r}; pass --chip with the catalog's name "
            "of the chip it is (trainer/backends/chips.py)"
        )
    get_chip(chip)  # an unknown --chip fails here, naming the known ones
    return Host("gpu", chip, torch.cuda.device_count(), False)


def spec_for(row: Row, host: Host, devices: int) -> dict[str, Any]:
    """The row's training spec: the row's model and layout on ``devices`` of the host, synthetic tokens,
    one final checkpoint."""
    steps, _ = host.steps
    model = DRY_MODEL if host.dry_run else row.model
    parallel = {"mixed_precision": "bf16", **row.parallel}
    if host.dry_run:
        parallel.pop("compile", None)
    tp = devices if row.spread == "tp" else 1
    dp = devices // tp
    micro = 2 if host.dry_run else row.micro_batch
    return {
        "name": f"bench-gpu-{row.name}",
        "model": {"preset": "custom", "rope_theta": 5e5, **model},
        "data": {"loader_workers": 0},
        "train": {
            "steps": steps,
            "seq_len": 64 if host.dry_run else 4096,
            "global_batch_size": (2 * micro if host.dry_run else row.batch) * dp,
            "micro_batch_size": micro,
        },
        "parallel": {**parallel, "dp_shard": dp, "tp": tp},
        "cluster": {"accelerator": host.accelerator, "chip": host.chip, "chips_per_node": devices},
        "checkpoint": {"interval": 10 * steps},  # only the final save, after the last timed step
        "optimizer": {"lr": 3e-4, "warmup_steps": 2},
    }


def row_devices(row: Row, host: Host) -> int | str:
    """The devices the row runs on, or why it cannot run on this host."""
    if row.gpus:
        return row.gpus
    if host.devices < 2:
        return f"needs two or more GPUs; this host has {host.devices}"
    return host.devices


def skip_reason(row: Row, host: Host) -> str | None:
    """Why a row cannot run on this host at all (before any time is spent on it)."""
    float8 = row.parallel.get("float8", "none") != "none"
    if float8 and not get_chip(host.chip).peak_fp8_flops:
        return f"chip {host.chip!r} has no fp8 matmul"
    if float8 and importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (fp8 needs it)"
    return None


def medians(lines: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    timed = lines[warmup:] or lines
    return {
        key: statistics.median(line[key] for line in timed) for key in ("step_time_s", "tokens_per_s", "mfu")
    }


def run_trainer(job_run: Run, budget: Budget, warmup: int) -> dict[str, Any]:
    """``tessera train``'s launch of the row, timed from outside (see the module docstring)."""
    launched = time.time()
    result = job_run.launch_local(poll=budget.check)
    ended = time.time()
    if result.kind != "ok":
        raise RuntimeError(f"trainer failed ({result.kind}):\n{result.log_tail[-3000:]}")
    lines = [line for line in read_metrics(job_run.dir.metrics) if "step_time_s" in line]
    middle = medians(lines, warmup)
    checkpoint_bytes = sum(f.stat().st_size for f in Path(job_run.checkpoint_url).rglob("*") if f.is_file())
    final_save_s = ended - lines[-1]["time"]
    return {
        **middle,
        "steps": len(lines),
        "time_to_first_step_s": lines[0]["time"] - launched,
        "compile_s": lines[0]["step_time_s"] - middle["step_time_s"],
        "peak_memory_bytes": max(line["peak_memory_bytes"] for line in lines),
        "loss_first_last": [lines[0]["loss"], lines[-1]["loss"]],
        "final_save_s": final_save_s,
        "checkpoint_bytes": checkpoint_bytes,
        "final_save_gbps": checkpoint_bytes / final_save_s / 1e9,
    }


def run_baseline(
    job: JobConfig, work: Path, budget: Budget, steps: tuple[int, int], checkpoint: bool
) -> dict[str, Any]:
    """The hand-written loop in its own process (``--baseline-worker``), on one device."""
    job_json, out = work / "baseline-job.json", work / "baseline.json"
    job_json.write_text(job.model_dump_json())
    cmd = [sys.executable, "-m", "benchmarks.bench_gpu", "--baseline-worker", str(job_json), str(out)]
    cmd += ["--steps", str(steps[0]), "--warmup", str(steps[1])]
    if checkpoint:
        cmd += ["--checkpoint-dir", str(work / "baseline-checkpoints")]
    done = subprocess.run(
        cmd, cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=max(budget.left(), 1)
    )
    if done.returncode:
        raise RuntimeError(f"hand-written loop failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def plans(job: JobConfig, profile_path: Path | None) -> dict[str, Any]:
    """The planner's step and memory for the row with the catalog's figures, and with the profile
    measured in this run (or why not)."""
    inputs = (job.model, job.parallel, job.train, job.hardware, job.checkpoint)
    catalog = make_plan(*inputs)
    planned: dict[str, Any] = {
        "planned_step_catalog_s": catalog.step_time_s,
        "planned_memory_bytes": catalog.memory_per_chip_bytes.total,
        "planned_checkpoint_write_s": catalog.checkpoint_write_s,
    }
    if profile_path is None:
        return planned | {"planned_step_calibrated_s": None, "calibrated_plan_error": "no profile"}
    try:
        profile = load_profile(get_chip(job.hardware.chip), profile_path)
    except ValueError as exc:
        return planned | {"planned_step_calibrated_s": None, "calibrated_plan_error": str(exc)}
    return planned | {"planned_step_calibrated_s": make_plan(*inputs, profile=profile).step_time_s}


def bench_row(row: Row, host: Host, work: Path, budget: Budget, profile: Path | None, raw: dict) -> dict:
    """One row, or the reason it was skipped; a failure is recorded, never raised."""
    record: dict[str, Any] = {"row": row.name}
    devices = row_devices(row, host)
    reason = devices if isinstance(devices, str) else skip_reason(row, host)
    reason = reason or budget.refuse(row.need_s if not host.dry_run else 30.0)
    if reason:
        return record | {"skipped": reason}
    assert isinstance(devices, int)
    row_dir = work / row.name
    try:
        run = Run.open(TrainingSpec.model_validate(spec_for(row, host, devices)), RunDir(row_dir / "run"))
        record |= {"description": row.description(), "devices": devices, **plans(run.job, profile)}
        record["trainer"] = run_trainer(run, budget, host.steps[1])
        shutil.rmtree(run.checkpoint_url, ignore_errors=True)  # the disk holds one row's checkpoints
        if devices == 1:
            checkpoint_s = (
                3 * record["trainer"]["checkpoint_bytes"] / max(raw.get("write_gbps", 0.1), 0.1) / 1e9
            )
            checkpoint = budget.refuse(row.need_s / 2 + checkpoint_s) is None
            record["baseline"] = run_baseline(run.job, row_dir, budget, host.steps, checkpoint)
        else:
            record["baseline"] = {
                "skipped": "the hand-written loop is single-device: compare per GPU with 1b-eager"
            }
    except (RuntimeError, OutOfTime, subprocess.TimeoutExpired) as exc:
        record["failed"] = f"{type(exc).__name__}: {exc}"[-3000:]
    finally:
        shutil.rmtree(row_dir, ignore_errors=True)
    return record | ratios(record, raw)


def ratios(record: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """The row's comparisons: planned ÷ measured step, trainer ÷ hand-written loop, save ÷ raw disk."""
    trainer, baseline = record.get("trainer"), record.get("baseline") or {}
    if not trainer:
        return {}
    step = trainer["step_time_s"]
    out: dict[str, Any] = {"planned_over_measured_catalog": record["planned_step_catalog_s"] / step}
    if record.get("planned_step_calibrated_s"):
        out["planned_over_measured_calibrated"] = record["planned_step_calibrated_s"] / step
    if "step_time_s" in baseline:
        out["trainer_over_loop_tokens_per_s"] = baseline["step_time_s"] / step
    out["peak_memory_over_planned"] = trainer["peak_memory_bytes"] / record["planned_memory_bytes"]
    if "save_gbps" in baseline and raw.get("write_gbps"):
        out["save_over_raw_write"] = baseline["save_gbps"] / raw["write_gbps"]
        out["load_over_raw_read"] = baseline["load_gbps"] / raw["read_gbps"]
    return out


def calibrate_device(host: Host, out: Path, work: Path, budget: Budget) -> dict[str, Any]:
    """``tessera calibrate``'s measurement (the library call the CLI makes) of device 0 and the
    checkpoint disk, or why it was skipped."""
    from trainer.plan.calibrate import calibrate

    reason = budget.refuse(CALIBRATE_NEED_S)
    if reason:
        return {"skipped": reason}
    began = time.monotonic()
    device = torch.device("cpu") if host.dry_run else torch.device("cuda", 0)
    profile = calibrate(out, host.devices, device, host.chip, quick=host.dry_run, checkpoint_dir=work)
    if host.accelerator == "gpu":
        torch.cuda.empty_cache()  # the rows' processes need the device's memory
    return {"path": str(out), "seconds": time.monotonic() - began, **profile}


def run(
    out_dir: Path, work_dir: Path, dry_run: bool, deadline_s: float, only: list[str] | None, chip: str | None
) -> dict[str, Any]:
    budget = Budget(deadline_s)
    name = "gpu-dry-run" if dry_run else "gpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    host = detect_host(dry_run, chip)
    work = work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    profile_path = out_dir / f"{name}-profile.json"
    calibration = calibrate_device(host, profile_path, work, budget)
    # calibration measured the same directory's disk; measure it here only where it was skipped
    raw = calibration.get("checkpoint_disk") or raw_disk_speed(work, DRY_RAW_BYTES if dry_run else RAW_BYTES)
    rows = []
    for row in ROWS:
        if only and row.name not in only:
            rows.append({"row": row.name, "skipped": "not selected (--rows)"})
            continue
        rows.append(bench_row(row, host, work, budget, profile_path if profile_path.exists() else None, raw))
        print(json.dumps(rows[-1]), flush=True)
    results = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {
            "accelerator": host.accelerator,
            "chip": host.chip,
            "devices": host.devices,
            "device_name": torch.cuda.get_device_name() if host.accelerator == "gpu" else "cpu",
            "torch": torch.__version__,
            "dry_run": dry_run,
        },
        "deadline_s": deadline_s,
        "wall_s": time.monotonic() - budget.started,
        "steps": host.steps[0],
        "warmup_steps": host.steps[1],
        "calibration": {k: v for k, v in calibration.items() if k != "gemm_grid"},
        "raw_disk": raw,
        "rows": rows,
    }
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(markdown(results))
    return results


def _fmt(value: Any, scale: float = 1.0, digits: int = 3) -> str:
    return "—" if value is None else f"{value * scale:.{digits}g}"


def markdown(results: dict[str, Any]) -> str:
    host, raw = results["host"], results["raw_disk"]
    lines = [
        f"# bench-gpu{' (dry run)' if host['dry_run'] else ''}",
        "",
        f"{host['devices']} × {host['device_name']} (`{host['chip']}`) · torch {host['torch']} · "
        f"{results['date']} · {results['wall_s']:.0f} s of a {results['deadline_s']:.0f} s deadline · "
        f"median of steps {results['warmup_steps'] + 1}–{results['steps']}",
        "",
        f"Raw disk: write {_fmt(raw.get('write_gbps'))} GB/s (fsync), read {_fmt(raw.get('read_gbps'))} GB/s "
        f"(page cache dropped), {raw.get('bytes', 0) / 2**30:.2f} GiB. Calibration: "
        f"{results['calibration'].get('skipped') or str(round(results['calibration']['seconds'])) + ' s'}.",
        "",
        "| row | tokens/s | MFU | trainer ÷ loop | planned ÷ measured (catalog) | (calibrated) | first step s"
        " | compile s | final save s | save GB/s (÷ raw) | load GB/s (÷ raw) | peak mem GiB (÷ planned) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        if "trainer" not in row:
            lines.append(
                f"| {row['row']} | {row.get('skipped') or row.get('failed', '')[:200]} |" + " |" * 11
            )
            continue
        t, b = row["trainer"], row.get("baseline") or {}
        lines.append(
            " | ".join(
                [
                    f"| {row['row']}",
                    f"{t['tokens_per_s']:.4g}",
                    f"{t['mfu']:.1%}",
                    _fmt(row.get("trainer_over_loop_tokens_per_s")),
                    _fmt(row.get("planned_over_measured_catalog")),
                    _fmt(row.get("planned_over_measured_calibrated")),
                    f"{t['time_to_first_step_s']:.1f}",
                    f"{t['compile_s']:.1f}",
                    f"{t['final_save_s']:.1f}",
                    f"{_fmt(b.get('save_gbps'))} ({_fmt(row.get('save_over_raw_write'))})",
                    f"{_fmt(b.get('load_gbps'))} ({_fmt(row.get('load_over_raw_read'))})",
                    f"{t['peak_memory_bytes'] / 2**30:.1f} ({_fmt(row.get('peak_memory_over_planned'))})",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def baseline_worker(job_json: Path, out: Path, steps: int, warmup: int, checkpoint_dir: Path | None) -> None:
    """The hand-written loop: what one would write by hand over the trainer's model class, timed per
    step (synchronised), then a checkpoint save and load of its state through the trainer's manager."""
    import torch.nn.functional as F

    from trainer.models.llama.model import Transformer
    from trainer.parallel.compile import apply_compile
    from trainer.parallel.float8 import apply_float8
    from trainer.rank.telemetry import peak_memory_bytes

    job = JobConfig.model_validate_json(job_json.read_text())
    device = torch.device("cuda" if job.hardware.accelerator == "gpu" else "cpu")
    with torch.device(device):
        model = Transformer(job.model, max_seq_len=job.train.seq_len)
    model.init_weights(job.seed)
    apply_float8(model, job.parallel.float8)
    if job.parallel.compile:
        apply_compile(model)
    opt = job.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        fused=device.type == "cuda",
    )
    micro, accum = job.train.micro_batch_size, job.train.global_batch_size // job.train.micro_batch_size
    tokens = torch.randint(0, job.model.vocab_size, (accum, micro, job.train.seq_len + 1), device=device)
    autocast = job.parallel.mixed_precision == "bf16"

    def train_step() -> None:
        for i in range(accum):
            x, y = tokens[i, :, :-1], tokens[i, :, 1:]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timer = HostTimer(device)  # a step as the trainer's clock sees it: the queue drained at both ends
    times = [timer.seconds(train_step, 1) for _ in range(steps)]
    step = statistics.median(times[warmup:] or times)
    result: dict[str, Any] = {
        "step_time_s": step,
        "tokens_per_s": job.train.global_batch_size * job.train.seq_len / step,
        "peak_memory_bytes": peak_memory_bytes(device),
    }
    if checkpoint_dir is not None:
        result |= checkpoint_speed(model, optimizer, checkpoint_dir, timer)
    out.write_text(json.dumps(result))


def checkpoint_speed(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, timer: HostTimer
) -> dict[str, float]:
    """Save then load the model and optimizer through ``CheckpointManager`` as the trainer configures
    it (its writer, the commit's hashes), with the files' pages dropped from the page cache before the
    load so that it reads the disk."""
    from trainer.checkpoint import CheckpointManager, ModelOptimizerState
    from trainer.config import CheckpointConfig

    state = {"app": ModelOptimizerState([model], [optimizer])}
    manager = CheckpointManager(
        str(directory), CheckpointConfig(mode="sync", keep_last=1), 1, "bench", 1, 0, {}
    )
    saved = timer.seconds(lambda: manager.maybe_save(1, state, {"tokens": 0}, force=True), 1)
    files = [f for f in directory.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    for path in files:
        drop_cached(path)
    loaded = timer.seconds(lambda: manager.restore(state), 1)
    manager.close()
    return {
        "checkpoint_bytes": size,
        "checkpoint_files": len(files),
        "save_s": saved,
        "save_gbps": size / saved / 1e9,
        "load_s": loaded,
        "load_gbps": size / loaded / 1e9,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gpu", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on CPU processes: the same code path"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where gpu.json and gpu.md go")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=WORK_DIR,
        help="where the runs and their checkpoints go, and whose disk is measured (each row's removed after it)",
    )
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="global deadline (seconds)")
    parser.add_argument("--rows", help=f"comma-separated subset of: {', '.join(r.name for r in ROWS)}")
    parser.add_argument(
        "--chip", help="the catalog's chip for this GPU, where calibration does not recognise it"
    )
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.rows.split(",")] if args.rows else None
    unknown = sorted(set(only or []) - {row.name for row in ROWS})
    if unknown:
        parser.error(f"--rows: unknown row(s) {', '.join(unknown)}")
    results = run(args.out, args.work_dir, args.dry_run, args.deadline_s, only, args.chip)
    print(markdown(results))


def _worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job_json", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--checkpoint-dir", type=Path)
    args = parser.parse_args(argv)
    baseline_worker(args.job_json, args.out, args.steps, args.warmup, args.checkpoint_dir)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--baseline-worker"]:
        _worker_main(sys.argv[2:])
    else:
        main()
