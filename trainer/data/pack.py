"""Split documents into train and val, and pack token streams into fixed-length samples.

Documents are concatenated with ``<|endoftext|>`` after each one and cut into ``seq_len + 1``
token samples (inputs are the first ``seq_len``, targets the last ``seq_len``): no padding, so
every token trains; the tail shorter than one sample is dropped and counted.
"""

from __future__ import annotations

import numpy as np


def split_documents(num_documents: int, validation_fraction: float, seed: list[int]) -> dict[str, list[int]]:
    """Document indices of the train and val splits of one part: a seeded choice of whole documents.

    The number held out is ``num_documents × validation_fraction`` rounded up or down at random (seeded):
    a corpus of many small parts then holds out the fraction asked for on average, where rounding each
    part the same way would hold out too many or too few.
    """
    rng = np.random.default_rng(seed)
    num_val = min(int(num_documents * validation_fraction + rng.random()), max(num_documents - 1, 0))
    held_out = rng.permutation(num_documents)[:num_val]
    is_val = np.zeros(num_documents, dtype=bool)
    is_val[held_out] = True
    return {"train": np.flatnonzero(~is_val).tolist(), "val": np.flatnonzero(is_val).tolist()}


class Packer:
    """Cuts a token stream into ``sample_len`` rows; carries the remainder to the next chunk."""

    def __init__(self, sample_len: int) -> None:
        self.sample_len = sample_len
        self._carry = np.empty(0, dtype=np.int32)
        self.tokens_in = 0

    def add(self, tokens: np.ndarray) -> np.ndarray:
        """Full samples available after appending ``tokens``: shape [n, sample_len]."""
        self.tokens_in += len(tokens)
        stream = np.concatenate([self._carry, tokens]) if len(self._carry) else tokens
        full = len(stream) // self.sample_len * self.sample_len
        self._carry = stream[full:].copy()
        return stream[:full].reshape(-1, self.sample_len)

    @property
    def tokens_dropped(self) -> int:
        """Tokens left over at the end: fewer than one sample, so never trained on."""
        return len(self._carry)
