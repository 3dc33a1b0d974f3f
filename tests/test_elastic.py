"""Elastic shrink-and-continue with real torchrun agents on 127.0.0.1 (two "nodes", one rank each).

Once step 4 is checkpointed, node 0 (its agent and rank) is SIGKILLed. Node 1 continues alone on
the same global batch (twice the micro-batches); then node 0 is started again (capacity returns),
joins, and the run finishes on both. The curve is compared with an uninterrupted run of the same
job, trained at the same time. The rest checks the spec rules, the layout at each node count and
the launcher's policy without torchrun.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from deployments.run import Run
from deployments.spec import TrainingSpec
from tasks.provision import free_port
from tests.pipeline_specs import MICRO_MODEL
from trainer.checkpoint import list_checkpoints
from trainer.checkpoint.ram_tier import memory_directory
from trainer.checkpoint.resize import discard_other_sizes
from trainer.config import JobConfig
from trainer.elastic import describe_resize, elastic_errors, fit_to_world, micro_batches
from trainer.failures import UserError
from trainer.metrics import read_metrics
from trainer.rundir import RunDir
from trainer.runtime.agents import agent_workers, kill_agent, start_agent, stop_agent
from trainer.runtime.launch import LaunchResult, launch_env, run_agents, torchrun_command

pytestmark = pytest.mark.cold  # lost nodes are agents stopped or killed with their ranks

WAIT_S = 120.0
SPEC: dict[str, Any] = {
    "name": "elastic-test",
    "seed": 5,
    "model": MICRO_MODEL,
    "data": {"loader_workers": 0},
    "train": {"steps": 24, "seq_len": 16, "global_batch_size": 8, "micro_batch_size": 2},
    "parallel": {"dp_shard": 2},
    "cluster": {"nodes": 2, "chips_per_node": 1},
    "optimizer": {"lr": 1e-2, "warmup_steps": 2},
    "checkpoint": {"interval": 2},
    "faults": {
        "max_restarts": 2,
        "min_nodes": 1,
        "replacement_wait_s": 3,
        "step_timeout_s": 60,
        "collective_timeout_s": 30,
    },
}


def spec_with(**sections: dict[str, Any]) -> TrainingSpec:
    return TrainingSpec.model_validate(
        {**SPEC, **{name: {**SPEC.get(name, {}), **values} for name, values in sections.items()}}
    )


class Launch:
    """``Run.launch_local`` of two agents in a thread, as the train task runs them."""

    def __init__(self, run_dir: Path) -> None:
        self.run = Run.open(spec_with(), RunDir(run_dir))
        endpoint = f"127.0.0.1:{free_port()}"
        self.commands = [self.run.torchrun_command(node, endpoint) for node in range(2)]
        self.lines: list[str] = []
        self.result: LaunchResult | None = None
        self.thread = threading.Thread(target=self._launch, daemon=True)
        self.thread.start()

    def _launch(self) -> None:
        self.result = self.run.launch_local(self.commands, echo=self.lines.append)

    def agent_pids(self) -> list[int]:
        record = self.run.dir.agents
        return [int(pid) for pid in record.read_text().split()] if record.exists() else []

    def wait(self, what: str, done: Any) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            if not self.thread.is_alive() or time.monotonic() > deadline:
                pytest.fail(f"no {what}:\n{''.join(self.lines[-60:])}")
            time.sleep(0.1)


def sigterm_pending(pid: int) -> bool:
    """Whether ``pid`` has a SIGTERM waiting (it is stopped) or is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    pending = (
        int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd", "ShdPnd"))
    )
    return any(mask >> (signal.SIGTERM - 1) & 1 for mask in pending)


def good_steps(run_dir: Path) -> list[int]:
    return [m.step for m in list_checkpoints(str(run_dir / "checkpoints")) if m.good]


