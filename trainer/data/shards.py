"""Write packed samples into webdataset tar shards and read them back, verified.

A sample is one tar member ``<key>.tokens``: ``seq_len + 1`` token ids as raw little-endian
integers of the manifest's dtype (uint16 for vocabularies up to 65536, else int32): half the bytes
of int32 for every model here, and no per-sample header as ``.npy`` would add.

A shard is built in memory (``samples_per_shard × (seq_len + 1)`` tokens: a few MB) and stored with
one retried put, so a shard in the store is always whole and its sha256 is known before it lands.
Puts run on a few background threads so store latency overlaps packing the next shard.

Shards are written with ``tarfile`` in GNU format rather than webdataset's ``TarWriter``, which
always builds PAX headers: per-member header encoding was half the cost of sharding at seq_len 256.
They are plain webdataset shards, read back with webdataset's tar iterators.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from tqdm import tqdm
from webdataset.tariterators import group_by_keys, tar_file_expander

from trainer.data.errors import DataError
from trainer.data.fs import join, read_bytes, write_bytes
from trainer.data.manifest import ShardInfo, Split, TokenDtype

TOKENS_EXT = "tokens"
UPLOAD_THREADS = 4
# Fixed tar mtime: the same samples always produce byte-identical shards (and sha256s).
_TAR_MTIME = 0.0


def token_dtype(vocab_size: int) -> TokenDtype:
    return "uint16" if vocab_size <= 2**16 else "int32"


def shard_name(split: Split, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def encode_shard(samples: np.ndarray, dtype: TokenDtype, first_key: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for offset, row in enumerate(samples.astype(dtype, copy=False)):
            data = row.tobytes()
            member = tarfile.TarInfo(f"{first_key + offset:09d}.{TOKENS_EXT}")
            member.size, member.mtime = len(data), _TAR_MTIME
            tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def decode_shard(data: bytes, dtype: TokenDtype, sample_len: int, name: str) -> np.ndarray:
    """All samples of a shard as an array [samples, sample_len], in stored order."""
    try:
        members = group_by_keys(tar_file_expander([{"url": name, "stream": io.BytesIO(data)}]))
        rows = [np.frombuffer(sample[TOKENS_EXT], dtype=dtype) for sample in members]
    except Exception as error:
        raise DataError(f"shard {name} is not a readable tar of token samples ({error})") from error
    if not rows or any(len(row) != sample_len for row in rows):
        raise DataError(f"shard {name} holds samples of the wrong length (want {sample_len} tokens)")
    return np.stack(rows)


def fetch_shard(url: str, shard: ShardInfo, dtype: TokenDtype, sample_len: int) -> np.ndarray:
    """Download one shard, check its sha256 against the manifest, and decode it."""
    try:
        data = read_bytes(url)
    except FileNotFoundError as error:
        raise DataError(f"shard {url} listed in the manifest is missing; re-run data preparation") from error
    digest = hashlib.sha256(data).hexdigest()
    if digest != shard.sha256:
        raise DataError(
            f"shard {url} is corrupt: sha256 {digest[:12]}… but the manifest says "
            f"{shard.sha256[:12]}…; re-run data preparation"
        )
    return decode_shard(data, dtype, sample_len, url)


class ShardSink:
    """Collects packed samples of one split and writes a shard every ``samples_per_shard`` samples."""

    def __init__(
        self,
        dataset_url: str,
        split: Split,
        samples_per_shard: int,
        dtype: TokenDtype,
        progress: bool = False,
    ) -> None:
        self.dataset_url, self.split, self.dtype = dataset_url, split, dtype
        self.samples_per_shard = samples_per_shard
        self.shards: list[ShardInfo] = []
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._written_rows = 0
        self._uploads: list[Future[None]] = []
        self._pool = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix=f"{split}-shard-upload")
        self._bar = tqdm(desc=f"{split} shards", unit="shard", disable=not progress)

    def add(self, samples: np.ndarray) -> None:
        self._pending.append(samples)
        self._pending_rows += len(samples)
        while self._pending_rows >= self.samples_per_shard:
            rows = np.concatenate(self._pending)
            self._flush(rows[: self.samples_per_shard])
            rest = rows[self.samples_per_shard :]
            self._pending, self._pending_rows = [rest], len(rest)

    def close(self) -> list[ShardInfo]:
        """Write the last partial shard; returns every shard written, in order."""
        if self._pending_rows:
            self._flush(np.concatenate(self._pending))
        self._pending, self._pending_rows = [], 0
        with self._pool:
            for upload in self._uploads:
                upload.result()  # re-raises the first failed put
        self._bar.close()
        return self.shards

    def _flush(self, rows: np.ndarray) -> None:
        name = shard_name(self.split, len(self.shards))
        data = encode_shard(rows, self.dtype, self._written_rows)
        self._uploads.append(self._pool.submit(write_bytes, join(self.dataset_url, name), data))
        if len(self._uploads) > 2 * UPLOAD_THREADS:
            self._uploads[-2 * UPLOAD_THREADS - 1].result()  # bound the shards held in memory
        self.shards.append(
            ShardInfo(
                name=name,
                split=self.split,
                samples=len(rows),
                tokens=rows.size,
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        )
        self._written_rows += len(rows)
        self._bar.update()  # counts shards encoded; close() waits for their puts
