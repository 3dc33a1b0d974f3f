"""Deterministic synthetic samples for runs without a prepared dataset (``data_url=None``).

Sample ``i`` depends only on ``(seed, i)``, so the global sample order, the dp split and resume work
exactly as with real shards. Each sample is an arithmetic sequence modulo the vocabulary with a
random start and stride: random enough to not be memorised from one row, simple enough that the
loss visibly falls within a few steps (the next token follows from the previous two).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

MAX_STRIDE = 16


class SyntheticSamples:
    """An endless stream of ``sample_len``-token samples; epochs never end."""

    samples_per_epoch: int | None = None

    def __init__(self, seed: int, vocab_size: int, sample_len: int) -> None:
        self.seed, self.vocab_size, self.sample_len = seed, vocab_size, sample_len

    def state_at(self, sample: int) -> dict[str, object]:
        return {"epoch": 0}

    def resume(self, sample: int, state: Mapping[str, object]) -> None:
        """Nothing to restore: sample ``i`` depends on ``(seed, i)`` alone."""

    def close(self) -> None:
        """Nothing runs in the background."""

    def rows(self, start: int, count: int) -> np.ndarray:
        positions = np.arange(self.sample_len, dtype=np.int64)
        out = np.empty((count, self.sample_len), dtype=np.int64)
        for row, index in enumerate(range(start, start + count)):
            rng = np.random.default_rng([self.seed, index])
            first, stride = rng.integers(self.vocab_size), rng.integers(1, MAX_STRIDE + 1)
            out[row] = (first + stride * positions) % self.vocab_size
        return out
