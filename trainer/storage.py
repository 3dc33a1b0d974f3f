"""Every file tessera keeps in a store: dataset shards and cards, tokenizers, checkpoint commit records.

One layer, so that a local path, ``gs://`` and ``s3://`` behave alike for all of them:

* **Retries, in two layers.** The store's client retries each request (botocore's ``standard`` mode:
  5xx, throttling and dropped connections with jittered backoff, ``AWS_MAX_ATTEMPTS`` attempts;
  gcsfs does the same on its own), and every call here is retried whole by :func:`retrying` when the
  error is transient (:func:`is_transient`). A missing file or a denied request is never retried.
* **Errors name the URL.** Every failure is one :class:`StoreError` line, ``cannot <action> <url>:
  <type>: <first line>``, with the store's own exception as its ``__cause__``:
  ``trainer.failures.is_infra_error`` reads it to retry a 503 but not a 403. Callers relabel it with
  their own words and error type through :func:`store_errors`.
* **Writes are atomic.** Readers see the old object or the new one, never a torn write.

Credentials and endpoints come from the environment (``STORAGE_EMULATOR_HOST``, ``AWS_ENDPOINT_URL``,
...), so a URL alone names a file everywhere. DCP's own checkpoint I/O is in
:mod:`trainer.checkpoint.store`, on top of this module.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

# gcsfs probes every bucket for hierarchical namespaces over gRPC unless this is off; against the
# emulator (and any endpoint without that API) each probe hangs ~60 s. Must be set before import.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from fsspec import AbstractFileSystem
from fsspec.core import split_protocol, url_to_fs
from fsspec.implementations.local import LocalFileSystem

from trainer.units import MiB

T = TypeVar("T")
log = logging.getLogger(__name__)

RETRY_ATTEMPTS = 6
RETRY_BASE_DELAY_S = 0.2
_HASH_CHUNK = 8 * MiB
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# s3fs maps 503 SlowDown/ServiceUnavailable to EBUSY; the others are dropped or stalled connections.
_TRANSIENT_ERRNO = {
    errno.EBUSY,
    errno.EAGAIN,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
}
# Last resort for client libraries that raise bare exceptions for dropped connections.
_TRANSIENT_WORDS = ("slowdown", "service unavailable", "connection reset", "server disconnected", "timed out")
# Per-request retries by the client (see the module docstring); gcsfs needs no option for them.
_STORAGE_OPTIONS: dict[str, dict[str, Any]] = {"s3": {"config_kwargs": {"retries": {"mode": "standard"}}}}


class StoreError(Exception):
    """A store call failed: one line naming the URL; the store's own exception is the ``__cause__``."""


class StoreNotFound(StoreError):
    """Nothing is stored at the URL: a state the caller can expect, so it gets a type of its own."""


@dataclass(frozen=True)
class Entry:
    """One item of a directory listing."""

    name: str  # the last part of the URL
    url: str
    size: int
    is_file: bool


def storage_options(url: str) -> dict[str, Any]:
    """The fsspec options of every filesystem opened here (and by DCP's fsspec plugins)."""
    return _STORAGE_OPTIONS.get(split_protocol(url)[0] or "file", {})


def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem and in-store path of ``url``; an unusable URL is one clear error naming it."""
    try:
        return url_to_fs(url, **storage_options(url))
    except (ValueError, ImportError) as exc:
        raise StoreError(
            f"store URL {url!r} is not usable ({exc}); use a local path, gs://bucket/path or s3://bucket/path"
        ) from None


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def is_transient(error: BaseException) -> bool:
    """True for errors a retry can fix: dropped connections, timeouts, 5xx/429 from the store."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNO:
        return True
    for attr in ("code", "status", "status_code"):
        status = getattr(error, attr, None)
        if isinstance(status, int) and status in _TRANSIENT_STATUS:
            return True
    text = str(error).lower()
    return any(word in text for word in _TRANSIENT_WORDS)


def retrying(action: Callable[[], T], what: str, attempts: int = RETRY_ATTEMPTS) -> T:
    """Run ``action``, retrying transient store errors with jittered exponential backoff."""
    for attempt in range(attempts):
        try:
            return action()
        except Exception as error:
            if attempt == attempts - 1 or not is_transient(error):
                raise
            delay = RETRY_BASE_DELAY_S * 2**attempt * (0.5 + random.random())
            log.warning(
                "%s failed (%s: %s); retry %d in %.1fs", what, type(error).__name__, error, attempt + 1, delay
            )
            time.sleep(delay)
    raise AssertionError("unreachable")


