"""Shard reads that hide the store's latency: up to K shards fetched ahead, and an optional local cache.

The loader asks for the shard its next rows are in, and says which shards come after it in the
seeded order; :class:`ShardReader` keeps that shard and fetches the next ``prefetch`` (K) of them on K
threads, so with K ≥ 1 a shard's download overlaps the reading of the one before it. Everything else
is dropped. Memory is bounded: per source and per loader process, at most K + 1 shards are held or in
flight. A download holds up to twice its tar bytes (the HTTP client's received chunks and their joined
copy), a decode its tar bytes and its tokens, a held shard its tokens, so the peak is below
``(K + 1) × (2 × tar bytes + token bytes)`` of the largest shard (measured by
``benchmarks/bench_data.py``). Every read goes through :func:`trainer.storage.read`: transient store
errors are retried with jittered exponential backoff, and a shard is checked against the card's
sha256 before use.

With a cache directory, verified shards are also kept on local disk under their sha256, so a second
epoch, a restarted job or another rank on the same host reads the disk instead of the store; the
least recently used files are deleted to stay under the size bound. Several processes may share one
cache directory (files are written under a unique name and renamed into place).

Settings come from the environment of the training processes, because they describe the host (its
local disk, its memory), not the run:

- ``TESSERA_DATA_PREFETCH``: K, shards fetched ahead per source (default 2; 0 fetches on demand).
- ``TESSERA_DATA_CACHE_DIR``: the local cache directory (default: none, no cache).
- ``TESSERA_DATA_CACHE_GB``: the cache's size bound in GB (default 50).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tarfile
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from webdataset.tariterators import group_by_keys, tar_file_expander

from trainer.data.card import DatasetCard, ShardInfo, TokenDtype
from trainer.data.errors import DataError
from trainer.data.shards import TOKENS_EXT
from trainer.storage import StoreNotFound, read

DEFAULT_PREFETCH = 2
DEFAULT_CACHE_GB = 50.0


@dataclass(frozen=True)
class FetchSettings:
    prefetch: int = DEFAULT_PREFETCH
    cache_dir: str | None = None
    cache_bytes: int = int(DEFAULT_CACHE_GB * 1e9)

    @classmethod
    def from_env(cls) -> FetchSettings:
        try:
            prefetch = int(os.environ.get("TESSERA_DATA_PREFETCH", DEFAULT_PREFETCH))
            cache_gb = float(os.environ.get("TESSERA_DATA_CACHE_GB", DEFAULT_CACHE_GB))
        except ValueError as error:
            raise DataError(
                f"TESSERA_DATA_PREFETCH / TESSERA_DATA_CACHE_GB must be numbers ({error})"
            ) from None
        if prefetch < 0 or cache_gb <= 0:
            raise DataError("TESSERA_DATA_PREFETCH must be >= 0 and TESSERA_DATA_CACHE_GB > 0")
        return cls(prefetch, os.environ.get("TESSERA_DATA_CACHE_DIR") or None, int(cache_gb * 1e9))


class ShardCache:
    """Verified shards on local disk, named by sha256, least recently used deleted beyond ``max_bytes``."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory, self.max_bytes = Path(directory), max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)

    def get(self, shard: ShardInfo) -> bytes | None:
        path = self.directory / f"{shard.sha256}.tar"
        try:
            data = path.read_bytes()
            os.utime(path)  # recently used
        except FileNotFoundError:
            return None
        return data if hashlib.sha256(data).hexdigest() == shard.sha256 else None

    def put(self, shard: ShardInfo, data: bytes) -> None:
        path = self.directory / f"{shard.sha256}.tar"
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{id(data)}")
        tmp.write_bytes(data)
        tmp.replace(path)
        self._evict()

    def _evict(self) -> None:
        files = []
        for path in self.directory.glob("*.tar"):
            with contextlib.suppress(FileNotFoundError):  # another process evicted it first
                stat = path.stat()
                files.append((stat.st_mtime_ns, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                return
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            total -= size


class ShardReader:
    """A dataset's decoded shards by index: the one being read plus at most K fetched ahead."""

    def __init__(self, card: DatasetCard, shards: list[ShardInfo], settings: FetchSettings) -> None:
        self.card, self.shards, self.settings = card, shards, settings
        self.cache = ShardCache(settings.cache_dir, settings.cache_bytes) if settings.cache_dir else None
        self._held: OrderedDict[int, Future[np.ndarray]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None  # created on first use: after any worker fork

    def get(self, index: int, upcoming: list[int]) -> np.ndarray:
        """Shard ``index``, decoded; starts fetching the first K of ``upcoming`` (the shards read next)."""
        wanted = [index, *[i for i in dict.fromkeys(upcoming) if i != index][: self.settings.prefetch]]
        for stale in [i for i in self._held if i not in wanted]:
            del self._held[stale]
        for i in wanted:
            if i not in self._held:
                self._pool = self._pool or ThreadPoolExecutor(
                    max(1, self.settings.prefetch), thread_name_prefix="shard-prefetch"
                )
                self._held[i] = self._pool.submit(self._fetch, self.shards[i])
        return self._held[index].result()

    def close(self) -> None:
        """Drop the held shards and stop the fetch threads, waiting for downloads already under way.

        A download left running would outlive its loader and could still write into the cache,
        evicting under this reader's size bound what a newer reader has just cached.
        """
        self._held.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __getstate__(self) -> dict[str, object]:
        """Pickled into loader worker processes without threads or shards: each worker fetches its own."""
        return {**self.__dict__, "_held": OrderedDict(), "_pool": None}

    def _fetch(self, shard: ShardInfo) -> np.ndarray:
        data = self.cache.get(shard) if self.cache else None
        if data is None:
            data = fetch_verified(self.card.url_of(shard.name), shard)
            if self.cache:
                self.cache.put(shard, data)
        return decode_shard(data, self.card.dtype, self.card.sample_len, shard.name)


def decode_shard(data: bytes, dtype: TokenDtype, sample_len: int, name: str) -> np.ndarray:
    """All samples of a shard as an array [samples, sample_len], in stored order.

    Each sample is copied into the output as soon as webdataset yields it, so decoding holds the tar
    bytes, the tokens and one sample at a time: the memory bound of the module docstring.
    """
    count = _check_members(data, np.dtype(dtype).itemsize * sample_len, name)
    tokens = np.empty((count, sample_len), dtype=dtype)
    stream = [{"url": name, "stream": io.BytesIO(data)}]
    decoded = 0
    try:
        for sample in group_by_keys(tar_file_expander(stream)):
            row = np.frombuffer(sample[TOKENS_EXT], dtype=dtype)
            if decoded == count or len(row) != sample_len:
                break
            tokens[decoded] = row
            decoded += 1
        else:
            if decoded == count and count:
                return tokens
    except Exception as error:
        raise DataError(f"shard {name} is not a readable tar of token samples ({error})") from error
    raise DataError(f"shard {name} holds samples of the wrong length (want {sample_len} tokens)")


def _check_members(data: bytes, sample_bytes: int, name: str) -> int:
    """Refuse a shard that would expand beyond its own bytes before anything is extracted; returns how
    many members it has (one per sample).

    A card's sha256 only proves the shard is the one that was listed, not that it is harmless: a
    compressed tar (which ``tarfile`` would open transparently) or a sparse member can expand a
    megabyte into gigabytes. tessera writes plain tars whose members are one sample's tokens, so
    anything compressed, sparse or larger than a sample is not a tessera shard. Only the headers are
    read here.
    """
    count = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if member.issparse() or member.size > sample_bytes:
                    raise DataError(
                        f"shard {name} has a member {member.name!r} of {member.size} bytes; a tessera "
                        f"shard holds plain samples of {sample_bytes} bytes: re-run data preparation"
                    )
                count += 1
    except tarfile.ReadError as error:
        raise DataError(
            f"shard {name} is not a plain (uncompressed) tar of token samples ({error}); re-run data preparation"
        ) from error
    return count


def fetch_shard(url: str, shard: ShardInfo, dtype: TokenDtype, sample_len: int) -> np.ndarray:
    """Download one shard, check it, and decode it: ``[samples, sample_len]`` in stored order."""
    return decode_shard(fetch_verified(url, shard), dtype, sample_len, url)


def fetch_verified(url: str, shard: ShardInfo) -> bytes:
    """Download one shard (retried on transient errors) and check its sha256 against the card."""
    try:
        data = read(url)
    except StoreNotFound as error:
        raise DataError(f"shard {url} listed in the card is missing; re-run data preparation") from error
    digest = hashlib.sha256(data).hexdigest()
    if digest != shard.sha256:
        raise DataError(
            f"shard {url} is corrupt: sha256 {digest[:12]}… but the card says "
            f"{shard.sha256[:12]}…; re-run data preparation"
        )
    return data
