"""Replica-level fault tolerance (torchft) with real processes: a replica group SIGKILLed mid-run.

HSDP of the micro model: two replica groups, each its own standalone torchrun of two FSDP ranks, one
Lighthouse held here as the launcher holds it. Replica 1's last rank SIGKILLs itself before step
``KILL_AT + 1`` (the fault hook, first attempt only); its torchrun restarts both its ranks. The
survivor trains on alone, then holds before step ``HOLD_AT`` until the restarted replica asks the
Lighthouse for a quorum, so that it is still training when that one is back however slowly a busy
machine restarts it; its next quorum then takes both. What must hold:

* the survivor never stops: it logs every step, it trains steps alone, its stall at the loss is the
  Lighthouse's heartbeat timeout, not a collective timeout waited out, and its processes are the same
  ones throughout (no global restart);
* the restarted replica heals rank by rank from the survivor at a later step instead of starting over,
  from there both log the same loss and grad norm at every step, their final weights (every shard)
  are equal bit for bit, and both finish;
* preserved: up to the kill, the loss curve is an uninterrupted 2-replica run's, bitwise. Not
  preserved: the steps the survivor ran alone averaged only its own rows (``replicas`` is 1 in their
  metrics), so from the kill on the curve differs.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from deployments.run import Run
from deployments.spec import SpecError, TrainingSpec, parse_spec
from tests.fault_report import FaultRow, record
from tests.pipeline_specs import MICRO_MODEL
from trainer.job import resolve_job
from trainer.metrics import read_metrics
from trainer.replicas import LIGHTHOUSE_ENV, replica_job, replica_run_dir
from trainer.rundir import RunDir
from trainer.runtime.agents import agent_workers, start_agent, stop_agent
from trainer.runtime.launch import launch_env
from trainer.runtime.replica_groups import replica_groups
from trainer.train import StepTelemetry

REPO = Path(__file__).resolve().parents[1]
KILL_AT = 4
HOLD_AT = KILL_AT + 3  # the survivor trains two steps alone, then waits for the restarted replica
RANKS = 2  # FSDP ranks in each replica group
STEPS = 24
# faults.collective_timeout_s, generous: in a healthy run it bounds only how late a live peer may be at
# a quorum or collective (the two torchruns' start-up skew, a slow step), which on a 2-core box other
# jobs load reached 6 s and failed healthy runs. A lost replica is noticed by its heartbeat instead.
TIMEOUT_S = 60.0
# The Lighthouse drops a replica silent this long. A live one heartbeats every 100 ms from a native
# thread, so 2 s of silence is a dead one even on a loaded box; a restart (torchrun noticing, Python
# and torch start-up) takes longer, so the survivor trains alone before the replica is back.
HEARTBEAT_S = 2.0
# Each run's whole wall time: start-up of 2 torchruns x 2 ranks took 55 s on a loaded 2-core box.
WAIT_S = 480.0
CURVE_KEYS = ("step", "loss", "lr", "grad_norm", "replicas")

SPEC: dict[str, Any] = {
    "name": "replica-ft",
    "seed": 3,
    "model": MICRO_MODEL,
    "data": {"loader_workers": 0},
    "train": {"steps": STEPS, "seq_len": 16, "global_batch_size": 8, "micro_batch_size": 2, "log_every": 1},
    "parallel": {"dp_replicate": 2, "dp_shard": RANKS, "mixed_precision": "bf16"},
    "cluster": {"nodes": 2, "chips_per_node": RANKS},
    "optimizer": {"lr": 1e-2, "warmup_steps": 2},
    "checkpoint": {"interval": STEPS, "mode": "sync", "keep_last": 1},
    "faults": {
        "max_restarts": 1,
        "collective_timeout_s": TIMEOUT_S,
        "step_timeout_s": WAIT_S,  # the survivor's held step lasts as long as replica 1's restart
        "replica_fault_tolerance": True,
    },
}


@dataclass
class ReplicaRun:
    run_dir: Path
    agents: list[subprocess.Popen[str]] = field(default_factory=list)
    workers: list[list[int]] = field(default_factory=lambda: [[], []])  # each replica's worker pids, in order
    output: list[list[str]] = field(default_factory=lambda: [[], []])
    finished: bool = False  # every agent exited by itself within WAIT_S

    def metrics(self, replica: int) -> list[dict[str, Any]]:
        return read_metrics(replica_run_dir(self.run_dir, replica) / "metrics.jsonl")

    def log(self, replica: int) -> str:
        return "".join(self.output[replica])


def run_replicas(tmp: Path, fault_env: dict[int, dict[str, str]], spec: dict[str, Any] = SPEC) -> ReplicaRun:
    """Both replica groups under one Lighthouse until they exit. ``back``, the file a held survivor
    waits for, appears once the survivor logged step ``HOLD_AT - 1`` (so it holds, asking for no
    quorum) and the Lighthouse has a quorum request: the restarted replica's."""
    job = resolve_job(TrainingSpec.model_validate(spec).job_config(None), RunDir(tmp))
    tmp.mkdir(parents=True, exist_ok=True)
    job_json = RunDir(tmp).job
    job_json.write_text(job.model_dump_json(indent=2))
    env = launch_env(job) | {"OMP_NUM_THREADS": "1"}
    back = back_file(tmp)
    run = ReplicaRun(tmp)
    readers = []
    with replica_groups(job, job_json, tmp, heartbeat_timeout_s=HEARTBEAT_S) as commands:
        lighthouse = next(a.split("=", 1)[1] for a in commands[0] if a.startswith(f"{LIGHTHOUSE_ENV}="))
        try:
            for replica, command in enumerate(commands):
                extra = [f"{k}={v}" for k, v in fault_env.get(replica, {}).items()]  # after `env`
                agent = start_agent([command[0], *extra, *command[1:]], env, RunDir(tmp))
                assert agent.stdout is not None
                reader = threading.Thread(
                    target=run.output[replica].extend, args=(agent.stdout,), daemon=True
                )
                reader.start()
                run.agents.append(agent)
                readers.append(reader)
            deadline = time.monotonic() + WAIT_S
            while any(agent.poll() is None for agent in run.agents) and time.monotonic() < deadline:
                for replica, agent in enumerate(run.agents):
                    workers = run.workers[replica]
                    workers += [pid for pid in agent_workers(agent.pid) if pid not in workers]
                if not back.exists() and held(run) and quorum_requests(lighthouse):
                    back.touch()
                time.sleep(0.05)
            run.finished = all(agent.poll() is not None for agent in run.agents)
        finally:
            for agent, reader in zip(run.agents, readers, strict=True):
                stop_agent(agent)
                reader.join(timeout=5)
    return run