@contextmanager
def store_errors(action: str, url: str, error: type[StoreError] = StoreError) -> Iterator[None]:
    """Any failure inside as one ``error``: ``cannot <action> <url>: <type>: <first line>``.

    A :class:`StoreError` from a call inside is relabelled with this caller's words and error type
    (``cannot list checkpoints at ...`` says more than ``cannot list ...``), its cause kept; one
    without a cause (an unusable URL) keeps its message. A missing file becomes :class:`StoreNotFound`.
    """
    try:
        yield
    except error:
        raise
    except Exception as exc:
        cause = exc.__cause__ if isinstance(exc, StoreError) else exc
        if cause is None:
            raise error(str(exc)) from None
        if error is StoreError and isinstance(cause, FileNotFoundError):
            error = StoreNotFound
        first_line = next(iter(str(cause).splitlines()), "")
        raise error(f"cannot {action} {url!r}: {type(cause).__name__}: {first_line}") from cause


def _call(action: str, url: str, operation: Callable[[AbstractFileSystem, str], T]) -> T:
    """``operation(fs, path)`` on ``url``'s store, retried and with its errors naming ``url``."""
    with store_errors(action, url):
        fs, path = filesystem(url)
        return retrying(lambda: operation(fs, path), f"{action} {url}")


def read(url: str) -> bytes:
    """The whole object at ``url``; :class:`StoreNotFound` if there is none."""
    return _call("read", url, lambda fs, path: fs.cat_file(path))


def write_atomic(url: str, data: bytes) -> None:
    """Write a whole object; readers see the old one or the new one, never a torn write.

    An object-store PUT is atomic already. A local file is written beside, under a name of this
    process's own (two processes writing the same file never share a half-written one), and renamed
    over the target.
    """

    def write(fs: AbstractFileSystem, path: str) -> None:
        if not isinstance(fs, LocalFileSystem):
            fs.pipe_file(path, data)
            return
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            fs.pipe_file(tmp, data)
            os.replace(tmp, path)
        finally:  # a full disk must not also collect empty temporaries
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    _call("write", url, write)


def create_exclusive(url: str, data: bytes) -> bool:
    """Write ``url`` only if nothing is there, atomically; False if something was.

    The store decides, so two processes racing for one name cannot both win: a hard link on a local
    disk, ``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS (fsspec's ``mode="create"``).
    """

    def create(fs: AbstractFileSystem, path: str) -> bool:
        try:
            if isinstance(fs, LocalFileSystem):
                fs.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.tmp-{os.getpid()}"
                fs.pipe_file(tmp, data)
                try:
                    os.link(tmp, path)  # fails if path exists; readers never see a torn file
                finally:
                    os.unlink(tmp)
            else:
                fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    return _call("create", url, create)


def exists(url: str) -> bool:
    return _call("stat", url, lambda fs, path: fs.exists(path))


def list_dir(url: str) -> list[Entry]:
    """What is directly under ``url``, from a fresh listing (another process may have written since
    this filesystem instance last listed); :class:`StoreNotFound` if ``url`` is absent."""

    def ls(fs: AbstractFileSystem, path: str) -> list[dict[str, Any]]:
        fs.invalidate_cache(path)
        return fs.ls(path, detail=True)

    entries = []
    for info in _call("list", url, ls):
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        entries.append(Entry(name, join(url, name), int(info.get("size") or 0), info["type"] == "file"))
    return entries


def remove(url: str, recursive: bool = False) -> None:
    """Delete the file at ``url``, or with ``recursive`` everything under it."""
    _call("delete", url, lambda fs, path: fs.rm(path, recursive=recursive))


def ensure_dir(url: str) -> None:
    """Create the directory ``url`` (a no-op on object stores, where directories are implicit)."""
    _call("create directory", url, lambda fs, path: fs.makedirs(path, exist_ok=True))


def ensure_writable(url: str) -> None:
    """Write and delete a probe under ``url``: fail before any expensive work if it cannot be written."""
    probe = join(url, ".write-probe")
    write_atomic(probe, b"ok")
    remove(probe)


def sha256(url: str) -> str:
    """The sha256 of the object at ``url``, streamed: checkpoint shards do not fit in memory."""

    def digest(fs: AbstractFileSystem, path: str) -> str:
        hasher = hashlib.sha256()
        with fs.open(path, "rb") as stream:
            while chunk := stream.read(_HASH_CHUNK):
                hasher.update(chunk)
        return hasher.hexdigest()

    return _call("hash", url, digest)
