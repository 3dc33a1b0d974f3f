"""Checkpoints from an untrusted bucket are loaded without running code planted in them.

Each case first shows that stock DCP loading really executes the planted pickle (it touches a marker
file), then that ``store.load`` refuses the same checkpoint with one line and touches nothing.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.fault_report import FaultRow, record
from trainer.checkpoint import CheckpointError, store
from trainer.checkpoint.safe_load import UnsafeCheckpoint


class Planted:
    """Unpickling this runs a shell command: what an attacker with bucket write access would plant."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def save(path: Path, state: dict) -> None:
    dcp.save(state, storage_writer=store.storage_writer(str(path)), no_dist=True)


def stock_load(path: Path, state: dict) -> None:
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "step-000001"
    save(path, {"w": torch.arange(4.0), "lr": 0.1, "betas": (0.9, 0.95)})
    return path


def test_real_checkpoints_load_tensors_and_plain_values(checkpoint: Path) -> None:
    state = {"w": torch.zeros(4), "lr": None, "betas": None}
    store.load(state, str(checkpoint), no_dist=True)
    assert torch.equal(state["w"], torch.arange(4.0))
    assert (state["lr"], state["betas"]) == (0.1, (0.9, 0.95))


@pytest.mark.fault
def test_planted_index_is_refused_without_running_it(checkpoint: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    stock = tmp_path / "stock"
    shutil.copytree(checkpoint, stock)
    (stock / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(CheckpointException):  # stock DCP runs the command, then trips on its result
        stock_load(stock, {"w": torch.zeros(4)})
    assert marker.exists()
    marker.unlink()

    (checkpoint / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(UnsafeCheckpoint, match=r"refusing to load posix\.system"):
        store.load({"w": torch.zeros(4)}, str(checkpoint), no_dist=True)
    assert not marker.exists()
    record(
        FaultRow(
            "code planted in a checkpoint's .metadata", "failed clearly", "refused", None, None, None, None
        )
    )


@pytest.mark.fault
def test_planted_value_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "step-000001"
    save(path, {"w": torch.arange(4.0), "lr": Planted(marker)})
    assert not marker.exists()  # saving only pickles it

    stock_load(path, {"w": torch.zeros(4), "lr": None})
    assert marker.exists()
    marker.unlink()

    with pytest.raises(UnsafeCheckpoint, match=r"refusing to load lr: it unpickles posix\.system") as error:
        store.load({"w": torch.zeros(4), "lr": None}, str(path), no_dist=True)
    assert "\n" not in str(error.value)
    assert not marker.exists()
    record(
        FaultRow("code planted in a checkpoint value", "failed clearly", "refused", None, None, None, None)
    )


def test_garbled_index_is_a_checkpoint_error_not_a_crash(checkpoint: Path) -> None:
    index = checkpoint / ".metadata"
    index.write_bytes(index.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="checkpoint index unreadable: pickle data was truncated"):
        store.load({"w": torch.zeros(4)}, str(checkpoint), no_dist=True)
