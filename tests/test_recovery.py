"""Two-tier recovery: real ``kill -9`` of one rank, restored from host memory, not from storage.

One launch: one torchrun agent on 127.0.0.1 with two ranks that the spec places on two "nodes"
(``chips_per_node: 1``), so each rank's peer copy is the other's; ``--max-restarts=2``; snapshots to
host memory every step, to storage every 4 steps; warm restarts (``faults.warm_restart``): the
restarted ranks are forked by a fork server that imported torch and the trainer once.

1. rank 1 is SIGKILLed after step 6: torchrun restarts both ranks, and each restores from its own
   host's memory (the files in ``/dev/shm`` outlived the processes): at most one step lost.
2. after step 9, rank 1 is stopped, its own snapshots deleted (its host's memory lost) and it is
   SIGKILLed: on the restart rank 1 restores from the copy rank 0's host holds.
3. the third attempt finishes, then trains the same job uninterrupted in the same processes
   (``tests/dist/fault_finish.py``): the two loss curves must be equal bitwise, and the host memory of
   both runs is freed.

Each recovery records a row of the reliability report (tests/fault_report.py), with the time from the
kill to training resumed (issue #17's goal: 3 s; measured, not asserted). The agent's output, each line
with its time, is kept in ``agent.log`` next to the run for the timeline of a restart. The rest runs
without torchrun: the choice of step and tier.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deployments.spec import TrainingSpec
from tests.fault_report import FaultRow, record
from tests.test_faults import FINISH, Agent, curve, last_step, wait_for_line
from tests.test_faults import SPEC as FAULTS_SPEC
from trainer.checkpoint.ram_tier import Inventory, memory_directory, newest_common_step
from trainer.config import CheckpointConfig, HardwareConfig, JobConfig, ModelConfig
from trainer.job import resolve_job
from trainer.plan import plan_for_job
from trainer.rundir import RunDir
from trainer.runtime.agents import agent_workers, start_agent, worker_pid
from trainer.runtime.fork_server import ForkServer
from trainer.runtime.launch import launch_env, torchrun_command

pytestmark = pytest.mark.cold  # warm restarts use the per-run fork server; ranks found by parentage

WAIT_S = 240.0
MEMORY_INTERVAL = 1
# The fault tests' two-"node" job, with snapshots to host memory every step and restarts allowed.
SPEC: dict[str, Any] = {
    **FAULTS_SPEC,
    "name": "recovery",
    "seed": 7,
    "checkpoint": {"interval": 4, "mode": "sync", "memory_interval": MEMORY_INTERVAL},
    "faults": {"max_restarts": 2, "step_timeout_s": 60, "collective_timeout_s": 30, "warm_restart": True},
}
RESUMED_GOAL_S = 3.0  # kill -9 → training resumed from memory, for a tiny model on CPU (issue #17)
# Rank 1 is slowed a little in every attempt: a window to kill it between steps on a busy box.
SLOW = {"TESSERA_FAULT_SLOW_RANK": "1", "TESSERA_FAULT_SLOW_S": "0.3"}


@dataclass
class Recovery:
    steps_lost: int
    resumed_s: float  # kill -9 → the restarted ranks logged "resumed from step"
    resumed_line: str


@dataclass
class Scenario:
    run_dir: Path
    reference_dir: Path
    memory_dirs: list[Path]
    own: Recovery
    peer: Recovery
    log: str
    returncode: int


def rank_pid(agent: Agent, rank: int) -> int:
    """The pid of the process training as ``rank``: torchrun's worker has RANK in its environment,
    and with warm restarts it stands in for the process the fork server forked."""
    for pid in agent_workers(agent.proc.pid):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return worker_pid(pid)
    pytest.fail(f"no worker with RANK={rank} under agent {agent.proc.pid}:\n{agent.log[-3000:]}")


def wait_for_step(agent: Agent, run_dir: Path, step: int) -> int:
    """Wait until the loss curve has reached ``step``; return the last step it shows."""
    deadline = time.monotonic() + WAIT_S
    while (done := last_step(run_dir)) < step:
        if agent.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"step {step} never completed:\n{agent.log[-4000:]}")
        time.sleep(0.02)
    return done


def kill_rank_1(agent: Agent, run_dir: Path, times_resumed: int, lose_memory: Path | None = None) -> Recovery:
    """SIGKILL rank 1 now, first deleting its own snapshots in ``lose_memory`` if given (its host is
    gone), and wait for the restarted ranks' ``times_resumed``-th "resumed from step" line."""
    pid = rank_pid(agent, 1)
    if lose_memory is not None:
        os.kill(pid, signal.SIGSTOP)  # no snapshot may land between the deletion and the kill
        for snapshot in lose_memory.glob("rank-00001.own.*"):
            snapshot.unlink()
    completed = last_step(run_dir)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    agent.lines.append((killed_at, f"tessera test: SIGKILL rank 1 (pid {pid})\n"))
    deadline = time.monotonic() + WAIT_S
    while (
        len(resumes := [(at, line) for at, line in agent.lines if "resumed from step" in line])
        < times_resumed
    ):
        if agent.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no resume after the kill:\n{agent.log[-6000:]}")
        time.sleep(0.02)
    resumed_at, line = resumes[times_resumed - 1]
    resumed = int(re.search(r"resumed from step (\d+)", line)[1])  # type: ignore[index]
    return Recovery(max(0, completed - resumed), resumed_at - killed_at, line)


