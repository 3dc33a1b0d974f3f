"""fsspec access to local paths, gs:// and s3:// with retries on transient store errors.

Everything the data pipeline reads or writes goes through here, so the retry policy and the
error messages are the same for shards, manifests and tokenizers.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time
from collections.abc import Callable
from typing import TypeVar

# gcsfs probes every bucket for hierarchical namespaces over gRPC unless this is off; against the
# emulator (and any endpoint without that API) each probe hangs ~60 s. Must be set before import.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import fsspec
from fsspec.implementations.local import LocalFileSystem

from trainer.data.errors import DataError

T = TypeVar("T")
log = logging.getLogger(__name__)

RETRY_ATTEMPTS = 6
RETRY_BASE_DELAY_S = 0.2
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


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the path inside it for a URL or a local path."""
    return fsspec.core.url_to_fs(url)


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


def read_bytes(url: str) -> bytes:
    def read() -> bytes:
        fs, path = filesystem(url)
        return fs.cat_file(path)

    return retrying(read, f"read {url}")


def write_bytes(url: str, data: bytes) -> None:
    """Write a whole object. Object stores make a single put atomic; locally we rename into place."""

    def write() -> None:
        fs, path = filesystem(url)
        if isinstance(fs, LocalFileSystem):
            fs.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}"
            fs.pipe_file(tmp, data)
            fs.mv(tmp, path)
        else:
            fs.pipe_file(path, data)

    retrying(write, f"write {url}")


def exists(url: str) -> bool:
    def check() -> bool:
        fs, path = filesystem(url)
        return fs.exists(path)

    return retrying(check, f"stat {url}")


def ensure_writable(url: str, field: str) -> None:
    """Fail before any expensive work if ``url`` cannot be written, naming the config field."""
    probe = join(url, ".write-probe")
    try:
        write_bytes(probe, b"ok")
        fs, path = filesystem(probe)
        retrying(lambda: fs.rm_file(path), f"delete {probe}")
    except Exception as error:
        raise DataError(
            f"{field}={url!r} is not writable ({type(error).__name__}: {error}); "
            "point it at a writable directory or bucket"
        ) from error
