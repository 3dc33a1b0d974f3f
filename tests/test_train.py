"""The training loop and its launch path: real torchrun over gloo, three launches in all.

1. a Run's torchrun agent (what ``tessera train`` runs), 4 processes: rank 0 hangs at step 6 → the watchdog
   exits 4 → classified a node failure; the step-4 checkpoint was committed by 4 ranks.
2. ``tests/dist/train_scenarios.py``, 2 processes: two identical runs (determinism), resuming the
   4-process checkpoint on 2 processes (resharding), and the bad inputs.
3. ``tessera train``, 2 processes: the last rank is SIGKILLed at step 6, torchrun restarts the group,
   it resumes from step 4, and the curve equals the uninterrupted one bitwise.
The rest runs without torchrun: schedule, metrics file, exit classification, commands, watchdog.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.run import Run
from deployments.spec import TrainingSpec
from tests.fault_report import FaultRow, record, seconds_between
from tests.pipeline_specs import MICRO_MODEL
from tests.torchrun import run_torchrun
from trainer.checkpoint import list_checkpoints
from trainer.config import JobConfig, OptimizerConfig
from trainer.failures import EXIT_HANG, EXIT_INFRA, classify_exit, worker_exit_code
from trainer.metrics import MetricsWriter, read_metrics
from trainer.rank.optim import build_optimizer, build_scheduler, lr_factor
from trainer.report.goodput import account_run
from trainer.rundir import RunDir
from trainer.runtime.launch import LaunchResult, launch_env, torchrun_command

REPO = Path(__file__).resolve().parents[1]
LOGS = Path(__file__).parent / "data" / "torchrun_logs"
TIMEOUT_S = 300
CURVE_KEYS = ("step", "loss", "lr", "grad_norm", "tokens")  # everything but wall-clock timings

SPEC: dict[str, Any] = {
    "name": "train-test",
    "seed": 3,
    "model": MICRO_MODEL,
    "data": {"loader_workers": 0},
    "train": {"steps": 8, "seq_len": 16, "global_batch_size": 8, "micro_batch_size": 2},
    "parallel": {"dp_shard": 2},
    "cluster": {"chips_per_node": 2},
    "optimizer": {"lr": 1e-2, "warmup_steps": 2},
    "checkpoint": {"interval": 4},
    "faults": {"max_restarts": 0, "step_timeout_s": 60},
}


def spec_with(**sections: dict[str, Any]) -> dict[str, Any]:
    return {**SPEC, **{name: {**SPEC.get(name, {}), **values} for name, values in sections.items()}}


def job_of(spec: dict[str, Any]) -> JobConfig:
    return TrainingSpec.model_validate(spec).job_config(data_url=None)


def launch(spec: dict[str, Any], run_dir: Path) -> LaunchResult:
    """What ``tessera train SPEC --run-dir RUN_DIR`` does, in this process."""
    run = Run.open(TrainingSpec.model_validate(spec), RunDir(run_dir))
    return run.launch_local()


def tessera_train(spec: dict[str, Any], run_dir: Path, faults: dict[str, str]) -> tuple[int, str]:
    """``tessera train`` of ``spec`` into ``run_dir`` with the ``TESSERA_FAULT_*`` hooks in ``faults``:
    its exit code and everything it printed."""
    spec_file = run_dir.with_suffix(".yaml")
    spec_file.write_text(yaml.safe_dump(spec))
    done = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "train", str(spec_file), "--run-dir", str(run_dir)],
        cwd=REPO,
        env={**launch_env(job_of(spec)), **faults},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return done.returncode, done.stdout + done.stderr


def lost_a_rank_to_sigkill(output: str) -> bool:
    """Whether a rank of the launch's failed attempt killed itself with SIGKILL, by torchrun's log.

    torchrun logs one failure per failed attempt: the earliest by whole-second timestamp, then the
    lowest rank. When the killed rank's peer sees its connection close and exits ``EXIT_INFRA`` before
    torchrun's next poll, that line names the peer's echo, not the ``-9`` (a quiet two-worker run of
    the suite met it once); ``trainer.failures.worker_exit_code`` reads past the echo the same way.
    """
    if "injected fault: SIGKILL rank" not in output:
        return False
    echo = f"failed (exitcode: {EXIT_INFRA})" in output and "infrastructure failure, retryable" in output
    return "failed (exitcode: -9)" in output or echo


def steps_redone(output: str, completed: int) -> int:
    """Steps completed before the fault that the resumed attempt had to train again."""
    resumed = re.search(r"resumed from step (\d+)", output)
    assert resumed, "no resume logged"
    return completed - int(resumed[1])


def curve(run_dir: Path) -> list[dict[str, Any]]:
    return [{key: line[key] for key in CURVE_KEYS} for line in read_metrics(run_dir / "metrics.jsonl")]


# ---------------------------------------------------------------------------------------- launches


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LaunchResult]:
    base = tmp_path_factory.mktemp("train")
    # Sync checkpoints here and in the crash test: the step-4 checkpoint must be committed before the
    # fault at step 6 however slow a loaded CI box is (the async path is covered by runs a and b).
    spec = spec_with(
        parallel={"dp_shard": 4},
        cluster={"chips_per_node": 4},
        checkpoint={"mode": "sync"},
        faults={"step_timeout_s": 10},
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TESSERA_FAULT_HANG_AT_STEP", "6")
        return base, launch(spec, base / "from4")


@pytest.fixture(scope="module")
def scenarios(hung_run: tuple[Path, LaunchResult]) -> tuple[Path, dict[str, str | None]]:
    base, _ = hung_run
    job = job_of(SPEC)
    job_json, result_json = base / "job.json", base / "scenarios.json"
    job_json.write_text(job.model_dump_json())
    run_torchrun(
        [str(REPO / "tests" / "dist" / "train_scenarios.py"), str(job_json), str(base), str(result_json)],
        nproc=2,
        env=launch_env(job),
        timeout_s=TIMEOUT_S,
    )
    return base, json.loads(result_json.read_text())


@pytest.mark.dist
@pytest.mark.fault
def test_watchdog_turns_a_hang_into_a_node_failure(hung_run: tuple[Path, LaunchResult]) -> None:
    base, result = hung_run
    assert result.returncode == 1 and result.worker_exit_code == EXIT_HANG, result.log_tail
    assert result.kind == "node_failure"
    assert "step 6 hung: no progress for" in result.log_tail
    assert "(faults.step_timeout_s=10s, or 10x the slowest step so far" in result.log_tail
    (manifest,) = list_checkpoints(str(base / "from4" / "checkpoints"))
    assert (manifest.step, manifest.world_size, manifest.status) == (4, 4, "committed")


@pytest.mark.dist
def test_same_job_same_curve_and_checkpoints(scenarios: tuple[Path, dict[str, str | None]]) -> None:
    base, _ = scenarios
    first, second = curve(base / "a"), curve(base / "b")
    assert [line["step"] for line in first] == list(range(1, 9))
    assert first == second  # bitwise: floats compared exactly
    losses = [line["loss"] for line in first]
    assert losses[0] == pytest.approx(math.log(256), abs=1.0)  # starts near uniform over the vocab
    assert sum(losses[-2:]) < sum(losses[:2])  # and learns the synthetic sequences
    manifests = list_checkpoints(str(base / "a" / "checkpoints"))
    assert [(m.step, m.status, m.tokens) for m in manifests] == [
        (4, "committed", 4 * 128),
        (8, "committed", 8 * 128),
    ]
    status = json.loads((base / "a" / "status.json").read_text())
    assert status["state"] == "completed" and status["final_step"] == 8
    assert status["final_checkpoint"] == manifests[-1].url and status["resumed_from"] is None
    metrics = read_metrics(base / "a" / "metrics.jsonl")[-1]
    assert metrics["tokens_per_s"] > 0 and 0 < metrics["mfu"] < 1
    phases = [metrics[f"{p}_s"] for p in ("data", "telemetry", "forward_backward", "clip", "optimizer")]
    assert all(t >= 0 for t in phases) and sum(phases) <= metrics["step_time_s"]  # the step, by phase


@pytest.mark.dist
def test_checkpoint_from_4_processes_resumes_on_2(scenarios: tuple[Path, dict[str, str | None]]) -> None:
    base, _ = scenarios
    resumed, reference = curve(base / "from4"), curve(base / "a")
    # Lines 5.. of the hung attempt were dropped on resume: one line per step, no duplicates.
    assert [line["step"] for line in resumed] == list(range(1, 9))
    for got, want in zip(resumed, reference, strict=True):  # other layout: same math, other sum order
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)
        assert got["lr"] == pytest.approx(want["lr"])
    final = list_checkpoints(str(base / "from4" / "checkpoints"))[-1]
    assert (final.step, final.world_size) == (8, 2)
    assert json.loads((base / "from4" / "status.json").read_text())["resumed_from"] == 4


@pytest.mark.dist
def test_bad_inputs_fail_with_one_message_and_keep_checkpoints(
    scenarios: tuple[Path, dict[str, str | None]],
) -> None:
    base, errors = scenarios
    assert errors["nan"] is not None and errors["nan"].startswith("loss is nan at step 5; lower optimizer.lr")
    assert errors["other_model"] is not None and "restore the original model config" in errors["other_model"]
    assert errors["world_size"] is not None and "torchrun started 2 processes" in errors["world_size"]
    assert (
        errors["checkpoint_url"] is not None
        and "'nosuch://bucket/ckpt' is not usable" in errors["checkpoint_url"]
    )
    # The NaN run keeps its last good checkpoint and curve; the mismatched model left run a alone.
    assert [m.step for m in list_checkpoints(str(base / "nan" / "checkpoints"))] == [4]
    assert curve(base / "nan") == curve(base / "a")[:4]
    assert [m.step for m in list_checkpoints(str(base / "a" / "checkpoints"))] == [4, 8]
    assert curve(base / "a") == curve(base / "b")
    assert not (base / "four").exists() and not (base / "unusable").exists()


@pytest.mark.dist
@pytest.mark.fault
@pytest.mark.cold  # the killed rank is torchrun's own child; forked, a peer's echo is logged first more often
def test_crash_restart_resume_matches_uninterrupted_curve(
    scenarios: tuple[Path, dict[str, str | None]],
    tmp_path: Path,
) -> None:
    base, _ = scenarios
    run_dir = tmp_path / "run"
    returncode, output = tessera_train(
        spec_with(checkpoint={"mode": "sync"}, faults={"max_restarts": 1}),
        run_dir,
        {"TESSERA_FAULT_CRASH_AT_STEP": "6"},
    )
    assert returncode == 0, output[-4000:]
    assert lost_a_rank_to_sigkill(output)  # the first attempt really lost a rank
    assert "resumed from step 4" in output
    assert curve(run_dir) == curve(base / "a")  # bitwise, across the crash
    assert json.loads((run_dir / "status.json").read_text())["resumed_from"] == 4
    # Where the run's wall time went: step 5 was trained twice, the kill cost one restart.
    goodput = account_run(RunDir(run_dir).goodput, RunDir(run_dir).metrics)
    assert (goodput.restarts, goodput.steps_lost, goodput.steps_kept) == (1, 1, 8)
    assert all(goodput.seconds[k] > 0 for k in ("productive", "startup", "restart", "recomputed"))
    assert sum(goodput.seconds.values()) == pytest.approx(goodput.wall_s)
    job = json.loads((run_dir / "job.json").read_text())
    assert (job["name"], job["run_id"]) == ("train-test", "run")  # tessera train's run is its --run-dir
    record(
        FaultRow(
            "kill -9 of one rank at step 6 (torchrun restarts the group)",
            "recovered",
            "node_failure",
            None,
            steps_redone(output, completed=5),
            seconds_between(output, "injected fault", "resumed from step"),
            True,
            restored_from="storage",
        )
    )


@pytest.mark.dist
@pytest.mark.fault
@pytest.mark.cold  # the killed rank is torchrun's own child; forked, a peer's echo is logged first more often
def test_death_in_an_async_save_then_a_nan_that_torchrun_does_not_restart(
    scenarios: tuple[Path, dict[str, str | None]],
    tmp_path: Path,
) -> None:
    """Attempt 0 dies inside step 4's async checkpoint write; attempt 1 resumes from step 2 (never the
    partial), rewrites step 4, then hits a NaN at step 6; attempt 2 refuses to repeat a user error."""
    base, _ = scenarios
    run_dir = tmp_path / "run"
    returncode, output = tessera_train(
        spec_with(checkpoint={"interval": 2, "mode": "async"}, faults={"max_restarts": 2}),
        run_dir,
        {"TESSERA_FAULT_KILL_IN_SAVE_AT_STEP": "4", "TESSERA_FAULT_NAN_AT_STEP": "6"},
    )
    assert returncode == 3, output[-4000:]  # the user error's code, not a crash
    assert lost_a_rank_to_sigkill(output)  # attempt 0 really lost a rank mid-save
    assert "resumed from step 2" in output and "resumed from step 4" not in output
    assert "loss is nan at step 6" in output
    assert "attempt 1 failed with a user error, not retrying it: loss is nan at step 6" in output
    manifests = list_checkpoints(str(run_dir / "checkpoints"))
    assert [(m.step, m.status) for m in manifests] == [(2, "committed"), (4, "committed")]
    assert curve(run_dir) == curve(base / "a")[:5]  # bitwise, across the death mid-save
    record(
        FaultRow(
            "kill -9 inside an async checkpoint write (step 4)",
            "recovered",
            "node_failure",
            None,
            steps_redone(output, completed=4),  # steps 3 and 4: one checkpoint interval
            seconds_between(output, "injected fault", "resumed from step"),
            True,
        )
    )
    record(
        FaultRow("NaN loss under torchrun restarts", "failed clearly", "user_error", None, None, None, None)
    )


@pytest.mark.dist
@pytest.mark.fault
@pytest.mark.cold  # the killed rank is torchrun's own child; forked, a peer's echo is logged first more often
def test_context_parallel_run_resumes_across_kill_9(
    scenarios: tuple[Path, dict[str, str | None]], tmp_path: Path
) -> None:
    """cp=2 (each rank half of every sequence, ring attention) trains run a's model on a's data; killed
    at step 6 and resumed from step 4, it still follows a's curve. Not bitwise (another reduction order):
    rtol 1e-4, the layout parity tolerance; a wrong resume (data, RNG, optimizer) would be far off."""
    base, _ = scenarios
    run_dir = tmp_path / "cp"
    returncode, output = tessera_train(
        spec_with(parallel={"dp_shard": 1, "cp": 2}, checkpoint={"mode": "sync"}, faults={"max_restarts": 1}),
        run_dir,
        {"TESSERA_FAULT_CRASH_AT_STEP": "6"},
    )
    assert returncode == 0, output[-4000:]
    assert lost_a_rank_to_sigkill(output) and "resumed from step 4" in output
    resumed, reference = curve(run_dir), curve(base / "a")
    assert [(r["step"], r["lr"], r["tokens"]) for r in resumed] == [
        (r["step"], r["lr"], r["tokens"]) for r in reference
    ]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in resumed] == pytest.approx([r[key] for r in reference], rel=1e-4), key


# ------------------------------------------------------------------------------- without torchrun


@pytest.mark.slow
def test_tessera_train_refuses_a_process_count_that_is_not_the_world_size(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tessera.cli",
            "train",
            str(spec),
            "--run-dir",
            str(tmp_path / "run"),
            "--nproc",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "--nproc 3 does not match the spec's world size 2" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("log", "worker_code", "kind"),
    [
        ("worker_exit_3.log", 3, "user_error"),
        ("worker_raised_valueerror.log", 1, "user_error"),
        ("worker_exit_4.log", 4, "node_failure"),
        ("worker_sigkill.log", -9, "node_failure"),
        ("gloo_recv_timeout.log", 1, "node_failure"),
        # The watchdog test under load: rank 3 hung (exit 4); torchrun named rank 2, whose connection
        # to rank 3 closed (exit 5), as the root cause.
        ("hang_root_cause_is_a_peer_echo.log", 4, "node_failure"),
    ],
)
def test_classify_real_torchrun_failures(log: str, worker_code: int, kind: str) -> None:
    """Logs captured from torch 2.13's torchrun (tiny worker scripts; torchrun itself always exits 1)."""
    text = (LOGS / log).read_text()
    assert worker_exit_code(1, text) == worker_code
    assert classify_exit(1, text) == kind


