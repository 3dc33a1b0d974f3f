"""DCP's storage plugins for checkpoint URLs (local path, gs://, s3://), on top of :mod:`trainer.storage`.

Every other checkpoint file operation (records, listings, deletes) calls :mod:`trainer.storage`
directly, inside :func:`store_errors`, so that its failures reach callers as :class:`CheckpointStoreError`.
"""

from __future__ import annotations

import errno
import io
import os
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem as LocalFileSystemPlugin
from torch.distributed.checkpoint.storage import StorageReader

from trainer import storage
from trainer.checkpoint.digests import DigestingWriter, HashingFileSystem
from trainer.checkpoint.errors import CheckpointError, CheckpointStoreError
from trainer.checkpoint.safe_load import SafeLoadPlanner, SafeMetadataReader
from trainer.units import MiB

# torch warns "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to
# load (save) in a single process" on every dcp call with no_dist=True, which states that intent: in
# evaluation, export and import it is only noise in the user's terminal.
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)

_READ_BLOCK = 16 * MiB
# DCP's FileSystemWriter writes one file per thread (the rank's tensors split evenly by size): one
# thread, its default, left a 13.6 GB save on an H200 at 0.32 GB/s, below what one stream of that disk
# takes. Each thread serialises and fsyncs its own file, so the disk sees several streams at once;
# beyond the host's cores they would only contend for them.
WRITER_THREADS = min(8, os.cpu_count() or 1)


def store_errors(action: str, url: str) -> AbstractContextManager[None]:
    """A failing storage call as one :class:`CheckpointStoreError` line: ``cannot <action> <url>: ...``.

    The store's own exception stays the ``__cause__``, which ``trainer.failures.is_infra_error``
    reads to retry a 503 but not a 403.
    """
    return storage.store_errors(action, url, CheckpointStoreError)


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


class _HashingLocalFileSystem(HashingFileSystem, LocalFileSystemPlugin):
    """DCP's local filesystem, hashing every file it writes (:mod:`trainer.checkpoint.digests`)."""


class _HashingObjectStoreFileSystem(HashingFileSystem, _ObjectStoreFileSystem):
    """The object-store filesystem above, hashing every file it writes."""


class LocalWriter(DigestingWriter, FileSystemWriter):
    """FileSystemWriter, ``WRITER_THREADS`` files per rank, each file hashed as it is written."""

    def __init__(self, path: str) -> None:
        super().__init__(path, thread_count=WRITER_THREADS)
        self.fs = _HashingLocalFileSystem()


class ObjectStoreWriter(DigestingWriter, FsspecWriter):
    """FsspecWriter for object stores: copy-rename, each file hashed as it is uploaded, and no fsync
    (closing an upload commits it; the fallback of fsync on a non-file stream is a machine-wide
    ``os.sync()``)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=False, thread_count=WRITER_THREADS, **storage.storage_options(path))
        self.fs = _HashingObjectStoreFileSystem()
        self.path = self.fs.init_path(path, **storage.storage_options(path))


class LocalReader(SafeMetadataReader, FileSystemReader):
    """FileSystemReader that reads the index without unpickling arbitrary objects."""


class ObjectStoreReader(SafeMetadataReader, FsspecReader):
    """FsspecReader with block-cached reads and the safe index reader."""

    def __init__(self, path: str) -> None:
        super().__init__(path, **storage.storage_options(path))
        self.fs = _ObjectStoreFileSystem()
        self.path = self.fs.init_path(path, **storage.storage_options(path))


def storage_writer(url: str) -> DigestingWriter:
    """DCP's writer for ``url``: ``WRITER_THREADS`` files per rank, each written by its own thread and
    hashed on the way (``dcp.save``'s result then carries every file's digest: ``written_digests``)."""
    path = _local_path(url)
    return ObjectStoreWriter(url) if path is None else LocalWriter(path)


def storage_reader(url: str) -> StorageReader:
    path = _local_path(url)
    return LocalReader(path) if path is not None else ObjectStoreReader(url)


def _local_path(url: str) -> str | None:
    """The path of a local ``url``, which DCP's plain file plugins serve; None for an object store."""
    with store_errors("open", url):
        fs, path = storage.filesystem(url)
    return path if isinstance(fs, LocalFileSystem) else None


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


def out_of_space(error: BaseException) -> bool:
    """ENOSPC, however it surfaces: an OSError, or torch's zip writer failing mid-file ("unexpected
    pos", what a save into a disk that filled up says)."""
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "unexpected pos" in str(error)


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
        if out_of_space(cause):
            # torch's zip writer says only "unexpected pos N vs M" where the disk filled mid-file.
            reason = first_line if isinstance(cause, OSError) else os.strerror(errno.ENOSPC)
            raise CheckpointError(
                f"{action} checkpoint {url} failed on rank {rank}: out of space ({reason}); a run needs "
                "room for checkpoint.keep_last + 1 checkpoints (tessera plan shows their size): free space, "
                "lower keep_last or point checkpoint.url at a larger store"
            ) from cause
        raise CheckpointStoreError(
            f"{action} checkpoint {url} failed on rank {rank}: {type(cause).__name__}: {first_line}"
        ) from cause