@pytest.mark.dist  # two real torchrun agents
def test_lose_a_node_continue_on_one_then_grow_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The uninterrupted reference trains alongside: most of either run is start-up and waiting.
    reference = Launch(tmp_path / "reference")
    reference.wait("reference agents", lambda: len(reference.agent_pids()) == 2)
    # Rank 0 sleeps before each step, so that each phase lasts long enough to be seen (not the loss).
    monkeypatch.setenv("TESSERA_FAULT_SLOW_RANK", "0")
    monkeypatch.setenv("TESSERA_FAULT_SLOW_S", "0.3")
    run_dir = tmp_path / "elastic"
    launch = Launch(run_dir)
    launch.wait("checkpoint of step 4", lambda: any(step >= 4 for step in good_steps(run_dir)))
    # Node 0 is lost (its agent and its rank at once): the one whose agent c10d would have made host
    # the rendezvous store, and whose rank hosted the workers' store.
    kill_agent(launch.agent_pids()[0])
    killed_after = max(good_steps(run_dir))
    launch.wait(
        "checkpoint written on one node",
        lambda: (
            any(line["world_size"] == 1 for line in read_metrics(run_dir / "metrics.jsonl"))
            and max(good_steps(run_dir)) > killed_after
        ),
    )
    # Capacity returns. The survivor's rank is held meanwhile, so that on a loaded machine it cannot
    # finish alone before the returning node has started; it goes on once its agent, seeing the new
    # node waiting, has told it to stop for the re-rendezvous.
    (survivor,) = agent_workers(launch.agent_pids()[1])
    os.kill(survivor, signal.SIGSTOP)
    returned = start_agent(launch.commands[0], launch_env(launch.run.job), launch.run.dir)
    returned_lines: list[str] = []
    threading.Thread(target=lambda: returned_lines.extend(returned.stdout or []), daemon=True).start()
    try:
        launch.wait("stop request to the held rank", lambda: sigterm_pending(survivor))
        with contextlib.suppress(ProcessLookupError):
            os.kill(survivor, signal.SIGCONT)
        launch.thread.join(timeout=WAIT_S)
        assert returned.wait(timeout=60) == 0, "".join(returned_lines[-60:])
    finally:
        stop_agent(returned)
    reference.thread.join(timeout=WAIT_S)
    assert reference.result is not None and reference.result.kind == "ok", reference.lines[-40:]
    assert launch.result is not None and launch.result.kind == "ok", launch.lines[-60:]
    log = "".join(launch.lines)
    assert "ELASTIC: running on 1 of 2 nodes: dp_shard 1 (spec 2), 4 micro-batches (spec 2)" in log

    ours, theirs = (
        read_metrics(run_dir / "metrics.jsonl"),
        read_metrics(tmp_path / "reference" / "metrics.jsonl"),
    )
    assert [line["step"] for line in ours] == [line["step"] for line in theirs] == list(range(1, 25))
    worlds = [line["world_size"] for line in ours]
    shrunk = [line["step"] for line in ours if line["world_size"] == 1]
    assert shrunk and worlds[-1] == 2 and worlds[: shrunk[0] - 1] == [2] * (shrunk[0] - 1), worlds
    assert all(line["tokens"] == line["step"] * 8 * 16 for line in ours)  # the global batch is kept
    # Up to the checkpoint the survivor resumed from, the same layout trained: bitwise the same.
    before = shrunk[0] - 1
    assert [line["loss"] for line in ours[:before]] == [line["loss"] for line in theirs[:before]]
    # The first step on one node starts from those same weights, so its loss differs only by summation
    # order (4 micro-batches on one rank, not 2 on each of two): ~1e-7. Any other sample in the batch
    # would move it by ~1e-2: the data order is exactly the reference's.
    assert ours[before]["loss"] == pytest.approx(theirs[before]["loss"], abs=1e-5)
    # Later steps are not bitwise equal: every gradient is summed in another order on one node, and
    # Adam carries those last-bit differences on. Measured here: at most ~5e-7 over 40 steps;
    # 1e-4 leaves room for that while a repeated or skipped batch (~1e-2) still fails.
    for mine, ref in zip(ours, theirs, strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-4), (mine["step"], mine["loss"], ref["loss"])


def job_of(**sections: dict[str, Any]) -> JobConfig:
    return spec_with(**sections).job_config(data_url=None)


