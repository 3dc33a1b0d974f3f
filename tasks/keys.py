"""Artifact keys: each run has its own history of each artifact, so no key's versions mix runs.

A continuation reopens its run's id, so its versions extend that run's histories: one run, one
timeline. Prefect accepts any key of lowercase letters, digits and '-' (``prefect.types.names.
ArtifactKey``; no length limit). A run id is a spec name (``deployments.spec.NAME_PATTERN``: at
most 48 such characters) and 8 hex digits, so a key stays a valid one of at most 68 characters.
"""

from __future__ import annotations

from typing import Literal

ArtifactKind = Literal[
    "plan", "memory", "progress", "eval", "loss-curve", "failures", "report", "goodput", "comparison"
]


def artifact_key(run_id: str, kind: ArtifactKind) -> str:
    """``<run id>-<kind>``, e.g. ``tiny-local-3f2a9c1b-loss-curve``."""
    return f"{run_id}-{kind}"