def held(run: ReplicaRun) -> bool:
    metrics = RunDir(run.run_dir).metrics
    return metrics.exists() and any(m["step"] == HOLD_AT - 1 for m in read_metrics(metrics))


def quorum_requests(lighthouse: str) -> int:
    """Replicas waiting in the Lighthouse's next quorum, from its status page."""
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=30) as page:
        waiting = re.search(r"\[(\d+)/\d+ participants healthy\]", page.read().decode())
    return int(waiting[1]) if waiting else 0


def back_file(tmp: Path) -> Path:
    return tmp / "replica-1-is-back"


def run_killing_replica_1(tmp: Path, spec: dict[str, Any] = SPEC) -> ReplicaRun:
    """Replica 1's last rank SIGKILLs itself before step ``KILL_AT + 1``; the survivor holds before
    ``HOLD_AT`` until replica 1 is back; both must finish."""
    hold = {"TESSERA_FAULT_HOLD_AT_STEP": str(HOLD_AT), "TESSERA_FAULT_HOLD_UNTIL": str(back_file(tmp))}
    faults = {0: hold, 1: {"TESSERA_FAULT_CRASH_AT_STEP": str(KILL_AT + 1)}}
    run = run_replicas(tmp, faults, spec)
    assert run.finished, f"the replicas did not finish in {WAIT_S:.0f} s:\n{run.log(1)[-6000:]}"
    for replica, agent in enumerate(run.agents):
        assert agent.returncode == 0, f"replica {replica} failed:\n{run.log(replica)[-6000:]}"
    return run