def record_recovery(scenario: Scenario, recovery: Recovery, fault: str, tier: str) -> None:
    """The recovery's row of the reliability report."""
    same_curve = curve(scenario.run_dir) == curve(scenario.reference_dir)
    goal = "met" if recovery.resumed_s <= RESUMED_GOAL_S else "missed"
    row = FaultRow(
        f"{fault} (restored from {tier}, warm restart; resumed ≤ {RESUMED_GOAL_S:.0f} s goal {goal})",
        "recovered",
        "node_failure",
        None,
        recovery.steps_lost,
        round(recovery.resumed_s, 1),
        same_curve,
        restored_from=tier,
    )
    record(row)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    base = tmp_path_factory.mktemp("recovery")
    run_dir, reference_dir = base / "run", base / "reference"
    job = TrainingSpec.model_validate(SPEC).job_config(data_url=None)
    run_dir.mkdir()
    job_json = RunDir(run_dir).job
    job_json.write_text(resolve_job(job, RunDir(run_dir)).model_dump_json(indent=2))  # as a Run writes it
    memory_dirs = [memory_directory(resolve_job(job, RunDir(d))) for d in (run_dir, reference_dir)]
    entry = [str(FINISH), str(job_json), str(run_dir), str(reference_dir)]
    command = torchrun_command(
        job_json,
        run_dir,
        2,
        max_restarts=2,
        run_id=job.name,
        entry=entry,
        warm_restart=job.faults.warm_restart,
    )
    env = {**launch_env(job), **SLOW}
    server = ForkServer(run_dir, env)  # what run_agents starts for such a command
    agent = Agent(start_agent(command, {**env, **server.env}, RunDir(run_dir)))
    try:
        wait_for_line([agent], "committed checkpoint")  # step 4's: storage has a step, memory a newer one
        wait_for_step(agent, run_dir, 6)
        own = kill_rank_1(agent, run_dir, times_resumed=2)  # both ranks log their resume
        wait_for_step(agent, run_dir, 9)
        peer = kill_rank_1(agent, run_dir, times_resumed=4, lose_memory=memory_dirs[0])
        agent.proc.wait(timeout=WAIT_S)
        agent.reader.join(timeout=5)
        yield Scenario(run_dir, reference_dir, memory_dirs, own, peer, agent.log, agent.proc.returncode)
    finally:
        agent.kill()
        server.stop()
        started = agent.lines[0][0] if agent.lines else 0.0
        lines = sorted(agent.lines)
        (base / "agent.log").write_text("".join(f"+{at - started:8.3f} {line}" for at, line in lines))


@pytest.mark.dist
@pytest.mark.fault
def test_killed_rank_resumes_from_own_host_memory(scenario: Scenario) -> None:
    assert scenario.returncode == 0, scenario.log[-6000:]
    # torchrun restarted the group on a failed worker. The test SIGKILLed rank 1 itself; which exit
    # torchrun names first is a race: with warm restarts the survivor's stand-in, whose collective
    # failed within milliseconds, can report before the killed rank's stand-in mirrors its SIGKILL.
    assert "exitcode" in scenario.log, scenario.log[-6000:]
    assert "(own host memory)" in scenario.own.resumed_line, scenario.log[-6000:]
    assert 0 <= scenario.own.steps_lost <= MEMORY_INTERVAL  # storage alone would lose up to 4
    record_recovery(scenario, scenario.own, "kill -9 of one rank after step 6", "own memory")


