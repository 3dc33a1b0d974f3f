"""Write packed samples into webdataset tar shards and read them back, verified.

A sample is one tar member ``<key>.tokens``: ``seq_len + 1`` token ids as raw little-endian
integers of the card's dtype (uint16 for vocabularies up to 65536, else int32): half the bytes
of int32 for every model here, and no per-sample header as ``.npy`` would add.

A shard is built in memory (``samples_per_shard × (seq_len + 1)`` tokens: a few MB) and stored with
one retried put, so a shard in the store is always whole and its sha256 is known before it lands.
Puts run on a few background threads so store latency overlaps packing the next shard.

Shards are GNU-format tars rather than what webdataset's ``TarWriter`` writes, which always builds PAX
headers: per-member header encoding was half the cost of sharding at seq_len 256. Their headers are
filled in by numpy, byte for byte what ``tarfile`` writes. They are plain webdataset shards, read back with webdataset's tar iterators
(:func:`trainer.data.fetch.decode_shard`; webdataset imports torch, which writing does not need).
"""

from __future__ import annotations

import hashlib
import tarfile
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from trainer.data.card import ShardInfo, Split, TokenDtype
from trainer.storage import join, write_atomic

TOKENS_EXT = "tokens"
UPLOAD_THREADS = 4
KEY_DIGITS = 9  # sample keys within a split of a part: 000000000, 000000001, ...
# Fixed tar mtime: the same samples always produce byte-identical shards (and sha256s).
_TAR_MTIME = 0.0
_CHKSUM = slice(148, 156)  # a tar header's checksum field


def token_dtype(vocab_size: int) -> TokenDtype:
    return "uint16" if vocab_size <= 2**16 else "int32"


def shard_name(split: Split, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def encode_shard(samples: np.ndarray, dtype: TokenDtype, first_key: int) -> bytes:
    """The samples as a GNU tar, byte for byte what ``tarfile`` writes, with every header built at once.

    Every member has the same size, mode and mtime, so headers differ only in their 9-digit name and
    checksum: numpy fills those for the whole shard from one ``tarfile`` header, instead of ``tarfile``
    encoding each member in Python (a tenth of a part's preparation time at seq_len 256).
    ``tests/test_shards.py`` checks the bytes against ``tarfile``'s own.
    """
    rows = np.ascontiguousarray(samples.astype(dtype, copy=False))
    count, row_bytes = len(rows), rows.shape[1] * rows.itemsize
    if first_key + count > 10**KEY_DIGITS:
        raise ValueError(f"sample keys past {10**KEY_DIGITS - 1} do not fit a {KEY_DIGITS}-digit name")
    member = tarfile.TarInfo(f"{0:0{KEY_DIGITS}d}.{TOKENS_EXT}")
    member.size, member.mtime = row_bytes, _TAR_MTIME
    header = np.frombuffer(member.tobuf(tarfile.GNU_FORMAT), dtype=np.uint8)
    records = np.zeros((count, tarfile.BLOCKSIZE + row_bytes + -row_bytes % tarfile.BLOCKSIZE), np.uint8)
    headers = records[:, : tarfile.BLOCKSIZE]
    headers[:] = header
    keys = np.arange(first_key, first_key + count, dtype=np.int64)[:, None]
    headers[:, :KEY_DIGITS] = keys // 10 ** np.arange(KEY_DIGITS - 1, -1, -1) % 10 + ord("0")
    headers[:, _CHKSUM] = ord(" ")  # the checksum is over the header with its own field as spaces
    checksums = headers.sum(axis=1, dtype=np.int64)[:, None]
    headers[:, _CHKSUM.start : _CHKSUM.start + 6] = checksums // 8 ** np.arange(5, -1, -1) % 8 + ord("0")
    headers[:, _CHKSUM.start + 6] = 0  # tarfile's "%06o\0", then the field's last space
    records[:, tarfile.BLOCKSIZE : tarfile.BLOCKSIZE + row_bytes] = rows.view(np.uint8).reshape(count, -1)
    archive = records.tobytes() + bytes(2 * tarfile.BLOCKSIZE)  # end-of-archive: two zero blocks
    return archive + bytes(-len(archive) % tarfile.RECORDSIZE)


class ShardSink:
    """Collects packed samples of one split and writes a shard every ``samples_per_shard`` samples."""

    def __init__(
        self,
        dataset_url: str,
        split: Split,
        samples_per_shard: int,
        dtype: TokenDtype,
    ) -> None:
        self.dataset_url, self.split, self.dtype = dataset_url, split, dtype
        self.samples_per_shard = samples_per_shard
        self.shards: list[ShardInfo] = []
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._written_rows = 0
        self._uploads: list[Future[None]] = []
        self._pool = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix=f"{split}-shard-upload")

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
        return self.shards

    def _flush(self, rows: np.ndarray) -> None:
        name = shard_name(self.split, len(self.shards))
        data = encode_shard(rows, self.dtype, self._written_rows)
        self._uploads.append(self._pool.submit(write_atomic, join(self.dataset_url, name), data))
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