@pytest.fixture(scope="module")
def faulted(tmp_path_factory: pytest.TempPathFactory) -> ReplicaRun:
    return run_killing_replica_1(tmp_path_factory.mktemp("faulted"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> ReplicaRun:
    """The same job uninterrupted, launched as ``tessera train`` launches it (``Run.launch_local``: the
    run's Lighthouse and one torchrun per replica group)."""
    run = Run.open(TrainingSpec.model_validate(SPEC), RunDir(tmp_path_factory.mktemp("reference")))
    result = run.launch_local()
    assert (result.returncode, result.kind) == (0, "ok"), result.log_tail[-6000:]
    return ReplicaRun(run.dir.path, finished=True)


def curve(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: line[key] for key in CURVE_KEYS} for line in metrics]


def final_state(checkpoint_dir: Path, tmp: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint's model and optimizer tensors (flattened names) and its loader position."""
    out = tmp / f"{checkpoint_dir.parent.name}.pt"
    dcp_to_torch_save(checkpoint_dir, out)
    saved = torch.load(out, weights_only=True)
    app = saved["app"]
    tensors = {f"model.{k}": v for k, v in app["model"].items()} | {
        f"optim.{k}": v for k, v in app["optim"].items()
    }
    return {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}, saved["loader"]


def rejoined_at(faulted: ReplicaRun) -> int:
    """The step the restarted replica healed at: it logged up to the kill, then from the step after."""
    steps = [m["step"] for m in faulted.metrics(1)]
    assert steps[:KILL_AT] == list(range(1, KILL_AT + 1)), steps
    return steps[KILL_AT] - 1


def assert_survived_and_healed(faulted: ReplicaRun, steps: int, tmp: Path) -> tuple[float, int]:
    """The survivor never stopped; replica 1 restarted once, healed at a later step and then agreed
    with it at every step and in every final tensor. Returns the survivor's stall at the loss (the
    gap between its last step with replica 1 and its first without) and the step replica 1 rejoined at."""
    assert len(faulted.workers[0]) == RANKS, "replica 0 was restarted: a global restart"
    assert len(faulted.workers[1]) == 2 * RANKS, "replica 1 was not killed and restarted exactly once"
    survivor = faulted.metrics(0)
    assert [m["step"] for m in survivor] == list(range(1, steps + 1))
    stall = survivor[KILL_AT]["time"] - survivor[KILL_AT - 1]["time"]
    assert stall < TIMEOUT_S, f"the survivor stalled {stall:.1f} s: it waited out a collective timeout"

    rejoin = rejoined_at(faulted)
    assert rejoin > KILL_AT, "the survivor did not train alone before the restarted replica healed"
    assert f"resumed from step {rejoin} (healed from a live replica)" in faulted.log(1)
    healed = faulted.metrics(1)[KILL_AT:]
    assert [m["step"] for m in healed] == list(range(rejoin + 1, steps + 1))
    assert curve(healed) == curve(survivor[rejoin:]), "the replicas disagree after the heal"
    (weights, position), (peer_weights, peer_position) = (
        final_state(RunDir(faulted.run_dir).checkpoints / f"step-{steps:06d}", tmp),
        final_state(Path(f"{RunDir(faulted.run_dir).checkpoints}-replica-1") / f"step-{steps:06d}", tmp),
    )
    assert weights.keys() == peer_weights.keys()
    assert [name for name in weights if not torch.equal(weights[name], peer_weights[name])] == []
    assert position == peer_position, "the healed replica's data position is not the survivor's"
    return stall, rejoin


@pytest.mark.dist
@pytest.mark.fault
def test_survivor_keeps_training_and_the_killed_replica_heals(faulted: ReplicaRun, tmp_path: Path) -> None:
    stall, rejoin = assert_survived_and_healed(faulted, STEPS, tmp_path)
    survivor = faulted.metrics(0)
    kill_to_rejoin = survivor[rejoin]["time"] - survivor[KILL_AT]["time"]
    print(json.dumps({"survivor_stall_s": round(stall, 2), "rejoined_at_step": rejoin}))
    record(
        FaultRow(
            "replica group SIGKILLed (HSDP, torchft)",
            "recovered",
            "replica lost: the other continued",
            round(stall, 1),
            0,
            round(kill_to_rejoin, 1),
            False,  # by design: the steps on one replica trained half the rows (see the next test)
        )
    )


SHORT = 16  # steps: the kill, two alone, the hold for the restart and heal, steps on two replicas again


# Each replica group split another way. The MoE biases its routing from each step's expert loads, by a
# rate large enough that they steer it within the run: replicas stay equal only if they sum those too.
MOE_BIAS = {"n_experts": 4, "top_k": 2, "balance": "bias", "bias_update_rate": 0.05}
SPLITS: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "tp": ({"tp": RANKS}, MICRO_MODEL),
    "pp": ({"pp": RANKS}, MICRO_MODEL),
    "ep": ({"dp_shard": RANKS, "ep": RANKS}, {**MICRO_MODEL, "moe": MOE_BIAS}),
}


@pytest.mark.dist
@pytest.mark.fault
@pytest.mark.parametrize("split", SPLITS)
def test_a_tensor_pipeline_or_expert_parallel_replica_heals_shard_by_shard(
    split: str, tmp_path: Path
) -> None:
    """The same loss and heal with each replica group split by TP (DTensor shards of every projection),
    PP (each rank a stage: its own parameters, the loss on the last one only) or EP (each rank its own
    experts; every final tensor equal includes the routing biases)."""
    parallel, model = SPLITS[split]
    spec = {
        **SPEC,
        "model": model,
        "train": {**SPEC["train"], "steps": SHORT},
        "parallel": {"dp_replicate": 2, **parallel},
        "checkpoint": {**SPEC["checkpoint"], "interval": SHORT},
    }
    faulted = run_killing_replica_1(tmp_path / "run", spec)
    stall, rejoin = assert_survived_and_healed(faulted, SHORT, tmp_path)
    print(json.dumps({"split": split, "survivor_stall_s": round(stall, 2), "rejoined_at_step": rejoin}))


@pytest.mark.dist
@pytest.mark.fault
def test_loss_curve_is_preserved_until_the_kill_and_not_after(
    faulted: ReplicaRun, reference: ReplicaRun
) -> None:
    survivor, uninterrupted = faulted.metrics(0), reference.metrics(0)
    assert curve(survivor[:KILL_AT]) == curve(uninterrupted[:KILL_AT])
    rejoin = rejoined_at(faulted)
    alone = [m["step"] for m in survivor if m["replicas"] == 1]
    assert alone == list(range(KILL_AT + 1, rejoin + 1)), "steps on one replica: exactly kill → rejoin"
    assert all(m["replicas"] == 2 for m in uninterrupted)
    assert survivor[KILL_AT]["loss"] != uninterrupted[KILL_AT]["loss"]
    assert re.search(r"resumed from step", faulted.log(0)) is None, "the survivor restarted"


# How long the next test's lone replica waits for its absent peer. It also bounds that group's own
# collectives, which its two ranks on one host finish in milliseconds.
ALONE_TIMEOUT_S = 15.0


@pytest.mark.dist
@pytest.mark.fault
def test_a_replica_whose_peers_never_come_trains_alone_after_the_collective_timeout(tmp_path: Path) -> None:
    """A fresh run waits up to ``faults.collective_timeout_s`` for every replica group, the ranks of a
    group deciding together when to stop: a rank that gave up alone would leave the others waiting in a
    quorum it never joins. Only replica 0 of two is launched."""
    spec = {
        **SPEC,
        "train": {**SPEC["train"], "steps": 4},
        "checkpoint": {**SPEC["checkpoint"], "interval": 4},
        "faults": {**SPEC["faults"], "collective_timeout_s": ALONE_TIMEOUT_S},
    }
    job = resolve_job(TrainingSpec.model_validate(spec).job_config(None), RunDir(tmp_path))
    job_json = RunDir(tmp_path).job
    job_json.write_text(job.model_dump_json())
    env = launch_env(job) | {"OMP_NUM_THREADS": "1"}
    with replica_groups(job, job_json, tmp_path, heartbeat_timeout_s=HEARTBEAT_S) as commands:
        alone = subprocess.run(commands[0], cwd=REPO, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert alone.returncode == 0, alone.stdout[-6000:] + alone.stderr[-3000:]
    assert [m["replicas"] for m in read_metrics(RunDir(tmp_path).metrics)] == [1, 1, 1, 1]


def test_spec_refuses_replica_fault_tolerance_without_replicas_or_with_cp() -> None:
    spec = {**SPEC, "parallel": {"dp_shard": 2}}
    with pytest.raises(SpecError, match=r"faults.replica_fault_tolerance needs parallel.dp_replicate > 1"):
        parse_spec(spec)
    spec = {
        **SPEC,
        "parallel": {"dp_replicate": 2, "dp_shard": 2, "cp": 2},
        "cluster": {"nodes": 2, "chips_per_node": 4},
    }
    with pytest.raises(SpecError, match=r"supports FSDP, TP, PP and EP inside a replica group.*cp=2"):
        parse_spec(spec)
    elastic = {**SPEC, "faults": {**SPEC["faults"], "min_nodes": 1}}
    with pytest.raises(SpecError, match=r"unset faults.min_nodes"):
        parse_spec(elastic)
    assert TrainingSpec.model_validate(SPEC).faults.replica_fault_tolerance


def test_a_replica_groups_metrics_count_its_share_and_the_replicas_that_took_part(tmp_path: Path) -> None:
    """Each replica group computes half the global batch on its own chips: its MFU is that half against
    its chips' peak, and the run's throughput counts only the replicas a step averaged."""
    job = replica_job(resolve_job(TrainingSpec.model_validate(SPEC).job_config(None), RunDir(tmp_path)), 1)
    cpu = torch.device("cpu")
    alone, share = StepTelemetry(job, cpu, rank=1), StepTelemetry(job, cpu, rank=1, replicas=2)
    whole = alone.record(7, 2.0, 1e-3, 1.0, 0.5, [])
    both, one = (share.record(7, 2.0, 1e-3, 1.0, 0.5, [], participants=n) for n in (2, 1))
    assert both["mfu"] == one["mfu"] == whole["mfu"] / 2
    assert both["tokens_per_s"] == whole["tokens_per_s"] == 2 * one["tokens_per_s"]
    assert (both["replicas"], one["replicas"], "replicas" in whole) == (2, 1, False)
    assert both["tokens"] == whole["tokens"], "tokens: the data position, every global batch's rows"


@pytest.mark.slow
def test_the_lighthouse_pods_entry_point_serves_until_sigterm(tmp_path: Path) -> None:
    """``python -m trainer.runtime.replica_groups``, the Kubernetes Lighthouse pod's command: its status page
    (the pod's readiness probe) answers, and SIGTERM (the pod's deletion) ends it cleanly."""
    job = tmp_path / "job.json"
    job.write_text(TrainingSpec.model_validate(SPEC).job_config(None).model_dump_json())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "trainer.runtime.replica_groups", "--job", str(job), "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        seen = []  # torchft's own log lines (stderr) may come before ours: ours says it is listening
        for line in server.stdout:
            seen.append(line)
            if "Lighthouse for 2 replica groups" in line:
                break
        else:
            pytest.fail(f"the Lighthouse exited before serving:\n{''.join(seen)}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as page:
            assert page.status == 200 and "quorum" in page.read().decode()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=10) == 0
    finally:
        server.kill()
