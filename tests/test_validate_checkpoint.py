"""Checkpoint validation: integrity, resharded loading in a separate process group, verdict in the commit record.

One torchrun launch: a checkpoint saved by one process is validated by loading it into two.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from tests.dist.ckpt_common import JOB, TOKENS_PER_STEP, Trainee
from tests.fault_report import FaultRow, record
from trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointMismatch,
    CheckpointStoreError,
    list_checkpoints,
    read_commit,
)
from trainer.checkpoint.pins import PIN_TTL_S, pin, pinned_steps, unpin
from trainer.checkpoint.validate import load_and_check, validate_checkpoint
from trainer.config import CheckpointConfig, JobConfig


def save_steps(url: Path, steps: int) -> CheckpointManager:
    trainee = Trainee(world=1, rank=0)
    manager = CheckpointManager(str(url), CheckpointConfig(mode="sync"), 1, JOB.model_fingerprint(), 1, 0, {})
    for step in range(1, steps + 1):
        trainee.step()
        manager.maybe_save(step, trainee.state(), {"tokens": step * TOKENS_PER_STEP})
    return manager


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    url = tmp_path_factory.mktemp("validate") / "ckpt"
    save_steps(url, 2).close()
    return url


@pytest.fixture
def copy(checkpoints: Path, tmp_path: Path) -> Path:
    shutil.copytree(checkpoints, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.dist
def test_valid_checkpoint_is_loaded_by_another_world_size_and_marked_validated(copy: Path) -> None:
    # A 1-byte budget streams the load one tensor per dcp.load, every one resharded over two ranks.
    result = validate_checkpoint(str(copy / "step-000002"), JOB, world_size=1, budget_bytes=1)
    assert (result.status, result.reason) == ("validated", "")
    # Saved by one process, so it was loaded (resharded) by two under torchrun.
    assert (result.saved_world_size, result.loaded_world_size) == (1, 2)
    manifest = read_commit(str(copy / "step-000002"))
    assert manifest.status == "validated"
    latest = CheckpointManager(str(copy), CheckpointConfig(), 1, JOB.model_fingerprint(), 1, 0, {}).latest()
    assert (latest.step, latest.status) == (2, "validated")


@pytest.mark.fault
def test_flipped_byte_marks_corrupt_and_latest_falls_back(copy: Path) -> None:
    shard = copy / "step-000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    result = validate_checkpoint(str(copy / "step-000002"), JOB)
    assert result.status == "corrupt"
    assert result.reason == "sha256 mismatch: __0_0.distcp"
    manifest = read_commit(str(copy / "step-000002"))
    assert (manifest.status, manifest.reason) == ("corrupt", result.reason)
    assert restore(copy) == (1, [(1, "committed"), (2, "corrupt")])
    record_fallback("flipped byte in the newest checkpoint (found by validation)", 1)


def test_non_finite_weights_fail_the_load_check(tmp_path: Path) -> None:
    trainee = Trainee(world=1, rank=0)
    with torch.no_grad():
        trainee.model.norm.weight[0] = float("nan")
    manager = CheckpointManager(
        str(tmp_path), CheckpointConfig(mode="sync"), 1, JOB.model_fingerprint(), 1, 0, {}
    )
    manager.maybe_save(1, trainee.state(), {"tokens": 0})
    verdict = load_and_check(str(tmp_path / "step-000001"))
    assert not verdict["ok"]
    assert verdict["reason"] == "non-finite values in 1 tensors, e.g. app.model.norm.weight"


def test_other_model_and_partial_writes_are_refused(copy: Path) -> None:
    other = JobConfig.model_validate({**JOB.model_dump(), "model": {**JOB.model.model_dump(), "dim": 64}})
    with pytest.raises(CheckpointMismatch, match="step-000002 holds model"):
        validate_checkpoint(str(copy / "step-000002"), other)
    (copy / "step-000002" / "tessera.json").unlink()
    with pytest.raises(CheckpointStoreError, match=r"step-000002 has no tessera\.json commit record"):
        validate_checkpoint(str(copy / "step-000002"), JOB)


def record_fallback(fault: str, restored: int) -> None:
    """A report row: the newest checkpoint (step 2) was bad and resume fell back to ``restored``."""
    record(
        FaultRow(fault, "recovered", "corrupt checkpoint, older one resumed", None, 2 - restored, None, None)
    )


def restore(url: Path) -> tuple[int | None, list[tuple[int, str]]]:
    """Resume into a fresh trainee: the step restored and every checkpoint's (step, status) after."""
    manager = CheckpointManager(str(url), CheckpointConfig(), 1, JOB.model_fingerprint(), 1, 0, {})
    restored = manager.restore(Trainee(world=1, rank=0).state())
    return (restored.step if restored else None), [(m.step, m.status) for m in list_checkpoints(str(url))]


