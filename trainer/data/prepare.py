"""Data preparation: corpus → tokenizer → tokenize + pack → shards → manifest, cached on its inputs.

Output lives in ``<output_url>/<fingerprint>/`` where the fingerprint hashes everything that
determines the bytes (corpus identity, tokenizer, seq_len, seed, split fraction, shard size), so a
re-run with the same inputs finds the finished manifest and returns at once, and changed inputs
get a fresh directory instead of overwriting a dataset some run may still be reading.

The steps are separate functions so an orchestrator can wrap each one (they pass URLs, never data):

    url = dataset_url(cfg, vocab_size, seq_len, seed)            # cheap: hashes the inputs
    manifest = find_prepared(url)                                 # done before? then stop
    tok = prepare_tokenizer(cfg, vocab_size, url)                 # -> <url>/tokenizer.json
    manifest = build_shards(cfg, tok, vocab_size, seq_len, seed, url)  # -> <url>/manifest.json

``prepare_dataset`` runs them in order. Every step is deterministic (fixed tokenizer training,
seeded split, fixed tar metadata), so a retried or concurrent run writes the same bytes to the same
names: safe to repeat, and the manifest (written last) only ever describes complete shards.
"""

from __future__ import annotations

import hashlib
import json

import datasets

from trainer.config import DataConfig
from trainer.data.corpus import corpus_identity, load_corpus
from trainer.data.errors import DataError
from trainer.data.fs import ensure_writable, exists, join, write_bytes
from trainer.data.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    TOKENIZER,
    DatasetManifest,
    Split,
    SplitTotals,
    read_manifest,
    write_manifest,
)
from trainer.data.pack import Packer, split_documents, token_stream, tokenize
from trainer.data.shards import ShardSink, token_dtype
from trainer.data.tokenizer import EOS, parse_tokenizer, read_tokenizer_bytes, tokenizer_recipe, train_bpe

SPLITS: tuple[Split, ...] = ("train", "val")


def fingerprint_inputs(cfg: DataConfig, vocab_size: int, seq_len: int, seed: int) -> dict:
    # num_proc and loader_workers are absent on purpose: they change speed, not bytes.
    return {
        "format_version": FORMAT_VERSION,
        "corpus": corpus_identity(cfg),
        "tokenizer": tokenizer_recipe(cfg.tokenizer, vocab_size),
        "vocab_size": vocab_size,
        "seq_len": seq_len,
        "seed": seed,
        "validation_fraction": cfg.validation_fraction,
        "samples_per_shard": cfg.samples_per_shard,
    }


def dataset_url(cfg: DataConfig, vocab_size: int, seq_len: int, seed: int) -> str:
    """``<output_url>/<fingerprint>``: where the dataset for these inputs lives (or will)."""
    inputs = fingerprint_inputs(cfg, vocab_size, seq_len, seed)
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return join(cfg.output_url, digest)


def find_prepared(url: str) -> str | None:
    """The manifest URL if the dataset at ``url`` is complete (its manifest exists), else None."""
    manifest_url = join(url, MANIFEST)
    return manifest_url if exists(manifest_url) else None


def prepare_tokenizer(
    cfg: DataConfig, vocab_size: int, url: str, corpus: datasets.Dataset | None = None
) -> str:
    """Train (or copy the given) tokenizer into ``<url>/tokenizer.json``; returns its URL."""
    ensure_writable(url, "data.output_url")
    target = join(url, TOKENIZER)
    if cfg.tokenizer is not None:
        data = read_tokenizer_bytes(cfg.tokenizer)
        parse_tokenizer(data, cfg.tokenizer, vocab_size)
    else:
        corpus = corpus if corpus is not None else load_corpus(cfg)
        texts = (
            text for batch in corpus.iter(batch_size=1024) for text in batch["text"]
        )  # streamed, not all in RAM
        data = train_bpe(texts, vocab_size).to_str().encode()
    write_bytes(target, data)
    return target


def build_shards(
    cfg: DataConfig,
    tokenizer_url: str,
    vocab_size: int,
    seq_len: int,
    seed: int,
    url: str,
    corpus: datasets.Dataset | None = None,
    progress: bool = False,
) -> str:
    """Tokenize, split by document, pack and shard both splits; write the manifest last. Returns its URL."""
    corpus = corpus if corpus is not None else load_corpus(cfg)
    tokenizer_bytes = read_tokenizer_bytes(tokenizer_url)
    tokenizer = parse_tokenizer(tokenizer_bytes, tokenizer_url, vocab_size)
    tokenized = tokenize(corpus, tokenizer, cfg.num_proc, progress)
    documents = split_documents(len(corpus), cfg.validation_fraction, seed)
    dtype, sample_len = token_dtype(vocab_size), seq_len + 1
    totals: dict[Split, SplitTotals] = {}
    shards = []
    for split in SPLITS:
        packer = Packer(sample_len)
        sink = ShardSink(url, split, cfg.samples_per_shard, dtype, progress)
        for chunk in token_stream(tokenized, documents[split], tokenizer.token_to_id(EOS)):
            samples = packer.add(chunk)
            if len(samples):
                sink.add(samples)
        split_shards = sink.close()
        if documents[split] and not split_shards:
            raise DataError(
                f"the {split} split has {packer.tokens_in} tokens ({len(documents[split])} documents), fewer "
                f"than one sample of train.seq_len+1={sample_len}; lower train.seq_len, add documents"
                + (" or raise data.validation_fraction" if split == "val" else " (data.max_documents)")
            )
        shards.extend(split_shards)
        totals[split] = SplitTotals(
            documents=len(documents[split]),
            samples=sum(s.samples for s in split_shards),
            tokens=sum(s.tokens for s in split_shards),
            tokens_dropped=packer.tokens_dropped,
            shards=len(split_shards),
            bytes=sum(s.bytes for s in split_shards),
        )
    manifest = DatasetManifest(
        fingerprint=url.rstrip("/").rsplit("/", 1)[-1],
        inputs=fingerprint_inputs(cfg, vocab_size, seq_len, seed),
        seq_len=seq_len,
        sample_len=sample_len,
        dtype=dtype,
        vocab_size=vocab_size,
        tokenizer_vocab_size=tokenizer.get_vocab_size(),
        tokenizer_sha256=hashlib.sha256(tokenizer_bytes).hexdigest(),
        eos_id=tokenizer.token_to_id(EOS),
        seed=seed,
        validation_fraction=cfg.validation_fraction,
        totals=totals,
        shards=shards,
    )
    return write_manifest(url, manifest)


def prepare_dataset(cfg: DataConfig, vocab_size: int, seq_len: int, seed: int, progress: bool = False) -> str:
    """Prepare (or reuse) the dataset for these inputs; returns the manifest URL."""
    url = dataset_url(cfg, vocab_size, seq_len, seed)
    manifest_url = find_prepared(url)
    if manifest_url is not None:
        read_manifest(manifest_url)  # a reused dataset must still parse
        return manifest_url
    corpus = load_corpus(cfg)
    tokenizer_url = prepare_tokenizer(cfg, vocab_size, url, corpus)
    return build_shards(cfg, tokenizer_url, vocab_size, seq_len, seed, url, corpus, progress)
