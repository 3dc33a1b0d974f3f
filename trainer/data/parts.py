"""Prepare one part of a corpus: filter, tokenize, split, pack and shard it into its own directory.

This is the function preparation fans out (``prepare_part``: one call per part, on any process or
Dask worker). Its output depends only on its ``PartJob`` (the part, the tokenizer's sha256, the
packing and filter settings, the document ids to drop as duplicates), and lives in
``<output_url>/parts/<fingerprint of the job>/``: so the shards are byte-identical whatever runs them
and in whatever order, a repeated or retried job finds ``part.json`` and returns it, and a dataset
version that adds input files reuses every part it shares with the last one.

Within a part, held-out documents are chosen by a generator seeded with the seed and the part's own
identity (not its position), and packing runs over the part alone: its last tokens, fewer than one
sample, are dropped and counted, as a whole corpus's are.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json

import numpy as np
from pydantic import BaseModel, ConfigDict
from tokenizers import Tokenizer

from trainer.data.card import FORMAT_VERSION, ShardInfo, Split, SplitTotals, TokenDtype
from trainer.data.corpus import Part, read_documents
from trainer.data.pack import Packer, split_documents
from trainer.data.shards import ShardSink, token_dtype
from trainer.data.tokenizer import EOS, parse_tokenizer, read_tokenizer_bytes
from trainer.storage import StoreNotFound, join, read, write_atomic

PART_RECORD = "part.json"
SPLITS: tuple[Split, ...] = ("train", "val")


class PartJob(BaseModel):
    """Everything that decides a part's bytes (all of it is hashed into ``fingerprint``), and where they go."""

    model_config = ConfigDict(frozen=True)

    part: Part
    output_url: str  # where, not what: not hashed
    tokenizer_url: str  # the sha256 below says what
    tokenizer_sha256: str
    vocab_size: int
    sample_len: int
    seed: int
    validation_fraction: float
    samples_per_shard: int
    min_chars: int
    max_chars: int | None
    duplicates: tuple[int, ...] = ()  # document indices that repeat an earlier document of the corpus

    @property
    def dtype(self) -> TokenDtype:
        return token_dtype(self.vocab_size)

    @property
    def fingerprint(self) -> str:
        inputs = self.model_dump(exclude={"output_url", "tokenizer_url"})
        text = json.dumps({"format_version": FORMAT_VERSION, **inputs}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def url(self) -> str:
        return join(self.output_url, "parts", self.fingerprint)


class PartRecord(BaseModel):
    """``part.json``: what a prepared part holds. Written after its shards, so it means the part is whole."""

    fingerprint: str
    text_chars: int
    documents: int
    duplicates: int
    too_short: int
    too_long: int
    totals: dict[Split, SplitTotals]
    shards: list[ShardInfo]  # names relative to the part's directory


def prepare_part(job: PartJob) -> PartRecord:
    """Prepare ``job``'s part (or find it prepared); returns its record."""
    url = job.url
    try:
        return PartRecord.model_validate_json(read(join(url, PART_RECORD)))
    except StoreNotFound:
        pass
    documents = read_documents(job.part)
    kept, counts = _filter(documents, job)
    tokenizer = _tokenizer(job.tokenizer_url, job.tokenizer_sha256, job.vocab_size)
    ids = [encoding.ids for encoding in tokenizer.encode_batch([documents[i] for i in kept])]
    held_out = split_documents(len(kept), job.validation_fraction, [job.seed, job.part.key])
    totals: dict[Split, SplitTotals] = {}
    shards: list[ShardInfo] = []
    for split in SPLITS:
        chosen = [ids[i] for i in held_out[split]]
        packer = Packer(job.sample_len)
        sink = ShardSink(url, split, job.samples_per_shard, job.dtype)
        sink.add(packer.add(with_eos(chosen, tokenizer.token_to_id(EOS))))
        split_shards = sink.close()
        shards += split_shards
        totals[split] = SplitTotals(
            documents=len(chosen),
            samples=sum(s.samples for s in split_shards),
            tokens=sum(s.tokens for s in split_shards),
            tokens_dropped=packer.tokens_dropped,
            shards=len(split_shards),
            bytes=sum(s.bytes for s in split_shards),
        )
    record = PartRecord(
        fingerprint=job.fingerprint,
        text_chars=sum(len(documents[i]) for i in kept),
        documents=len(documents),
        totals=totals,
        shards=shards,
        **counts,
    )
    write_atomic(join(url, PART_RECORD), record.model_dump_json(indent=2).encode())
    return record


def document_digests(part: Part) -> list[str]:
    """A short hash of each of the part's documents, in order: what exact-duplicate removal compares."""
    return [hashlib.blake2b(text.encode(), digest_size=12).hexdigest() for text in read_documents(part)]


def with_eos(ids: list[list[int]], eos_id: int) -> np.ndarray:
    """The documents' tokens, each followed by EOS, as one flat int32 array."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    return np.insert(flat, np.cumsum(lengths), eos_id)


def _filter(documents: list[str], job: PartJob) -> tuple[list[int], dict[str, int]]:
    """Indices of the documents kept, and how many each filter dropped (a duplicate counts as that first)."""
    duplicates = set(job.duplicates)
    too_short = too_long = 0
    kept = []
    for index, text in enumerate(documents):
        if index in duplicates:
            continue
        if len(text) < job.min_chars:
            too_short += 1
        elif job.max_chars is not None and len(text) > job.max_chars:
            too_long += 1
        else:
            kept.append(index)
    return kept, {"duplicates": len(duplicates), "too_short": too_short, "too_long": too_long}


@functools.lru_cache(maxsize=4)
def _tokenizer(url: str, sha256: str, vocab_size: int) -> Tokenizer:
    """Parsed once per worker process, not once per part (the sha256 keys the cache by content)."""
    del sha256
    return parse_tokenizer(read_tokenizer_bytes(url), url, vocab_size)
