"""Tokenize documents with batched ``datasets.map`` and pack them into fixed-length samples.

Documents are concatenated with ``<|endoftext|>`` after each one and cut into ``seq_len + 1``
token samples (inputs are the first ``seq_len``, targets the last ``seq_len``): no padding, so
every token trains; the tail shorter than one sample is dropped and counted.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import datasets
import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

MAP_BATCH_DOCUMENTS = 256


def split_documents(num_documents: int, validation_fraction: float, seed: int) -> dict[str, list[int]]:
    """Document indices of the train and val splits: a seeded choice of whole documents for val."""
    num_val = round(num_documents * validation_fraction)
    if validation_fraction > 0 and num_documents > 1:
        num_val = min(max(num_val, 1), num_documents - 1)  # both splits non-empty when asked for val
    held_out = np.random.default_rng(seed).permutation(num_documents)[:num_val]
    is_val = np.zeros(num_documents, dtype=bool)
    is_val[held_out] = True
    return {"train": np.flatnonzero(~is_val).tolist(), "val": np.flatnonzero(is_val).tolist()}


def _encode(batch: dict[str, list[str]], tokenizer: Tokenizer) -> dict[str, list[list[int]]]:
    return {"ids": [encoding.ids for encoding in tokenizer.encode_batch(batch["text"])]}


def tokenize(
    corpus: datasets.Dataset, tokenizer: Tokenizer, num_proc: int, progress: bool = False
) -> datasets.Dataset:
    """One ``ids`` row per document, computed by batched, optionally multi-process map."""
    if num_proc > 1:
        # Forked map workers would otherwise each start a Rust thread pool on top of the processes.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if progress:
        datasets.enable_progress_bars()
    return corpus.map(
        _encode,
        batched=True,
        batch_size=MAP_BATCH_DOCUMENTS,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=corpus.column_names,
        fn_kwargs={"tokenizer": tokenizer},
        features=datasets.Features({"ids": datasets.Sequence(datasets.Value("int32"))}),
        desc="tokenize" if progress else None,
    )


def token_stream(
    tokenized: datasets.Dataset, indices: list[int], eos_id: int, batch_documents: int = 4096
) -> Iterator[np.ndarray]:
    """The given documents' tokens, each followed by EOS, as flat int32 chunks straight from Arrow.

    EOS is inserted here, vectorised at the documents' end offsets, rather than appended to each
    Python list in ``map``: that copy cost a third as much as writing the shards.
    """
    for start in range(0, len(indices), batch_documents):
        table = tokenized.select(indices[start : start + batch_documents]).with_format("arrow")[:]
        ids = table.column("ids").combine_chunks()
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.chunk(0) if ids.num_chunks else pa.array([], type=pa.list_(pa.int32()))
        offsets = ids.offsets.to_numpy()
        yield np.insert(ids.flatten().to_numpy(zero_copy_only=False), offsets[1:] - offsets[0], eos_id)


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