@pytest.mark.dist
@pytest.mark.fault
def test_rank_whose_host_memory_is_lost_resumes_from_its_peer(scenario: Scenario) -> None:
    assert "restored step" in scenario.log and "from peer host memory (rank 0's host)" in scenario.log
    assert (
        "(own host memory)" in scenario.peer.resumed_line or "(peer host memory" in scenario.peer.resumed_line
    )
    assert 0 <= scenario.peer.steps_lost <= MEMORY_INTERVAL
    record_recovery(
        scenario, scenario.peer, "host memory lost + kill -9 of one rank after step 9", "peer memory"
    )


@pytest.mark.dist
@pytest.mark.fault
def test_recovered_from_memory_has_the_uninterrupted_curve_and_frees_the_memory(scenario: Scenario) -> None:
    assert scenario.returncode == 0, scenario.log[-6000:]
    reference = curve(scenario.reference_dir)
    assert [line["step"] for line in reference] == list(range(1, 13))
    assert curve(scenario.run_dir) == reference  # bitwise, across two kills restored from memory
    assert not any(directory.exists() for directory in scenario.memory_dirs)  # freed once stored


# ------------------------------------------------------------------------------- without torchrun


def test_newest_step_every_rank_can_restore_and_from_which_tier() -> None:
    ring = {0: 1, 1: 2, 2: 0}  # each rank's copy is held by the next node's rank

    def holder(rank: int) -> int | None:
        return ring[rank]

    # Rank 2 died before writing step 8 (so sent no copy of it); step 7 is everywhere.
    inventories = [
        Inventory({7: 1, 8: 1}, {7: 1}),
        Inventory({7: 1, 8: 1}, {7: 1, 8: 1}),
        Inventory({7: 1}, {7: 1}),
    ]
    assert newest_common_step(inventories, holder) == 7
    # Rank 1's host is gone (nothing own, nothing held): rank 2 holds its step-8 copy, but rank 0's
    # copy was on rank 1's host; rank 0 still has its own.
    lost = [Inventory({8: 1}, {8: 1}), Inventory(), Inventory({8: 1}, {8: 1})]
    assert newest_common_step(lost, holder) == 8
    # Rank 1 and the holder of its copy (rank 2) both lost: memory cannot restore, storage must.
    assert newest_common_step([Inventory({8: 1}, {8: 1}), Inventory(), Inventory()], holder) is None
    assert newest_common_step([Inventory({8: 1}), Inventory({8: 1})], lambda rank: None) == 8


def test_planner_prices_both_tiers_with_young_daly() -> None:
    model = ModelConfig(preset="llama3-405b")
    hardware = HardwareConfig(accelerator="gpu", chip="h100-sxm", nodes=2048, chips_per_node=8)
    parallel = {"dp_shard": 2048, "tp": 8, "activation_checkpointing": "full"}
    train = {"steps": 1000, "seq_len": 8192, "global_batch_size": 2048, "micro_batch_size": 1}

    def plan(memory_interval: str) -> Any:
        job = JobConfig.model_validate(
            {
                "model": model.model_dump(),
                "hardware": hardware.model_dump(),
                "parallel": parallel,
                "train": train,
                "checkpoint": CheckpointConfig(memory_interval=memory_interval).model_dump(),
            }
        )
        return plan_for_job(job), resolve_job(job, RunDir(Path("/tmp/unused")))

    storage_only, storage_job = plan("off")
    tiered, tiered_job = plan("auto")
    assert storage_job.memory_interval_steps is None
    # The in-memory copy blocks no longer than an async save's staging, needs no write to finish and
    # covers every failure: it runs far more often; storage then only covers the failures that lose
    # both copies, so it runs less often than without the memory tier.
    assert tiered.memory_blocking_s <= tiered.checkpoint_blocking_s
    assert tiered_job.memory_interval_steps == tiered.memory_interval_steps < tiered.checkpoint_interval_steps
    assert tiered.memory_interval_steps * tiered.step_time_s >= tiered.peer_send_s  # one send in flight
    assert tiered.storage_mtbf_hours > tiered.mtbf_hours == storage_only.storage_mtbf_hours
    assert tiered.checkpoint_interval_steps > storage_only.checkpoint_interval_steps