def test_fit_to_world_flexes_dp_and_keeps_the_global_batch() -> None:
    job = job_of()
    assert fit_to_world(job, 2) is job
    shrunk = fit_to_world(job, 1)
    assert (shrunk.parallel.dp_shard, shrunk.hardware.nodes, micro_batches(shrunk)) == (1, 1, 4)
    assert shrunk.train.global_batch_size == job.train.global_batch_size
    assert describe_resize(job, shrunk) == (
        "running on 1 of 2 nodes: dp_shard 1 (spec 2), 4 micro-batches (spec 2), global batch 8 kept"
    )
    hsdp = job_of(
        parallel={"dp_replicate": 4, "dp_shard": 2},
        cluster={"nodes": 4, "chips_per_node": 2},
        train={"global_batch_size": 48},
        faults={"min_nodes": 2},
    )
    half = fit_to_world(hsdp, 4)
    assert (half.parallel.dp_replicate, half.parallel.dp_shard, micro_batches(half)) == (2, 2, 6)
    with pytest.raises(UserError, match="--nnodes=2:4 --nproc-per-node=2"):
        fit_to_world(hsdp, 3)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"faults": {"min_nodes": 3}}, "faults.min_nodes=3 exceeds cluster.nodes=2; set min_nodes ≤ nodes"),
        ({"faults": {"min_nodes": 1, "max_restarts": 0}}, "needs faults.max_restarts ≥ 1"),
        (  # pipeline stages across nodes, no data parallelism: nothing can flex
            {"parallel": {"dp_shard": 1, "pp": 2}, "model": {**MICRO_MODEL, "n_layers": 2}},
            "parallel.dp_shard=1 would become 1×1/2, not a whole number",
        ),
        (  # 3 of 4 nodes: dp_shard 3 does not divide the global batch of 8
            {"cluster": {"nodes": 4}, "parallel": {"dp_shard": 4}, "train": {"micro_batch_size": 1}},
            "faults.min_nodes=1: at 3 of 4 nodes (dp_shard=3): train.global_batch_size=8 must be divisible",
        ),
    ],
)
def test_spec_refuses_layouts_that_cannot_flex(sections: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec_with(**sections)


def test_elastic_errors_accept_every_node_count_in_range() -> None:
    spec = spec_with(cluster={"nodes": 4}, parallel={"dp_shard": 4}, train={"global_batch_size": 24})
    assert elastic_errors(spec.model, spec.parallel, spec.train, spec.cluster, spec.faults) == []


def test_torchrun_command_is_elastic_only_with_min_nodes() -> None:
    fixed = torchrun_command(Path("job.json"), Path("run"), 1, 2, 0, "127.0.0.1:29400")
    assert "--nnodes=2" in fixed and not any(arg.startswith("--rdzv-conf") for arg in fixed)
    elastic = torchrun_command(
        Path("job.json"), Path("run"), 1, 2, 0, "127.0.0.1:29400", min_nodes=1, replacement_wait_s=30
    )
    assert "--nnodes=1:2" in elastic
    assert "--rdzv-conf=last_call_timeout=30,keep_alive_interval=10" in elastic


def test_launcher_lets_an_elastic_run_lose_an_agent(tmp_path: Path) -> None:
    lost = [sys.executable, "-c", "raise SystemExit(1)"]
    survivor = [sys.executable, "-c", "import time; time.sleep(2)"]
    lines: list[str] = []
    elastic = run_agents(
        [lost, survivor], dict(os.environ), RunDir(tmp_path / "e"), lines.append, elastic=True
    )
    assert elastic.kind == "ok" and "the others continue without it" in "".join(lines)
    assert run_agents([lost, lost], dict(os.environ), RunDir(tmp_path / "all"), elastic=True).returncode == 1
    fixed = run_agents([lost, survivor], dict(os.environ), RunDir(tmp_path / "f"))
    assert fixed.kind != "ok" and fixed.returncode == 1  # the first failure ends a non-elastic run


def test_a_finished_elastic_run_frees_the_host_memory_of_its_other_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # this process is its host's local rank 0
    job = job_of(checkpoint={"memory_dir": str(tmp_path)}).model_copy(update={"memory_interval_steps": 2})
    full, shrunk = memory_directory(job), memory_directory(fit_to_world(job, 1))
    assert full != shrunk  # snapshots are layout-bound: another size never finds them
    for directory in (full, shrunk):
        directory.mkdir()
        (directory / "rank-00000.own.step-000000004.pt").write_bytes(b"shard")
    discard_other_sizes(job, job)  # ended at full size: the tier itself frees that one
    assert full.exists() and not shrunk.exists()
