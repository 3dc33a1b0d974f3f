"""Goodput: the accounting of a run's wall time, and the failure simulator.

The accounting of a real run with a real ``kill -9`` is checked in ``tests/test_train.py``'s crash test
(its run directory, no launch of its own); here the same arithmetic runs on a hand-written event file,
and the simulator on small clusters whose answers follow from their parameters.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera.cli import app
from trainer.plan.goodput_sim import (
    LLAMA3_TABLE5,
    Cluster,
    FailureCategory,
    FailureModel,
    Tier,
    compare_policies,
    simulate,
)
from trainer.report.goodput import account, format_markdown, restart_seconds

REPO = Path(__file__).resolve().parents[1]
SPEC_405B = REPO / "benchmarks" / "llama3-405b-h100-16k.yaml"


def test_account_splits_wall_time_across_a_kill() -> None:
    """Launch at 0; attempt 0 starts at 1, restores at 3, trains steps 1-4 (3-7), stores and snapshots step 4 (7-8),
    trains steps 5-6 (8-10) and is killed; attempt 1 starts at 14, restores step 4 at 16 and trains
    steps 5-8 (16-20). Steps 5 and 6 of attempt 0 were recomputed; 10 → 16 was the restart."""
    events = [
        {"kind": "launch", "t": 0.0},
        {"kind": "startup", "t0": 1.0, "t1": 2.0},
        {"kind": "restore", "t0": 2.0, "t1": 3.0, "step": 0},
        {"kind": "steps", "t0": 3.0, "t1": 7.0, "first": 1, "last": 4},
        {"kind": "checkpoint", "t0": 7.0, "t1": 7.5, "step": 4},
        {"kind": "snapshot", "t0": 7.5, "t1": 8.0, "step": 4},
        {"kind": "steps", "t0": 8.0, "t1": 10.0, "first": 5, "last": 6},
        {"kind": "launch", "t": 11.0},  # a retry's launch: the restart has to wait for its processes
        {"kind": "startup", "t0": 14.0, "t1": 15.0},
        {"kind": "restore", "t0": 15.0, "t1": 16.0, "step": 4},
        {"kind": "steps", "t0": 16.0, "t1": 20.0, "first": 5, "last": 8},
    ]
    breakdown = account(events, mfu=0.5)
    assert breakdown.wall_s == 20.0
    assert breakdown.seconds == {
        "productive": 8.0,  # steps 1-4 of attempt 0, 5-8 of attempt 1
        "checkpoint": 0.5,
        "memory_snapshot": 0.5,
        "startup": 2.0,  # first process 1 → restored 3
        "restart": 3.0,  # last line 10 → restored 16, less the 3 s from the retry's launch to its process
        "recomputed": 2.0,
        "scheduling": 4.0,  # launch 0 → first process 1, retry launch 11 → its process 14
        "other": 0.0,
    }
    assert sum(breakdown.seconds.values()) == breakdown.wall_s
    assert (breakdown.restarts, breakdown.steps_lost, breakdown.steps_kept) == (1, 2, 8)
    assert breakdown.effective_training_time == 8 / 20
    assert breakdown.scheduling_goodput == 16 / 20 and breakdown.runtime_goodput == 8 / 16
    assert "| restarts (fault → training resumed) | 3.0 | 15.0% |" in format_markdown(breakdown)
    assert "= 20.0%" in format_markdown(breakdown)  # 80% × 50% × 50%
    assert restart_seconds(events) == [3.0]


def test_each_restart_is_timed_on_its_own() -> None:
    """Two torchrun restarts (no launch between): 5 → 9 and 12 → 18; what the sum says, one by one."""
    events = [
        {"kind": "launch", "t": 0.0},
        {"kind": "startup", "t0": 0.0, "t1": 1.0},
        {"kind": "restore", "t0": 1.0, "t1": 2.0, "step": 0},
        {"kind": "steps", "t0": 2.0, "t1": 5.0, "first": 1, "last": 3},
        {"kind": "startup", "t0": 7.0, "t1": 8.0},
        {"kind": "restore", "t0": 8.0, "t1": 9.0, "step": 0},
        {"kind": "steps", "t0": 9.0, "t1": 12.0, "first": 1, "last": 3},
        {"kind": "startup", "t0": 15.0, "t1": 17.0},
        {"kind": "restore", "t0": 17.0, "t1": 18.0, "step": 0},
        {"kind": "steps", "t0": 18.0, "t1": 22.0, "first": 1, "last": 4},
    ]
    assert restart_seconds(events) == [4.0, 6.0]
    assert account(events).seconds["restart"] == 10.0


def one_kind(lost: str, per_hour: float = 1.0) -> FailureModel:
    return FailureModel(lost, per_hour, (FailureCategory(lost, 1, lost),))  # type: ignore[arg-type]


CLUSTER = Cluster(
    chips=1,
    step_s=1.0,
    storage=Tier(interval_steps=100, stall_s=2.0, persist_s=5.0, restore_s=30.0),
    memory=Tier(interval_steps=10, stall_s=0.1, persist_s=0.1, restore_s=1.0),
    peer_restore_s=3.0,
    startup_s=60.0,
    restart_s=20.0,
    detect_exit_s=1.0,
    detect_timeout_s=50.0,
    reschedule_s=10.0,
    spare_nodes=1,
    repair_s=1e9,
)


def test_without_failures_only_checkpoints_and_startup_are_lost() -> None:
    result = simulate(CLUSTER, one_kind("process", per_hour=0.0), until_steps=1000)
    # 1000 steps, 10 storage saves (2 s), 100 memory snapshots (0.1 s), 60 s start-up.
    assert result.wall_s == pytest.approx(60 + 1000 + 10 * 2 + 100 * 0.1)
    assert result.effective_training_time == pytest.approx(1000 / result.wall_s)
    assert (result.steps_kept, result.steps_lost, sum(result.failures.values())) == (1000, 0, 0)


@pytest.mark.parametrize(
    ("lost", "path", "tier"),
    [("process", "own memory", "memory"), ("node", "peer memory", "memory"), ("state", "storage", "storage")],
)
def test_each_failure_takes_its_recovery_path_and_loses_at_most_its_interval(
    lost: str, path: str, tier: str
) -> None:
    cluster = replace(CLUSTER, spare_nodes=10**6)
    result = simulate(cluster, one_kind(lost), seed=3, until_s=50 * 3600)
    failures = result.failures[path]
    assert failures > 20 and failures == sum(
        result.failures[p] for p in ("own memory", "peer memory", "storage")
    )
    # A failure loses the steps since the newest readable copy: one interval, plus the steps run while
    # the newest copy was still being written.
    saved = getattr(cluster, tier)
    assert (
        0
        < result.steps_lost
        <= (saved.interval_steps + math.ceil(saved.persist_s / cluster.step_s)) * failures
    )
    assert sum(result.seconds.values()) == pytest.approx(result.wall_s)
    assert result.seconds["reschedule"] == (10.0 * failures if lost != "process" else 0.0)


def test_a_lost_node_without_a_spare_waits_for_its_repair() -> None:
    result = simulate(
        replace(CLUSTER, spare_nodes=0, repair_s=3600.0), one_kind("node"), seed=2, until_s=50 * 3600
    )
    assert result.failures["waited"] == result.failures["peer memory"] > 5 and result.failures["spare"] == 0
    assert result.seconds["waiting"] == pytest.approx(3600.0 * result.failures["waited"])


def test_restart_all_restores_every_failure_from_storage_and_loses_more() -> None:
    model = one_kind("process", per_hour=2.0)
    tiers, storage_only = (
        simulate(CLUSTER, model, seed=1, until_s=100 * 3600),
        simulate(replace(CLUSTER, memory=None), model, seed=1, until_s=100 * 3600),
    )
    assert storage_only.failures["storage"] == sum(storage_only.failures.values()) > 100
    assert storage_only.seconds["memory_snapshot"] == 0.0
    assert storage_only.steps_lost > 3 * tiers.steps_lost
    assert storage_only.effective_training_time < tiers.effective_training_time


def test_simulation_is_deterministic_by_seed() -> None:
    spares = replace(CLUSTER, chips=16384, spare_nodes=1000)
    first, again, other = (simulate(spares, LLAMA3_TABLE5, seed, until_s=1e7) for seed in (7, 7, 8))
    assert first.as_dict() == again.as_dict()
    assert first.as_dict() != other.as_dict()


def test_llama3_failure_model_at_16k_chips() -> None:
    """Table 5's counts sum to the paper's 419; 54 days on 16,384 chips draws about as many failures
    (fewer: the failure clock stops during recoveries), in the same shares."""
    assert sum(c.count for c in LLAMA3_TABLE5.categories) == 419
    cluster = replace(CLUSTER, chips=16384, spare_nodes=1000)
    clusters = {"two-tier": cluster, "restart-all": replace(cluster, memory=None)}
    results = compare_policies(clusters, LLAMA3_TABLE5, seed=0, until_s=54 * 86400)
    for result in results.values():
        drawn = sum(result.failures[p] for p in ("own memory", "peer memory", "storage"))
        assert 419 * 0.8 < drawn < 419 * 1.1
        assert sum(result.seconds.values()) == pytest.approx(result.wall_s)
    two_tier = results["two-tier"].failures
    assert two_tier["storage"] < two_tier["peer memory"]  # node losses dominate Table 5
    assert two_tier["own memory"] > 0  # software bugs and NCCL timeouts


def test_goodput_command_simulates_the_405b_spec(tmp_path: Path) -> None:
    plot = tmp_path / "goodput.png"
    done = CliRunner().invoke(app, ["goodput", str(SPEC_405B), "--days", "5", "--json", "--plot", str(plot)])
    assert done.exit_code == 0, done.output
    results = json.loads(done.stdout)
    assert set(results) == {"two-tier", "restart-all"}
    for result in results.values():
        assert math.isclose(sum(result["seconds"].values()), result["wall_s"])
        assert 0.5 < result["effective_training_time"] < 1
    assert plot.stat().st_size > 10_000


def test_goodput_says_which_policy_to_choose_and_why() -> None:
    args = ["goodput", str(SPEC_405B), "--days", "5"]
    results = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    best = max(results, key=lambda name: results[name]["effective_training_time"])
    last = CliRunner().invoke(app, args).stdout.strip().splitlines()[-1]
    assert last.startswith(f"choose {best}: {results[best]['effective_training_time']:.2%} of the wall clock")
    assert "loses more of the wall clock to" in last