def test_classify_exit_codes_without_torchrun() -> None:
    assert classify_exit(0, "Traceback (most recent call last)") == "ok"
    assert [classify_exit(code, "") for code in (-9, 137, 143, 4)] == ["node_failure"] * 4
    assert classify_exit(3, "") == "user_error"
    assert classify_exit(1, "ValueError: model.dim must be divisible") == "user_error"
    assert (
        classify_exit(1, "torch.distributed.elastic.rendezvous.api.RendezvousClosedError") == "node_failure"
    )


def test_torchrun_command_standalone_and_multi_node(tmp_path: Path) -> None:
    single = torchrun_command(tmp_path / "job.json", tmp_path, 2, max_restarts=1)
    assert "--standalone" in single and "--max-restarts=1" in single
    assert single[-5:] == ["trainer.train", "--job", str(tmp_path / "job.json"), "--run-dir", str(tmp_path)]
    multi = torchrun_command(
        tmp_path / "job.json",
        tmp_path,
        8,
        nnodes=2,
        node_rank=1,
        rdzv_endpoint="127.0.0.1:29400",
        run_id="run-1",
    )
    assert "--standalone" not in multi
    assert {
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400",
        "--rdzv-id=run-1",
    } <= set(multi)


def test_launch_env_adds_backend_settings() -> None:
    env = launch_env(job_of(SPEC), base={"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1",
    }


def test_lr_schedule_warms_up_decays_and_resumes_at_any_step() -> None:
    import torch

    cfg = OptimizerConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_factor(i, 2, 10, 0.1) for i in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(10, 2, 10, 0.1) == pytest.approx(0.1)
    optimizer = build_optimizer(torch.nn.Linear(4, 4), cfg)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.weight_decay, 0.0]  # matrix, bias
    scheduler = build_scheduler(optimizer, cfg, total_steps=10)
    continuous = []
    for _ in range(6):
        continuous.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    resumed = build_optimizer(torch.nn.Linear(4, 4), cfg)
    build_scheduler(resumed, cfg, total_steps=10, steps_done=5)
    assert resumed.param_groups[0]["lr"] == continuous[5]


