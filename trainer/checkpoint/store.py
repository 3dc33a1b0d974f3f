"""fsspec access to checkpoint URLs (local path, gs://, s3://) and the DCP storage plugins for them.

Object-store credentials and endpoints come from the environment (``STORAGE_EMULATOR_HOST``,
``AWS_ENDPOINT_URL``, ...), so a URL alone names a checkpoint everywhere.
"""

from __future__ import annotations

import hashlib
import io
import os
from contextlib import AbstractContextManager

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from trainer.checkpoint.errors import CheckpointStoreError

_HASH_CHUNK = 8 << 20
_READ_BLOCK = 16 << 20


def open_url(url: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem and in-store path of ``url``; an unusable URL is one clear error naming it."""
    try:
        return url_to_fs(url)
    except (ValueError, ImportError) as exc:
        raise CheckpointStoreError(
            f"checkpoint URL {url!r} is not usable ({exc}); use a local path, gs://bucket/path or s3://bucket/path"
        ) from None


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def is_local(url: str) -> bool:
    return isinstance(open_url(url)[0], LocalFileSystem)


def ensure_dir(url: str) -> None:
    """Create ``url`` (no-op on object stores, where directories are implicit); fail naming it."""
    fs, path = open_url(url)
    try:
        fs.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise CheckpointStoreError(f"cannot create checkpoint directory {url!r}: {exc}") from None


def write_atomic(url: str, data: bytes) -> None:
    """Readers see the old object or the new one, never a torn write.

    An object-store PUT is atomic already; a local file is written beside and renamed over.
    """
    fs, path = open_url(url)
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
        super().__init__(path, sync_files=False)
        self.fs = _ObjectStoreFileSystem()
        self.path = self.fs.init_path(path)


class ObjectStoreReader(FsspecReader):
    """FsspecReader with block-cached reads."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.fs = _ObjectStoreFileSystem()
        self.path = self.fs.init_path(path)


def storage_writer(url: str) -> StorageWriter:
    return FileSystemWriter(open_url(url)[1]) if is_local(url) else ObjectStoreWriter(url)


def storage_reader(url: str) -> StorageReader:
    return FileSystemReader(open_url(url)[1]) if is_local(url) else ObjectStoreReader(url)
