"""The dataset card, ``manifest.json``: the file contract between data prep and training.

A card lists a prepared dataset's shards (with sizes and sha256), its split totals, its tokenizer
and what filtering dropped. It is written last, after every shard and the tokenizer, so its presence
means the dataset under its directory is complete; the trainer and the evaluator only ever receive
its URL. Like the checkpoint's commit record (:mod:`trainer.checkpoint.commit`), it is written by
``write_card(url, card)`` and read by ``read_card(url)``, which returns None when there is none;
:func:`require_card` is the read for callers that cannot go on without one. The file keeps its name
``manifest.json`` (and a mixture's sources their ``manifest`` key) so existing stores stay readable.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from trainer.data.errors import DataError
from trainer.storage import StoreNotFound, join, read, write_atomic

CARD_FILE = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT_VERSION = 2  # 2: shards live in per-part directories shared between dataset versions
Split = Literal["train", "val"]
TokenDtype = Literal["uint16", "int32"]


class ShardInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str = Field(description="File name relative to the card's directory.")
    split: Split
    samples: int
    tokens: int
    bytes: int
    sha256: str


class SplitTotals(BaseModel):
    documents: int
    samples: int
    tokens: int = Field(description="Tokens in samples (samples × (seq_len + 1)).")
    tokens_dropped: int = Field(description="Tail tokens shorter than one sample, not stored.")
    shards: int
    bytes: int


class FilterReport(BaseModel):
    """The optional document filters a dataset was prepared with, and how many documents each dropped."""

    dedup: bool = Field(description="Exact duplicate documents dropped (the first occurrence kept).")
    min_chars: int
    max_chars: int | None
    duplicates: int = 0
    too_short: int = 0
    too_long: int = 0


class DatasetCard(BaseModel):
    format_version: int = FORMAT_VERSION
    fingerprint: str = Field(description="Hash of every input; the dataset's directory name.")
    inputs: dict[str, Any] = Field(description="What was hashed into the fingerprint, for humans.")
    seq_len: int
    sample_len: int = Field(description="seq_len + 1 tokens per stored sample: inputs and shifted targets.")
    dtype: TokenDtype
    vocab_size: int = Field(description="The model's vocabulary size; every token id is below it.")
    tokenizer: str = TOKENIZER
    tokenizer_vocab_size: int
    tokenizer_sha256: str
    eos_id: int
    seed: int
    validation_fraction: float
    totals: dict[Split, SplitTotals]
    shards: list[ShardInfo]
    parts: list[str] = Field(
        default_factory=list, description="Fingerprints of the prepared parts, in corpus order."
    )
    filters: FilterReport | None = None

    _base_url: str = PrivateAttr("")

    def split_shards(self, split: Split) -> list[ShardInfo]:
        return [shard for shard in self.shards if shard.split == split]

    def url_of(self, name: str) -> str:
        """Absolute URL of a file named relative to the card's directory (shards, tokenizer)."""
        return resolve(self._base_url, name)


def resolve(base_url: str, name: str) -> str:
    """``name`` relative to the directory ``base_url``; leading ``../`` climb out of it (shards live in
    ``<output_url>/parts/``, next to the dataset directories that list them)."""
    while name.startswith("../"):
        base_url, name = base_url.rstrip("/").rsplit("/", 1)[0], name[3:]
    return join(base_url, name)


def write_card(dataset_url: str, card: DatasetCard) -> str:
    """Write ``card`` into the dataset directory ``dataset_url`` atomically; returns its URL."""
    url = join(dataset_url, CARD_FILE)
    write_atomic(url, card.model_dump_json(indent=2).encode())
    return url


def read_card(url: str) -> DatasetCard | None:
    """The card at ``url`` (the card file itself, or the dataset directory holding it), or
    None when there is none (not prepared, or preparation has not finished)."""
    url = _card_url(url)
    try:
        data = read(url)
    except StoreNotFound:
        return None
    try:
        card = DatasetCard.model_validate(json.loads(data))
    except ValueError as error:
        raise DataError(f"{url!r} is not a tessera dataset card ({error})") from error
    card._base_url = url.rstrip("/").rsplit("/", 1)[0] if "/" in url.rstrip("/") else "."
    return card


def require_card(url: str) -> DatasetCard:
    """:func:`read_card`, for callers that need the dataset: a missing card is a DataError."""
    card = read_card(url)
    if card is None:
        raise DataError(
            f"no dataset card at {_card_url(url)!r}; run data preparation first (or fix data_url)"
        )
    return card


def _card_url(url: str) -> str:
    return url if url.rstrip("/").endswith(CARD_FILE) else join(url, CARD_FILE)
