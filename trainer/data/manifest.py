"""``manifest.json``: the file contract between data prep and training.

It is written last, after every shard and the tokenizer, so its presence means the dataset under
its directory is complete; the trainer and the evaluator only ever receive its URL.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from trainer.data.errors import DataError
from trainer.data.fs import join, read_bytes, write_bytes

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT_VERSION = 1
Split = Literal["train", "val"]
TokenDtype = Literal["uint16", "int32"]


class ShardInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str = Field(description="File name relative to the manifest's directory.")
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


class DatasetManifest(BaseModel):
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

    _base_url: str = PrivateAttr("")

    def split_shards(self, split: Split) -> list[ShardInfo]:
        return [shard for shard in self.shards if shard.split == split]

    def url_of(self, name: str) -> str:
        """Absolute URL of a file next to the manifest (shards, tokenizer)."""
        return join(self._base_url, name)


def write_manifest(dataset_url: str, manifest: DatasetManifest) -> str:
    url = join(dataset_url, MANIFEST)
    write_bytes(url, manifest.model_dump_json(indent=2).encode())
    return url


def read_manifest(url: str) -> DatasetManifest:
    """The manifest at ``url`` (the manifest file itself, or the dataset directory holding it)."""
    if not url.rstrip("/").endswith(MANIFEST):
        url = join(url, MANIFEST)
    try:
        data = read_bytes(url)
    except FileNotFoundError as error:
        raise DataError(
            f"no dataset manifest at {url!r}; run data preparation first (or fix data_url)"
        ) from error
    try:
        manifest = DatasetManifest.model_validate(json.loads(data))
    except ValueError as error:
        raise DataError(f"{url!r} is not a tessera dataset manifest ({error})") from error
    manifest._base_url = url.rstrip("/").rsplit("/", 1)[0] if "/" in url.rstrip("/") else "."
    return manifest
