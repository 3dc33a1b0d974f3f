"""Shards are byte-for-byte the GNU tars ``tarfile`` writes, so their sha256s never depend on the writer."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from trainer.data.shards import KEY_DIGITS, TOKENS_EXT, encode_shard


def tarfile_shard(samples: np.ndarray, first_key: int) -> bytes:
    """The reference: one ``tarfile`` member per sample, as shards were written before."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for offset, row in enumerate(samples):
            data = row.tobytes()
            member = tarfile.TarInfo(f"{first_key + offset:09d}.{TOKENS_EXT}")
            member.size, member.mtime = len(data), 0.0
            tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("rows", "tokens", "dtype", "first_key"),
    [
        (1, 257, np.uint16, 0),  # one member, data not a multiple of 512
        (37, 257, np.uint16, 123_456),  # keys of several digit counts' worth of checksum change
        (20, 256, np.uint16, 0),  # data exactly one block
        (5, 129, np.int32, 10**KEY_DIGITS - 5),  # int32 tokens; the last key that fits
        (64, 17, np.uint16, 7),  # archive length crossing a record boundary
    ],
)
def test_shards_are_byte_identical_to_tarfiles(rows: int, tokens: int, dtype: type, first_key: int) -> None:
    samples = np.random.default_rng(rows).integers(0, 60_000, size=(rows, tokens)).astype(dtype)
    expected = tarfile_shard(samples, first_key)
    dtype_name = "uint16" if dtype is np.uint16 else "int32"
    assert encode_shard(samples, dtype_name, first_key) == expected


def test_a_key_past_nine_digits_is_refused() -> None:
    samples = np.zeros((2, 8), dtype=np.uint16)
    with pytest.raises(ValueError, match="9-digit"):
        encode_shard(samples, "uint16", 10**KEY_DIGITS - 1)
