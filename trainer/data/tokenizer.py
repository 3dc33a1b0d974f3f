"""Byte-level BPE: trained on the corpus to the model's vocabulary size, or loaded from a file.

Byte-level means every input string encodes (no unknown tokens), which is what a corpus of source
code and arbitrary text needs. ``<|endoftext|>`` is the only special token; it separates documents.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.data.errors import DataError
from trainer.storage import StoreNotFound, read

EOS = "<|endoftext|>"
# 256 byte symbols + the EOS token: a smaller vocabulary cannot represent every input.
MIN_VOCAB_SIZE = 257


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries at most (fewer if the corpus runs out of merges)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"model.vocab_size={vocab_size} is too small for a byte-level BPE; use >= {MIN_VOCAB_SIZE}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def read_tokenizer_bytes(url: str) -> bytes:
    try:
        return read(url)
    except StoreNotFound as error:
        raise DataError(
            f"tokenizer {url!r} does not exist; set data.tokenizer to a tokenizer.json or "
            "leave it empty to train one"
        ) from error


def parse_tokenizer(data: bytes, url: str, vocab_size: int) -> Tokenizer:
    """A tokenizer.json that fits the model: parses, has the EOS token, ids below ``vocab_size``."""
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as error:
        raise DataError(f"tokenizer {url!r} is not a valid tokenizer.json ({error})") from error
    if tokenizer.token_to_id(EOS) is None:
        raise DataError(f"tokenizer {url!r} has no {EOS} token; add it as a special token")
    if tokenizer.get_vocab_size() > vocab_size:
        raise DataError(
            f"tokenizer {url!r} has {tokenizer.get_vocab_size()} tokens but model.vocab_size="
            f"{vocab_size}; raise model.vocab_size to at least that"
        )
    return tokenizer
