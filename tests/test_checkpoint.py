"""Sharded checkpoints end to end: real torchrun over gloo, FSDP2, DCP resharding, retention, errors.

Two torchrun launches serve every distributed check: tests/dist/ckpt_save.py (4 ranks: async and sync
saves, retention, a planted partial) and tests/dist/ckpt_reshard.py (2 ranks: resume with resharding,
then an async_process save).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist.ckpt_common import JOB, TOKENS_PER_STEP, Trainee
from tests.torchrun import run_torchrun
from trainer.checkpoint import (
    CheckpointManager,
    CheckpointMismatch,
    CheckpointStoreError,
    list_checkpoints,
    read_commit,
)
from trainer.checkpoint.manager import steps_to_delete
from trainer.checkpoint.store import WRITER_THREADS
from trainer.checkpoint.validate import validate_checkpoint
from trainer.config import CheckpointConfig
from trainer.evaluate import evaluate_checkpoint

REPO = Path(__file__).resolve().parents[1]
FINGERPRINT = JOB.model_fingerprint()


def torchrun(module: str, nproc: int, out: Path) -> None:
    run_torchrun(["-m", module, str(out)], nproc)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    torchrun("tests.dist.ckpt_save", 4, out)
    return out


@pytest.fixture(scope="module")
def resharded(saved: Path) -> Path:
    torchrun("tests.dist.ckpt_reshard", 2, saved)
    return saved


def assert_same_state(actual: dict, expected: dict) -> None:
    assert actual["tensors"].keys() == expected["tensors"].keys()
    for key, value in expected["tensors"].items():  # tensors, and optimizer hyper-parameters
        same = (
            torch.equal(actual["tensors"][key], value)
            if isinstance(value, torch.Tensor)
            else (actual["tensors"][key] == value)
        )
        assert same, key
    assert actual["scheduler"] == expected["scheduler"]
    assert actual["loader"] == expected["loader"]


@pytest.mark.dist
@pytest.mark.smoke  # make test-fast's multi-process training: 4 FSDP2 ranks, 8 steps, both save modes
def test_async_and_sync_saves_commit_and_retention_keeps_last_and_every_kth(saved: Path) -> None:
    # async: every 2 steps, keep_last=2, keep_every=4 -> 4 (4th), 6, 8; the planted partial 3 and 2 deleted.
    # sync: steps 3, 6 and the forced final 8, keep_last=2 -> 6, 8.
    for name, steps in (("async", [4, 6, 8]), ("sync", [6, 8])):
        manifests = list_checkpoints(str(saved / name))
        assert [m.step for m in manifests] == steps
        assert sorted(p.name for p in (saved / name).iterdir()) == [f"step-{s:06d}" for s in steps]
        for manifest in manifests:
            assert manifest.status == "committed"
            assert (manifest.world_size, manifest.layout) == (4, {"dp_shard": 4})
            assert manifest.tokens == manifest.step * TOKENS_PER_STEP
            assert manifest.model_fingerprint == FINGERPRINT
            # a file per writer thread on every rank (trainer.checkpoint.store.WRITER_THREADS)
            shards = {f"__{rank}_{file}.distcp" for rank in range(4) for file in range(WRITER_THREADS)}
            assert set(manifest.files) == {".metadata", *shards}


@pytest.mark.dist
def test_resume_on_2_ranks_reshards_to_identical_state(resharded: Path) -> None:
    loaded = torch.load(resharded / "resharded.pt", weights_only=False)
    assert loaded["step"] == 8
    assert_same_state(loaded, torch.load(resharded / "reference.pt", weights_only=False))


@pytest.mark.dist
def test_async_process_mode_commits(resharded: Path) -> None:
    (manifest,) = list_checkpoints(str(resharded / "process"))
    assert (manifest.step, manifest.status, manifest.world_size) == (9, "committed", 2)


@pytest.mark.dist
def test_4_rank_checkpoint_loads_into_one_unsharded_process(saved: Path) -> None:
    trainee = Trainee(world=1, rank=0)
    manager = CheckpointManager(str(saved / "async"), CheckpointConfig(), 2, FINGERPRINT, 1, 0, {})
    manager.load(manager.latest(), trainee.state())
    assert_same_state(trainee.full_state(), torch.load(saved / "reference.pt", weights_only=False))


@pytest.mark.dist
def test_4_rank_checkpoint_validates_in_one_process(saved: Path, tmp_path: Path) -> None:
    shutil.copytree(saved / "sync" / "step-000006", tmp_path / "step-000006")
    result = validate_checkpoint(str(tmp_path / "step-000006"), JOB, world_size=1)
    assert (result.status, result.saved_world_size, result.loaded_world_size) == ("validated", 4, 1)
    assert read_commit(str(tmp_path / "step-000006")).status == "validated"


@pytest.mark.dist
def test_partial_directory_is_never_resumed(saved: Path, tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    shutil.copytree(saved / "async", url)
    # What a save killed before its commit leaves: every shard and .metadata, but no commit record.
    shutil.copytree(url / "step-000008", url / "step-000010", ignore=shutil.ignore_patterns("tessera.json"))
    manager = CheckpointManager(str(url), CheckpointConfig(), 2, FINGERPRINT, 1, 0, {})
    assert manager.latest().step == 8
    assert [m.step for m in list_checkpoints(str(url))] == [4, 6, 8]


@pytest.mark.dist
def test_other_model_fingerprint_is_refused_with_one_clear_line(saved: Path) -> None:
    manager = CheckpointManager(str(saved / "async"), CheckpointConfig(), 2, "0123456789abcdef", 1, 0, {})
    with pytest.raises(CheckpointMismatch) as error:
        manager.load(manager.latest(), Trainee(world=1, rank=0).state())
    message = str(error.value)
    assert "\n" not in message
    assert "step-000008" in message and FINGERPRINT in message and "0123456789abcdef" in message


@pytest.mark.dist
def test_evaluate_checkpoint_matches_the_saved_model(saved: Path) -> None:
    reference = Trainee(world=1, rank=0)
    reference.model.load_state_dict(
        {
            k.removeprefix("model."): v
            for k, v in torch.load(saved / "reference.pt", weights_only=False)["tensors"].items()
            if k.startswith("model.")
        }
    )
    batches = [next(reference.loader) for _ in range(2)]
    result = evaluate_checkpoint(str(saved / "async" / "step-000008"), JOB, batches, [1, 2, 3], 5)
    with torch.no_grad():
        expected = (
            torch.stack(
                [
                    torch.nn.functional.cross_entropy(reference.model(x).flatten(0, 1), y.flatten())
                    for x, y in batches
                ]
            )
            .mean()
            .item()
        )
    assert result.step == 8
    assert result.loss == pytest.approx(expected, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-5)
    assert len(result.sample_ids) == 5 and all(0 <= t < JOB.model.vocab_size for t in result.sample_ids)


def test_unusable_urls_fail_with_one_line_naming_them(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    cases = [
        lambda: CheckpointManager("nosuch://bucket/run", CheckpointConfig(), 1, FINGERPRINT, 1, 0, {}),
        lambda: CheckpointManager(
            str(tmp_path / "file" / "ckpt"), CheckpointConfig(), 1, FINGERPRINT, 1, 0, {}
        ),
        lambda: validate_checkpoint(str(tmp_path / "missing" / "step-000001"), JOB),
        lambda: evaluate_checkpoint(str(tmp_path / "missing" / "step-000001"), JOB, [], None, 0),
    ]
    for case, named in zip(
        cases, ["nosuch://bucket/run", "file/ckpt", "missing/step-000001", "missing/step-000001"], strict=True
    ):
        with pytest.raises(CheckpointStoreError) as error:
            case()
        assert named in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_injected_death_mid_save_leaves_a_partial_never_a_commit(tmp_path: Path) -> None:
    """``CheckpointManager(faults=...)`` hands each save's writer to the fault injector: its death after
    the shard files are written leaves the step directory without a manifest, which nothing resumes."""
    code = (
        "import torch\n"
        "from trainer.checkpoint import CheckpointManager\n"
        "from trainer.config import CheckpointConfig\n"
        "from trainer.rank.fault_injection import FaultInjector\n"
        f"manager = CheckpointManager({str(tmp_path)!r}, CheckpointConfig(mode='sync'), 1, "
        f"{FINGERPRINT!r}, 1, 0, {{}}, faults=FaultInjector(kill_in_save_at_step=2))\n"
        "for step in (1, 2):\n"
        "    manager.maybe_save(step, {'w': torch.zeros(4)}, {'tokens': step})\n"
    )
    env = {**os.environ, "TORCHELASTIC_RESTART_COUNT": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert "injected fault: SIGKILL rank 0 inside step 2's checkpoint write" in done.stderr
    assert [(m.step, m.status) for m in list_checkpoints(str(tmp_path))] == [(1, "committed")]
    assert any((tmp_path / "step-000002").glob("*.distcp"))  # the shards landed; the commit did not


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_that_would_outlast_the_run_is_not_started(tmp_path: Path, mode: str) -> None:
    """The final step's forced save waits for an async save in flight: an interval save that the last
    committed save's duration says would still be running at the final step is skipped, so the end of
    the run waits for one save, never two. A sync save commits before the next step, so it is always
    written. The durations are set, not measured: nothing here is timed."""
    manager = CheckpointManager(
        str(tmp_path), CheckpointConfig(mode=mode, keep_last=10), 2, FINGERPRINT, 1, 0, {}
    )
    state = {"w": torch.zeros(4)}
    for step in range(1, 9):
        if step == 4:  # the save at step 2 is known to take far longer than the 4 steps left after 4
            manager._wait()
            manager._save_s = 1e6
        manager.maybe_save(step, state, {"tokens": step}, force=step == 8, last_step=8)
    manager.close()
    assert [m.step for m in list_checkpoints(str(tmp_path))] == ([2, 4, 6, 8] if mode == "sync" else [2, 8])
    # without a known duration, or without the final step, every interval save is written
    plain = CheckpointManager(
        str(tmp_path / "plain"), CheckpointConfig(mode=mode, keep_last=10), 2, FINGERPRINT, 1, 0, {}
    )
    for step in range(1, 9):
        plain.maybe_save(step, state, {"tokens": step}, force=step == 8)
    plain.close()
    assert [m.step for m in list_checkpoints(str(tmp_path / "plain"))] == [2, 4, 6, 8]


def test_retention_keeps_newest_good_and_every_kth_and_drops_partials_and_corrupt() -> None:
    statuses = {
        2: "committed",
        4: "validated",
        5: None,
        6: "corrupt",
        8: "committed",
        10: "committed",
        12: "committed",
    }
    assert steps_to_delete(statuses, keep_last=1, keep_every=4) == [2, 5, 6, 10]
    assert steps_to_delete(statuses, keep_last=3, keep_every=None) == [2, 4, 5, 6]
    assert steps_to_delete({3: "committed"}, keep_last=1, keep_every=None) == []


@pytest.mark.store
def test_gcs_round_trip_with_retention(gcs_bucket: str) -> None:
    url = f"{gcs_bucket}/checkpoint-round-trip"
    trainee = Trainee(world=1, rank=0)
    manager = CheckpointManager(url, CheckpointConfig(mode="async", keep_last=1), 1, FINGERPRINT, 1, 0, {})
    for step in (1, 2):
        trainee.step()
        manager.maybe_save(step, trainee.state(), {"tokens": step * TOKENS_PER_STEP})
    manager.close()
    assert [(m.step, m.status) for m in list_checkpoints(url)] == [(2, "committed")]

    resumed = Trainee(world=1, rank=0)
    manager.load(manager.latest(), resumed.state())
    assert_same_state(resumed.full_state(), trainee.full_state())
