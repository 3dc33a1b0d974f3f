"""Sharded DCP checkpoints through fsspec: save/resume/retention, manifests, validation.

See ``manager.py`` for the save protocol and ``manifest.py`` for what makes a checkpoint committed.
"""

from trainer.checkpoint.errors import CheckpointError, CheckpointMismatch, CheckpointStoreError
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.manifest import Manifest, check_model, list_checkpoints, read_manifest
from trainer.checkpoint.state import APP_KEY, ModelOptimizerState, RNGState

__all__ = [
    "APP_KEY",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatch",
    "CheckpointStoreError",
    "Manifest",
    "ModelOptimizerState",
    "RNGState",
    "check_model",
    "list_checkpoints",
    "read_manifest",
]