@pytest.mark.fault
def test_truncated_shard_is_marked_corrupt_on_resume_and_the_older_one_is_used(copy: Path) -> None:
    shard = copy / "step-000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert restore(copy) == (1, [(1, "committed"), (2, "corrupt")])
    assert read_commit(str(copy / "step-000002")).reason.startswith(
        "files truncated or missing: __0_0.distcp"
    )
    assert restore(copy) == (1, [(1, "committed"), (2, "corrupt")])  # the retry does not trip on it again
    record_fallback("truncated shard in the newest checkpoint", 1)


@pytest.mark.fault
def test_shard_that_fails_to_load_is_marked_corrupt_and_the_older_one_is_used(copy: Path) -> None:
    shard = copy / "step-000002" / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))  # right size, garbage content: only a load can tell
    assert restore(copy) == (1, [(1, "committed"), (2, "corrupt")])
    assert "loading checkpoint" in read_commit(str(copy / "step-000002")).reason
    record_fallback("garbage shard content in the newest checkpoint", 1)


@pytest.mark.fault
def test_deleted_manifest_makes_a_partial_that_resume_skips(copy: Path) -> None:
    (copy / "step-000002" / "tessera.json").unlink()
    assert restore(copy) == (1, [(1, "committed")])
    record_fallback("manifest of the newest checkpoint deleted", 1)


def test_no_loadable_checkpoint_fails_once_then_the_retry_starts_fresh(copy: Path) -> None:
    for step in (1, 2):
        shard = copy / f"step-00000{step}" / "__0_0.distcp"
        shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(CheckpointError, match=r"no checkpoint under .* loads"):
        restore(copy)
    assert restore(copy) == (None, [(1, "corrupt"), (2, "corrupt")])


DAMAGED_MANIFESTS = {
    "invalid JSON": b"{not json",
    "empty object": b"{}",
    "no files key": b'{"step": 2, "tokens": 1, "model_fingerprint": "x", "world_size": 1, "layout": {}}',
    "wrong type": b'{"step": "two", "tokens": 1, "model_fingerprint": "x", "world_size": 1, "layout": {}, "files": {}}',
    "a list": b"[]",
    "empty file": b"",
}


@pytest.mark.fault
@pytest.mark.parametrize("damage", DAMAGED_MANIFESTS)
def test_damaged_manifest_is_a_corrupt_checkpoint_and_resume_falls_back(copy: Path, damage: str) -> None:
    """A tessera.json that does not parse is one more corrupt checkpoint: no crash loop, no traceback."""
    (copy / "step-000002" / "tessera.json").write_bytes(DAMAGED_MANIFESTS[damage])
    assert restore(copy) == (1, [(1, "committed"), (2, "corrupt")])
    assert read_commit(str(copy / "step-000002")).reason.startswith("unreadable tessera.json (")
    assert restore(copy) == (1, [(1, "committed"), (2, "corrupt")])  # the retry does not trip on it either
    if damage == "invalid JSON":
        record_fallback("damaged tessera.json in the newest checkpoint (invalid JSON, {}, missing keys)", 1)


def test_damaged_manifest_in_an_older_checkpoint_is_skipped_too(copy: Path) -> None:
    (copy / "step-000001" / "tessera.json").write_bytes(b"{}")
    assert restore(copy) == (2, [(1, "corrupt"), (2, "committed")])


def test_a_pinned_checkpoint_outlives_retention_until_unpinned(tmp_path: Path) -> None:
    """What keeps retention from deleting a checkpoint whose validation or evaluation is queued."""
    url = str(tmp_path / "ckpt")
    manager = CheckpointManager(
        url, CheckpointConfig(mode="sync", keep_last=1), 1, JOB.model_fingerprint(), 1, 0, {}
    )
    trainee = Trainee(world=1, rank=0)

    def save(step: int) -> list[int]:
        trainee.step()
        manager.maybe_save(step, trainee.state(), {"tokens": step * TOKENS_PER_STEP})
        return [m.step for m in list_checkpoints(url)]

    assert save(1) == [1]
    held = pin(url, 1, "tiny-local-0123abcd")
    assert save(2) == [1, 2] and save(3) == [1, 3]  # keep_last=1, but step 1 is pinned
    unpin(held)
    assert save(4) == [4]
    pin(url, 4, "crashed-pipeline")
    assert pinned_steps(url) == {4}
    assert pinned_steps(url, now=time.time() + PIN_TTL_S + 1) == set()  # a crashed pipeline's pin expires
