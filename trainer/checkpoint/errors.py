"""Checkpoint errors: each message is one line naming the checkpoint and what to do."""


class CheckpointError(Exception):
    """Base class; callers that print errors without a traceback catch this."""


class CheckpointStoreError(CheckpointError):
    """The URL cannot be reached, created or read."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was saved from a different model and cannot be loaded into this one."""
