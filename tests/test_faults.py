"""Faults injected into real torchrun processes with real signals, and what the job makes of them.

One scenario, three launches of two torchrun agents on 127.0.0.1 sharing one c10d rendezvous (two
"nodes", one rank each), all in one run directory:

1. rank 1 is slowed by the straggler hook; once step 2's checkpoint is committed, the second
   agent and its rank are SIGKILLed at once — a lost node. The survivor must fail on its own, fast,
   as a node failure; the telemetry must have named rank 1 the straggler.
2. a relaunch resumes; one rank is SIGSTOPped — a wedged host. The other rank's step watchdog must
   end the attempt within ``faults.step_timeout_s``, as a node failure.
3. a relaunch finishes from the newest good checkpoint, then trains the same job uninterrupted in
   the same processes (``tests/dist/fault_finish.py``): the two loss curves must be equal bitwise.

Each fault records a row of the reliability report (tests/fault_report.py). The rest runs without
torchrun: exit classification of infrastructure errors and the failure history of the train task.
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed

from deployments.kubernetes.render import render_manifests
from deployments.run import Run
from deployments.spec import SPEC_DIR, TrainingSpec, load_spec
from tasks.attempts import record_failure, summary
from tasks.provision import free_port
from tests.fault_report import FaultRow, record
from tests.pipeline_specs import MICRO_MODEL
from trainer.checkpoint import CheckpointStoreError, list_checkpoints
from trainer.config import JobConfig
from trainer.data.errors import DataError
from trainer.data.fetch import decode_shard
from trainer.data.shards import TOKENS_EXT
from trainer.failures import EXIT_HANG, EXIT_INFRA, UserError, classify_exit, is_infra_error
from trainer.job import resolve_job
from trainer.metrics import MetricsWriter, read_metrics
from trainer.rundir import RunDir
from trainer.runtime.agents import agent_workers, kill_agent, start_agent, worker_pid
from trainer.runtime.launch import launch_env, through_shared_fork_server, torchrun_command

REPO = Path(__file__).resolve().parents[1]
FINISH = REPO / "tests" / "dist" / "fault_finish.py"
CURVE_KEYS = ("step", "loss", "lr", "grad_norm", "tokens")
# The watchdog's floor: the hang under test ends after it. A healthy step is ~1 s here (rank 1 slowed),
# and on a busier machine the watchdog allows 10x the slowest step so far (the first step: the
# collective timeout) instead, so the floor can be short without failing a slow, healthy run.
STEP_TIMEOUT_S = 8.0
# Generous: it bounds the workers' start-up rendezvous (two agents' workers importing torch at different
# speeds on a loaded box) and a checkpoint's collectives; the faults here are caught by a closed
# connection and by the watchdog, so its size costs a healthy run nothing.
COLLECTIVE_TIMEOUT_S = 60.0
WAIT_S = 180.0
SLOW_S = "1.0"  # rank 1's extra seconds per step in the faulted attempts: a window for the faults
SECRET = "tessera-test-secret-9f3b"
CREDENTIALS = {"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": SECRET, "HF_TOKEN": SECRET}

SPEC: dict[str, Any] = {
    "name": "faults",
    "seed": 5,
    "model": MICRO_MODEL,
    "data": {"loader_workers": 0},
    "train": {"steps": 12, "seq_len": 16, "global_batch_size": 8, "micro_batch_size": 2},
    "parallel": {"dp_shard": 2},
    "cluster": {"nodes": 2, "chips_per_node": 1},
    "optimizer": {"lr": 1e-2, "warmup_steps": 2},
    "checkpoint": {"interval": 2, "mode": "sync", "keep_last": 3},
    "faults": {
        "max_restarts": 0,
        "step_timeout_s": STEP_TIMEOUT_S,
        "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
    },
}


@dataclass
class Agent:
    """One torchrun agent (its own process group) and its output lines with arrival times."""

    proc: subprocess.Popen[str]
    lines: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    @property
    def log(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, text: str) -> float | None:
        return next((at for at, line in self.lines if text in line), None)

    def worker_pid(self) -> int:
        """The training rank this agent started (one per agent here): with warm restarts, the process
        the fork server forked for torchrun's worker."""
        (pid,) = agent_workers(self.proc.pid)
        return worker_pid(pid)

    def kill(self) -> None:
        """SIGKILL the whole node: the agent and its rank together."""
        if self.proc.poll() is None:
            kill_agent(self.proc.pid)
        self.proc.wait()
        self.reader.join(timeout=5)


