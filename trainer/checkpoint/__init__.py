"""Sharded DCP checkpoints through fsspec: save/resume/retention, commit records, validation.

See ``manager.py`` for the save protocol and ``commit.py`` for what makes a checkpoint committed.
"""

from trainer.checkpoint.commit import CommitRecord, check_model, list_checkpoints, read_commit
from trainer.checkpoint.errors import CheckpointError, CheckpointMismatch, CheckpointStoreError
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.state import APP_KEY, ModelOptimizerState, RNGState

__all__ = [
    "APP_KEY",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatch",
    "CheckpointStoreError",
    "CommitRecord",
    "ModelOptimizerState",
    "RNGState",
    "check_model",
    "list_checkpoints",
    "read_commit",
]
