"""Checkpoint errors: each message is one line naming the checkpoint and what to do."""

from trainer.storage import StoreError


class CheckpointError(Exception):
    """Base class; callers that print errors without a traceback catch this."""


class CheckpointStoreError(CheckpointError, StoreError):
    """The URL cannot be reached, created or read (a :class:`~trainer.storage.StoreError` of a checkpoint)."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was saved from a different model and cannot be loaded into this one."""