def test_adamw_is_fused_where_every_parameter_is_on_cuda_and_torchs_default_elsewhere() -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    on_gpu = torch.nn.Module()
    with FakeTensorMode():  # CUDA parameters without a GPU: the optimizer is only built, never stepped
        on_gpu.weight = torch.nn.Parameter(torch.empty(4, 4, device="cuda"))
        on_gpu.bias = torch.nn.Parameter(torch.empty(4, device="cuda"))
    on_cuda = build_optimizer(on_gpu, OptimizerConfig())
    on_cpu = build_optimizer(torch.nn.Linear(4, 4), OptimizerConfig())
    assert on_cuda.defaults["fused"] is True
    assert on_cpu.defaults["fused"] is None and on_cpu.defaults["foreach"] is None


@pytest.mark.slow
def test_the_entry_point_imports_neither_the_compiler_nor_pipelining_until_a_job_needs_them() -> None:
    # torch._dynamo (which torch.distributed.pipelining imports) is 225 of the entry point's 2,300
    # modules, imported before the first step by every run, though only pp and compile use it.
    probe = "import sys, trainer.train; print(sorted({'torch._dynamo', 'torch.distributed.pipelining'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_metrics_writer_drops_steps_after_the_resumed_one(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path, resumed_step=0, enabled=True) as writer:
        for step in range(1, 6):
            writer.write({"step": step, "loss": 1.0})
    with path.open("a") as torn:
        torn.write('{"step": 6, "lo')  # a writer killed mid-line
    with MetricsWriter(path, resumed_step=3, enabled=True) as writer:
        writer.write({"step": 4, "loss": 1.0})
    assert [line["step"] for line in read_metrics(path)] == [1, 2, 3, 4]
    MetricsWriter(tmp_path / "other.jsonl", resumed_step=0, enabled=False).write({"step": 1})
    assert not (tmp_path / "other.jsonl").exists()


def test_watchdog_ends_a_hung_process_with_the_hang_code() -> None:
    code = (
        "import time\nfrom trainer.rank.watchdog import StepWatchdog\nwith StepWatchdog(0.5, rank=1) as w:\n"
        "    w.arm(7)\n    time.sleep(60)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_HANG
    assert "[rank 1] step 7 hung" in done.stderr


@pytest.mark.slow
def test_watchdog_allows_a_multiple_of_the_slowest_step_so_far() -> None:
    """A busier machine slows every step: the first step (a warm-up) gets its own allowance; step 2,
    past the 1 s floor but under ten times step 1, is no hang; step 3, which never ends, still is, after
    ten times the slowest step."""
    code = (
        "import time\nfrom trainer.rank.watchdog import StepWatchdog\n"
        "with StepWatchdog(1.0, rank=0, first_step_s=30) as w:\n"
        "    for step, pause in ((1, 1.2), (2, 1.5), (3, 600)):\n"
        "        w.arm(step)\n        time.sleep(pause)\n        w.disarm()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_HANG
    assert "[rank 0] step 3 hung" in done.stderr, done.stderr