def launch(job: JobConfig, run_dir: Path, env: dict[str, str], entry: list[str] | None = None) -> list[Agent]:
    """Two agents, one rank each, in one fresh c10d rendezvous on 127.0.0.1.

    The job file is the job resolved for ``run_dir``, as a Run writes it (fault_finish.py moves its
    reference run's checkpoints to a directory of their own).
    """
    job_json = RunDir(run_dir).job
    run_dir.mkdir(parents=True, exist_ok=True)
    job_json.write_text(resolve_job(job, RunDir(run_dir)).model_dump_json(indent=2))
    endpoint = f"127.0.0.1:{free_port()}"
    commands = [
        torchrun_command(job_json, run_dir, 1, 2, node, endpoint, 0, run_id=job.name, entry=entry)
        for node in range(2)
    ]
    # The session's fork server (tests/warm_workers.py), if any, as run_agents would use it: the faults
    # still reach the ranks themselves (worker_pid, kill_agent).
    commands, env = through_shared_fork_server(commands, env)
    return [Agent(start_agent(command, env, RunDir(run_dir))) for command in commands]


def wait_for_line(agents: list[Agent], text: str, timeout_s: float = WAIT_S) -> float:
    """When the first agent printed a line containing ``text`` (the ranks' logs are the fastest
    signal: polling the checkpoint directory lags seconds behind on a loaded 2-core box)."""
    deadline = time.monotonic() + timeout_s
    while (seen := [at for agent in agents if (at := agent.first(text)) is not None]) == []:
        ended = all(agent.proc.poll() is not None for agent in agents)
        if ended or time.monotonic() > deadline:
            logs = "".join(agent.log[-3000:] for agent in agents)
            pytest.fail(f"no line with {text!r} ({'agents exited' if ended else 'timed out'}):\n{logs}")
        time.sleep(0.02)
    return min(seen)


def newest_good_step(run_dir: Path) -> int:
    good = [m.step for m in list_checkpoints(str(run_dir / "checkpoints")) if m.good]
    return good[-1] if good else 0


def last_step(run_dir: Path) -> int:
    records = read_metrics(run_dir / "metrics.jsonl")
    return records[-1]["step"] if records else 0


def curve(run_dir: Path) -> list[dict[str, Any]]:
    return [{key: line[key] for key in CURVE_KEYS} for line in read_metrics(run_dir / "metrics.jsonl")]


@dataclass
class FaultOutcome:
    kind: str
    worker_log: str
    detected_s: float
    steps_lost: int
    fault_at: float


@dataclass
class Scenario:
    run_dir: Path
    reference_dir: Path
    straggler_metrics: list[dict[str, Any]]
    straggler_log: str
    node_loss: FaultOutcome
    hang: FaultOutcome
    resumed_after_node_loss_s: float
    resumed_after_hang_s: float
    finish_log: str
    finish_code: int
    logs: str  # every line every agent printed, in all three launches


