"""The ``tessera.json`` commit record: written last, so its presence with status ``committed`` is the commit.

A step directory without one is a partial write (a save that was killed) and is never resumed. Like
the dataset's card (:mod:`trainer.data.card`), it is written by ``write_commit(url, record)`` and
read by ``read_commit(url)``, which returns None when there is none. The file keeps its name
``tessera.json`` so existing checkpoints stay readable.
"""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError
from torch.distributed.checkpoint.metadata import Metadata

from trainer import storage
from trainer.checkpoint.digests import FileDigest, written_digests
from trainer.checkpoint.errors import CheckpointError, CheckpointMismatch
from trainer.checkpoint.store import WRITER_THREADS, store_errors

COMMIT_FILE = "tessera.json"
FORMAT_VERSION = 1
Status = Literal["committed", "validated", "corrupt"]
GOOD_STATUSES: tuple[Status, ...] = ("committed", "validated")
_STEP_DIR = re.compile(r"^step-(\d+)$")


# The meta key of a checkpoint written by an import (trainer/checkpoint/hf.py): where its weights came from.
IMPORTED_FROM = "imported_from"


@dataclass
class CommitRecord:
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

    @property
    def weights_only(self) -> bool:
        """An import (``tessera import``): the model's weights alone, no optimizer, RNG or loader state."""
        return IMPORTED_FROM in self.meta

    def to_json(self) -> bytes:
        body = dataclasses.asdict(self)
        del body["url"]
        return json.dumps(body, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, url: str) -> CommitRecord:
        """Parse and type-check a record; a damaged one raises ``pydantic.ValidationError``."""
        record = _COMMIT_RECORD.validate_json(data)
        record.url = url
        return record

    @classmethod
    def damaged(cls, step_url: str, error: ValidationError) -> CommitRecord:
        """What an unreadable record stands for: a corrupt checkpoint (resume skips it, retention
        removes it), with the parse error as the reason, rather than a crash on every attempt."""
        first = error.errors()[0]
        where = ".".join(map(str, first["loc"])) or "document"
        match = _STEP_DIR.match(step_url.rstrip("/").rsplit("/", 1)[-1])
        return cls(
            step=int(match.group(1)) if match else -1,
            tokens=0,
            model_fingerprint="",
            world_size=0,
            layout={},
            files={},
            status="corrupt",
            reason=f"unreadable {COMMIT_FILE} ({where}: {first['msg']})",
            url=step_url.rstrip("/"),
        )


_COMMIT_RECORD = TypeAdapter(CommitRecord)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def check_model(record: CommitRecord, model_fingerprint: str) -> None:
    """Refuse a checkpoint saved from another model shape before DCP fails on it deep in a load."""
    if record.model_fingerprint != model_fingerprint:
        raise CheckpointMismatch(
            f"checkpoint {record.url} holds model {record.model_fingerprint} but this job's model is "
            f"{model_fingerprint}; restore the original model config or use a new checkpoint.url"
        )


def write_commit(step_url: str, record: CommitRecord) -> str:
    """Write ``record`` into the checkpoint directory ``step_url`` atomically; returns its URL."""
    url = storage.join(step_url, COMMIT_FILE)
    with store_errors("write", url):
        storage.write_atomic(url, record.to_json())
    record.url = step_url.rstrip("/")
    return url


def read_commit(step_url: str) -> CommitRecord | None:
    """The record of one checkpoint directory, or None when there is none (a partial write).

    Never raises for the record's content: invalid JSON, ``{}`` or a missing key read as a corrupt
    checkpoint (:meth:`CommitRecord.damaged`); only the store itself failing raises."""
    url = storage.join(step_url, COMMIT_FILE)
    with store_errors("read", url):
        try:
            data = storage.read(url)
        except storage.StoreNotFound:
            return None
    try:
        return CommitRecord.from_json(data, step_url.rstrip("/"))
    except ValidationError as error:
        return CommitRecord.damaged(step_url, error)


def step_dirs(url: str) -> dict[int, str]:
    """Every ``step-N`` directory under ``url`` (committed or not), by step; {} if ``url`` is absent."""
    with store_errors("list checkpoints at", url):
        try:
            entries = storage.list_dir(url)
        except storage.StoreNotFound:
            return {}
    matches = ((_STEP_DIR.match(entry.name), entry.url) for entry in entries)
    return {int(match.group(1)): step_url for match, step_url in matches if match}


def list_checkpoints(url: str) -> list[CommitRecord]:
    """Every checkpoint under ``url`` that has a record (any status), oldest first."""
    records = (read_commit(step_url) for _, step_url in sorted(step_dirs(url).items()))
    return [m for m in records if m is not None]


def checkpoint_files(step_url: str) -> dict[str, storage.Entry]:
    """Every file in a checkpoint directory except the record (and its temporary copies), by name."""
    with store_errors("list", step_url):
        entries = storage.list_dir(step_url)
    return {e.name: e for e in entries if e.is_file and not e.name.startswith(COMMIT_FILE)}


def digest_files(step_url: str) -> dict[str, FileDigest]:
    """sha256 and size of every file in a checkpoint directory except the record, read back from the
    store: what validation compares with the record (a save's own commit uses the digests its writer
    computed while writing, :func:`saved_files`).

    One thread per file, as many as the writer used (``store.WRITER_THREADS`` files per rank): hashlib
    lets go of the GIL while it hashes, so the files are read at the disk's (or the page cache's)
    speed rather than at one core's sha256 rate."""
    files = sorted(checkpoint_files(step_url).items())
    with store_errors("hash the files of", step_url), ThreadPoolExecutor(WRITER_THREADS) as pool:
        hashes = pool.map(storage.sha256, [entry.url for _, entry in files])
        return {
            name: FileDigest(sha256=sha, size=entry.size)
            for (name, entry), sha in zip(files, hashes, strict=True)
        }


def saved_files(step_url: str, metadata: Metadata | None) -> dict[str, FileDigest]:
    """What to commit for the save that just wrote ``step_url``: every file's digest as the writer
    computed it while writing (``metadata`` is what ``dcp.save`` returned), checked against one listing
    of the directory, so that only files that are there, at the size written, are committed.

    Without the writer's digests (a writer other than ``store.storage_writer``'s) the files are hashed
    by reading them back."""
    written = written_digests(metadata)
    if written is None:
        return digest_files(step_url)
    stored = {name: entry.size for name, entry in checkpoint_files(step_url).items()}
    sizes = {name: digest.size for name, digest in written.items()}
    differ = sorted(
        f"{name} ({stored.get(name, 'missing')} bytes, {sizes.get(name, 'none')} written)"
        for name in stored.keys() | sizes.keys()
        if stored.get(name) != sizes.get(name)
    )
    if differ:
        raise CheckpointError(
            f"not committing {step_url}: its files are not what was written: {', '.join(differ)}"
        )
    return dict(sorted(written.items()))
