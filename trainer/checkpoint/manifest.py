"""The ``tessera.json`` manifest: written last, so its presence with status ``committed`` is the commit.

A step directory without one is a partial write (a save that was killed) and is never resumed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from trainer.checkpoint import store

MANIFEST_NAME = "tessera.json"
FORMAT_VERSION = 1
Status = Literal["committed", "validated", "corrupt"]
GOOD_STATUSES: tuple[Status, ...] = ("committed", "validated")
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class FileDigest:
    sha256: str
    size: int


@dataclass
class Manifest:
    """What was saved, by whom, and whether it is trustworthy; ``url`` is where it was read from."""

    step: int
    tokens: int
    model_fingerprint: str
    world_size: int
    layout: dict[str, Any]
    files: dict[str, FileDigest]
    status: Status = "committed"
    reason: str = ""
    saved_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    meta: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT_VERSION
    url: str = field(default="", compare=False)

    @property
    def good(self) -> bool:
        return self.status in GOOD_STATUSES

    def to_json(self) -> bytes:
        body = dataclasses.asdict(self)
        del body["url"]
        return json.dumps(body, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, url: str) -> Manifest:
        body = json.loads(data)
        body["files"] = {name: FileDigest(**digest) for name, digest in body["files"].items()}
        return cls(**body, url=url)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def write_manifest(manifest: Manifest, step_url: str) -> None:
    store.write_atomic(store.join(step_url, MANIFEST_NAME), manifest.to_json())
    manifest.url = step_url


def read_manifest(step_url: str) -> Manifest | None:
    """The manifest of one checkpoint directory, or None when there is none (a partial write)."""
    url = store.join(step_url, MANIFEST_NAME)
    fs, path = store.open_url(url)
    with store.store_errors("read", url):
        try:
            data = fs.cat_file(path)
        except FileNotFoundError:
            return None
    return Manifest.from_json(data, step_url.rstrip("/"))


def step_dirs(url: str) -> dict[int, str]:
    """Every ``step-N`` directory under ``url`` (committed or not), by step; {} if ``url`` is absent."""
    fs, root = store.open_url(url)
    fs.invalidate_cache(root)  # another process may have written since this fs instance last listed
    with store.store_errors("list checkpoints at", url):
        try:
            entries = fs.ls(root, detail=False)
        except FileNotFoundError:
            return {}
    steps = {}
    for entry in entries:
        match = _STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if match:
            steps[int(match.group(1))] = store.join(url, match.group(0))
    return steps


def list_checkpoints(url: str) -> list[Manifest]:
    """Every checkpoint under ``url`` that has a manifest (any status), oldest first."""
    manifests = (read_manifest(step_url) for _, step_url in sorted(step_dirs(url).items()))
    return [m for m in manifests if m is not None]


def checkpoint_files(step_url: str) -> dict[str, dict[str, Any]]:
    """fsspec info of every file in a checkpoint directory except the manifest, by file name, from a
    fresh listing (another process may have written since this fs instance last listed)."""
    fs, root = store.open_url(step_url)
    fs.invalidate_cache(root)
    with store.store_errors("list", step_url):
        infos = fs.ls(root, detail=True)
    named = ((info["name"].rstrip("/").rsplit("/", 1)[-1], info) for info in infos)
    return {
        name: info for name, info in named if info["type"] == "file" and not name.startswith(MANIFEST_NAME)
    }


def digest_files(step_url: str) -> dict[str, FileDigest]:
    """sha256 and size of every file in a checkpoint directory except the manifest."""
    fs, _ = store.open_url(step_url)
    with store.store_errors("hash the files of", step_url):
        return {
            name: FileDigest(sha256=store.sha256_of(fs, info["name"]), size=int(info["size"]))
            for name, info in sorted(checkpoint_files(step_url).items())
        }