def survivor_outcome(survivor: Agent, fault_at: float, run_dir: Path) -> FaultOutcome:
    """Wait for the surviving agent to end the attempt on its own and classify how it ended."""
    try:
        survivor.proc.wait(timeout=COLLECTIVE_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the surviving agent hung after the fault:\n{survivor.log[-6000:]}")
    detected = time.monotonic() - fault_at
    survivor.reader.join(timeout=5)
    return FaultOutcome(
        classify_exit(survivor.proc.returncode, survivor.log),
        survivor.log,
        detected,
        last_step(run_dir) - newest_good_step(run_dir),
        fault_at,
    )


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    base = tmp_path_factory.mktemp("faults")
    run_dir, reference_dir = base / "run", base / "reference"
    job = TrainingSpec.model_validate(SPEC).job_config(data_url=None)
    env = {**launch_env(job), **CREDENTIALS}  # what a real run inherits from its pod or shell
    # Rank 1 is slow in the faulted attempts: the straggler under test, and a wide window for the faults.
    slowed = {**env, "TESSERA_FAULT_SLOW_RANK": "1", "TESSERA_FAULT_SLOW_S": SLOW_S}
    agents: list[Agent] = []
    launched: list[Agent] = []
    try:
        # 1. a straggler, then a lost node
        agents = launch(job, run_dir, slowed)
        launched += agents
        wait_for_line(agents, "committed checkpoint")  # step 2's: 10 slow steps (10 s) of window remain
        fault_at = time.monotonic()
        agents[1].kill()
        node_loss = survivor_outcome(agents[0], fault_at, run_dir)
        straggler_metrics = read_metrics(run_dir / "metrics.jsonl")
        straggler_log = agents[0].log

        # 2. a wedged host: one rank stopped, not dead
        agents = launch(job, run_dir, slowed)
        launched += agents
        resumed_at = wait_for_line(agents, "resumed from step")
        wait_for_line(agents, "straggler: rank 1")  # a step under way after the resume
        stopped = agents[1].worker_pid()
        os.kill(stopped, signal.SIGSTOP)
        hang = survivor_outcome(agents[0], time.monotonic(), run_dir)
        agents[1].kill()  # what tasks.train.run_local does to the other agents once one has failed

        # 3. finish, then the uninterrupted reference in the same processes
        entry = [str(FINISH), str(run_dir / "job.json"), str(run_dir), str(reference_dir)]
        agents = launch(job, run_dir, env, entry)
        launched += agents
        finish_resumed = wait_for_line(agents, "resumed from step")
        for agent in agents:
            agent.proc.wait(timeout=WAIT_S)
            agent.reader.join(timeout=5)
        yield Scenario(
            run_dir,
            reference_dir,
            straggler_metrics,
            straggler_log,
            node_loss,
            hang,
            resumed_at - fault_at,
            finish_resumed - hang.fault_at,
            "".join(a.log for a in agents),
            max(a.proc.returncode for a in agents),
            "".join(a.log for a in launched),
        )
    finally:
        for agent in agents:
            agent.kill()


def record_recovery(fault: str, outcome: FaultOutcome, resumed_s: float, scenario: Scenario) -> None:
    """One row of the reliability report for a fault the run recovered from (or failed on clearly)."""
    record(
        FaultRow(
            fault,
            "recovered" if scenario.finish_code == 0 else "failed clearly",
            outcome.kind,
            round(outcome.detected_s, 1),
            outcome.steps_lost,
            round(resumed_s, 1),
            curve(scenario.run_dir) == curve(scenario.reference_dir),
        )
    )


@pytest.mark.dist
@pytest.mark.fault
def test_lost_node_fails_the_survivor_fast_as_a_node_failure(scenario: Scenario) -> None:
    outcome = scenario.node_loss
    assert outcome.kind == "node_failure", outcome.worker_log[-4000:]
    # Which surfaces first depends on which agent hosted the c10d store: the rank's closed gloo
    # connection (exit EXIT_INFRA) or the agent's lost rendezvous. Both are node failures.
    assert outcome.detected_s < COLLECTIVE_TIMEOUT_S + 30  # no hang behind the dead peer
    assert 0 <= outcome.steps_lost <= SPEC["checkpoint"]["interval"]
    record_recovery(
        "node lost (kill -9 of one agent and its rank)", outcome, scenario.resumed_after_node_loss_s, scenario
    )


@pytest.mark.dist
@pytest.mark.fault
def test_sigstopped_rank_is_caught_by_the_watchdog_as_a_node_failure(scenario: Scenario) -> None:
    outcome = scenario.hang
    assert outcome.kind == "node_failure", outcome.worker_log[-4000:]
    # The peer's watchdog fires (or, mid-checkpoint, the collective timeout): seconds, not 30 minutes.
    assert (
        f"exitcode  : {EXIT_HANG}" in outcome.worker_log or f"exitcode  : {EXIT_INFRA}" in outcome.worker_log
    )
    assert outcome.detected_s < COLLECTIVE_TIMEOUT_S + 30
    assert 0 <= outcome.steps_lost <= SPEC["checkpoint"]["interval"]
    record_recovery("rank hung (SIGSTOP)", outcome, scenario.resumed_after_hang_s, scenario)


@pytest.mark.dist
@pytest.mark.fault
def test_recovered_run_has_the_uninterrupted_loss_curve(scenario: Scenario) -> None:
    assert scenario.finish_code == 0, scenario.finish_log[-4000:]
    reference = curve(scenario.reference_dir)
    assert [line["step"] for line in reference] == list(range(1, 13))
    assert curve(scenario.run_dir) == reference  # bitwise, across a lost node and a hung rank
    assert newest_good_step(scenario.run_dir) == 12


@pytest.mark.dist
@pytest.mark.fault
def test_straggler_is_named_in_metrics_and_logs(scenario: Scenario) -> None:
    slowed = [line for line in scenario.straggler_metrics if line["step"] >= 2]
    assert slowed and all(line["slowest_rank"] == 1 and line["straggler"] for line in slowed)
    assert all(
        line["host_time_max_s"] >= float(SLOW_S) > line["host_time_others_median_s"] for line in slowed
    )
    assert "straggler: rank 1 spent" in scenario.straggler_log
    record(
        FaultRow(
            f"straggler (rank 1 +{SLOW_S} s/step)",
            "recovered",
            f"named rank {slowed[0]['slowest_rank']} from step {slowed[0]['step']}",
            None,
            0,
            None,
            None,
        )
    )


# ------------------------------------------------------------------------------- without torchrun


def test_infrastructure_errors_are_retryable_and_user_errors_are_not() -> None:
    reset = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    try:
        raise CheckpointStoreError("cannot create checkpoint directory 's3://b/c'") from reset
    except CheckpointStoreError as wrapped:
        assert is_infra_error(wrapped)  # the store dropped the connection: retry
    assert is_infra_error(OSError(errno.EBUSY, "SlowDown"))
    assert is_infra_error(RuntimeError("DataLoader worker (pid 123) is killed by signal: Killed."))
    assert is_infra_error(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    store_timeout = torch.distributed.DistStoreError("wait timeout after 30000ms, keys: /0//cpu//0/1")
    assert is_infra_error(store_timeout)  # e.g. a peer that left mid-rendezvous: retry, not a user error
    assert not is_infra_error(FileNotFoundError("s3://b/c/manifest.json"))
    assert not is_infra_error(CheckpointStoreError("checkpoint URL 'nosuch://b' is not usable"))
    assert not is_infra_error(UserError("loss is nan at step 5; lower optimizer.lr"))
    assert classify_exit(1, f"Root Cause (first observed failure):\n  exitcode  : {EXIT_INFRA}\n===") == (
        "node_failure"
    )


def test_failure_history_sums_steps_lost_and_names_the_last_good_checkpoint(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path / "metrics.jsonl", resumed_step=0, enabled=True) as metrics:
        for step in range(1, 4):
            metrics.write({"step": step, "loss": 1.0})
    record_failure(RunDir(tmp_path), str(tmp_path / "checkpoints"), "node_failure", -9)
    history = record_failure(RunDir(tmp_path), str(tmp_path / "checkpoints"), "node_failure", EXIT_HANG)
    assert [a.exit_code for a in history] == [-9, EXIT_HANG]
    assert summary(history) == (
        "2 failed attempt(s): node_failure (exit -9) at step 3, node_failure (exit 4) at step 3; "
        "6 step(s) lost; last good checkpoint: none"
    )


# ------------------------------------------------------------------------------------ credentials


@pytest.mark.dist
@pytest.mark.fault
def test_credentials_in_the_environment_reach_no_log_or_run_file(scenario: Scenario) -> None:
    """The three launches ran with secrets in their environment, as in a pod; none was written."""
    assert SECRET not in scenario.logs
    for directory in (scenario.run_dir, scenario.reference_dir):
        for path in directory.rglob("*"):
            assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("name", ["gpu-llama3-8b-h100", "tpu-llama3-70b-v5p"])
def test_rendered_manifests_and_specs_carry_no_credentials(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for variable in CREDENTIALS:
        monkeypatch.setenv(variable, SECRET)
    monkeypatch.setenv("TESSERA_RUNS_DIR", str(tmp_path))
    run = Run.open(load_spec(SPEC_DIR / f"{name}.yaml"), data_url="s3://bucket/data/manifest.json")
    rendered = json.dumps(render_manifests(run)) + run.spec.model_dump_json() + run.job.model_dump_json()
    assert SECRET not in rendered


@pytest.mark.fault
def test_unreachable_checkpoint_store_is_one_retryable_line_naming_the_url() -> None:
    """An s3:// URL with no server behind it: not a raw botocore error, and retried as infrastructure."""
    code = (
        "from trainer.checkpoint.commit import list_checkpoints\n"
        "from trainer.failures import is_infra_error\n"
        "try:\n    list_checkpoints('s3://bucket/ckpt')\n"
        "except Exception as error:\n    print(type(error).__name__, is_infra_error(error), error)\n"
    )
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {
        **os.environ,
        **CREDENTIALS,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_ENDPOINT_URL": closed,
        "AWS_MAX_ATTEMPTS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.startswith(
        "CheckpointStoreError True cannot list checkpoints at 's3://bucket/ckpt': EndpointConnectionError"
    ), done.stdout + done.stderr[-2000:]
    record(
        FaultRow(
            "checkpoint store unreachable (s3://, no server)",
            "failed clearly",
            "node_failure",
            None,
            None,
            None,
            None,
        )
    )


# ----------------------------------------------------------------------------- untrusted shards


def test_tar_members_that_escape_are_never_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard from an untrusted bucket is decoded in memory: ``..`` and absolute member names write nothing."""
    sample = np.arange(9, dtype=np.uint16).tobytes()
    escapes = [f"../../escaped.{TOKENS_EXT}", f"{tmp_path}/absolute.{TOKENS_EXT}"]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in escapes:
            member = tarfile.TarInfo(name)
            member.size = len(sample)
            tar.addfile(member, io.BytesIO(sample))
    cache = tmp_path / "cache" / "nested"
    cache.mkdir(parents=True)
    monkeypatch.chdir(cache)
    before = sorted(tmp_path.rglob("*"))
    try:
        rows = decode_shard(buffer.getvalue(), "uint16", 9, "s3://untrusted/shard-000000.tar")
    except DataError:
        rows = None
    assert rows is None or rows.tolist() == [list(range(9))] * len(rows)
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, inside or outside the cache


@pytest.mark.parametrize("shape", ["gzip", "sparse", "oversized"])
def test_a_shard_that_would_expand_is_refused_before_extraction(shape: str) -> None:
    """A hash-matching shard can still be a bomb: compressed, sparse or oversized members are refused unread."""
    sample = np.arange(9, dtype=np.uint16).tobytes()
    buffer = io.BytesIO()
    with tarfile.open(
        fileobj=buffer, mode="w:gz" if shape == "gzip" else "w", format=tarfile.GNU_FORMAT
    ) as tar:
        member = tarfile.TarInfo(f"000000000.{TOKENS_EXT}")
        payload = sample if shape != "oversized" else bytes(1 << 20)
        member.size = len(payload)
        tar.addfile(member, io.BytesIO(payload))
    data = buffer.getvalue()
    if shape == "sparse":  # mark the member GNU-sparse ('S'), as a crafted shard would: its size can be huge
        header = bytearray(data[:512])
        header[156:157] = b"S"
        header[148:156] = b" " * 8
        header[148:155] = f"{sum(header):06o}\0".encode()
        data = bytes(header) + data[512:]
    with pytest.raises(DataError, match="re-run data preparation") as refused:
        decode_shard(data, "uint16", 9, "s3://untrusted/bomb.tar")
    assert ("plain (uncompressed) tar" if shape == "gzip" else "has a member") in str(refused.value)
