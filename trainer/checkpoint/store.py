"""fsspec access to checkpoint URLs (local path, gs://, s3://) and the DCP storage plugins for them.

Object-store credentials and endpoints come from the environment (``STORAGE_EMULATOR_HOST``,
``AWS_ENDPOINT_URL``, ...), so a URL alone names a checkpoint everywhere.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch.distributed.checkpoint as dcp
from fsspec import AbstractFileSystem
from fsspec.core import split_protocol, url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from trainer.checkpoint.errors import CheckpointError, CheckpointStoreError
from trainer.checkpoint.safe_load import SafeLoadPlanner, SafeMetadataReader

_HASH_CHUNK = 8 << 20
_READ_BLOCK = 16 << 20


# Per-request retries with backoff, by the store's own client: a checkpoint save is hundreds of
# requests from many ranks at once, and only the failed request can be retried without redoing the
# save. botocore's "standard" mode retries 5xx, throttling and dropped connections with jittered
# exponential backoff under a retry quota (attempts: AWS_MAX_ATTEMPTS, default 3); gcsfs retries 5xx
# and 429 on its own.
_STORAGE_OPTIONS: dict[str, dict[str, Any]] = {"s3": {"config_kwargs": {"retries": {"mode": "standard"}}}}


def storage_options(url: str) -> dict[str, Any]:
    return _STORAGE_OPTIONS.get(split_protocol(url)[0] or "file", {})


def open_url(url: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem and in-store path of ``url``; an unusable URL is one clear error naming it."""
    try:
        return url_to_fs(url, **storage_options(url))
    except (ValueError, ImportError) as exc:
        raise CheckpointStoreError(
            f"checkpoint URL {url!r} is not usable ({exc}); use a local path, gs://bucket/path or s3://bucket/path"
        ) from None


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def is_local(url: str) -> bool:
    return isinstance(open_url(url)[0], LocalFileSystem)


@contextmanager
def store_errors(action: str, url: str) -> Iterator[None]:
    """A failing store call as one :class:`CheckpointStoreError` line: ``cannot <action> <url>: ...``.

    botocore and gcsfs errors are not all ``OSError``s; the original stays the ``__cause__``, which
    ``trainer.failures.is_infra_error`` reads to retry a 503 but not a 403.
    """
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        first_line = next(iter(str(exc).splitlines()), "")
        raise CheckpointStoreError(f"cannot {action} {url!r}: {type(exc).__name__}: {first_line}") from exc


def ensure_dir(url: str) -> None:
    """Create ``url`` (no-op on object stores, where directories are implicit); fail naming it."""
    fs, path = open_url(url)
    with store_errors("create checkpoint directory", url):
        fs.makedirs(path, exist_ok=True)


def write_atomic(url: str, data: bytes) -> None:
    """Readers see the old object or the new one, never a torn write.

    An object-store PUT is atomic already; a local file is written beside and renamed over.
    """
    fs, path = open_url(url)
    with store_errors("write", url):
        if isinstance(fs, LocalFileSystem):
            tmp = f"{path}.tmp"
            fs.pipe_file(tmp, data)
            os.replace(tmp, path)
        else:
            fs.pipe_file(path, data)


def sha256_of(fs: AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _ObjectStoreFileSystem(FileSystem):
    """DCP's fsspec filesystem, tuned for object stores.

    - rename is copy + delete of the bytes: object stores have none, gcsfs/s3fs emulate it server-side,
      and the GCS emulator answers 501 first, costing ~30 s of retries. DCP renames only the small
      ``.metadata`` file, so copying it is cheap.
    - reads go through an LRU block cache: ``torch.load`` of each saved item seeks back to a zip
      directory, which the default read-ahead cache turns into one HTTP request per read.
    """

    def create_stream(self, path: str | os.PathLike, mode: str) -> AbstractContextManager[io.IOBase]:
        if "r" not in mode:
            return super().create_stream(path, mode)
        return self.fs.open(os.fspath(path), mode, cache_type="blockcache", block_size=_READ_BLOCK)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.fs.pipe_file(os.fspath(new_path), self.fs.cat_file(os.fspath(path)))
        self.fs.rm(os.fspath(path))


class ObjectStoreWriter(FsspecWriter):
    """FsspecWriter for object stores: copy-rename, and no fsync (closing an upload commits it; the
    fallback of fsync on a non-file stream is a machine-wide ``os.sync()``)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=False, **storage_options(path))
        self.fs = _ObjectStoreFileSystem()
        self.path = self.fs.init_path(path, **storage_options(path))


class LocalReader(SafeMetadataReader, FileSystemReader):
    """FileSystemReader that reads the index without unpickling arbitrary objects."""


class ObjectStoreReader(SafeMetadataReader, FsspecReader):
    """FsspecReader with block-cached reads and the safe index reader."""

    def __init__(self, path: str) -> None:
        super().__init__(path, **storage_options(path))
        self.fs = _ObjectStoreFileSystem()
        self.path = self.fs.init_path(path, **storage_options(path))


def storage_writer(url: str) -> StorageWriter:
    return FileSystemWriter(open_url(url)[1]) if is_local(url) else ObjectStoreWriter(url)


def storage_reader(url: str) -> StorageReader:
    return LocalReader(open_url(url)[1]) if is_local(url) else ObjectStoreReader(url)


def load(state: dict[str, Any], url: str, no_dist: bool, reader: StorageReader | None = None) -> None:
    """``dcp.load`` of the checkpoint at ``url`` into ``state`` in place, executing nothing it holds
    (see :mod:`trainer.checkpoint.safe_load`). Every checkpoint read goes through here.

    Failures are one :class:`CheckpointError` line naming ``url`` (see :func:`dcp_errors`). Pass the
    ``reader`` of ``url`` if the caller has already read the index through it.
    """
    reader = reader or storage_reader(url)
    reader.read_metadata()  # refuse a planted or garbled index here, before DCP folds it into its error
    with dcp_errors("loading", url):
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)


@contextmanager
def dcp_errors(action: str, url: str) -> Iterator[None]:
    """DCP's multi-rank ``CheckpointException`` as one :class:`CheckpointError` line naming ``url``.

    DCP's exception is a ``BaseException`` (it slips past ``except Exception``) with every rank's
    traceback in its message. The first rank's failure becomes the ``__cause__``, so
    ``trainer.failures.is_infra_error`` tells a 503 that outlasted the retries (retry the attempt)
    from a denied request or a corrupt file (don't).
    """
    try:
        yield
    except CheckpointException as exc:
        failures = [failure for failure, _ in exc.failures.values()]
        ours = [failure for failure in failures if isinstance(failure, CheckpointError)]
        if ours:
            raise ours[0] from None
        rank, cause = next(iter(exc.failures)), failures[0]
        first_line = next(iter(str(cause).splitlines()), "")
        raise CheckpointStoreError(
            f"{action} checkpoint {url} failed on rank {rank}: {type(cause).__name__}: {first_line}"
        ) from cause
