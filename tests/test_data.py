"""Data prep and loader on local files: real datasets/tokenizers/webdataset, no stubs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import DataConfig, JobConfig, ModelConfig, TrainConfig
from trainer.data import (
    DataError,
    StepLoader,
    build_loader,
    load_tokenizer,
    prepare_dataset,
    read_card,
    validation_batches,
)
from trainer.data.corpus import generated_documents
from trainer.data.fetch import fetch_shard
from trainer.data.loader import document_eos_id, validation_sample
from trainer.data.order import ShardedSamples

VOCAB, SEQ = 512, 32


def generated(tmp_path: Path, **overrides: object) -> DataConfig:
    return DataConfig(
        source="generated",
        output_url=str(tmp_path / "data"),
        samples_per_shard=40,
        max_documents=120,
        **overrides,
    )


def job(card_url: str | None, batch: int = 8, workers: int = 0, seed: int = 3) -> JobConfig:
    return JobConfig(
        seed=seed,
        data_url=card_url,
        loader_workers=workers,
        model=ModelConfig(preset="tiny", vocab_size=VOCAB),
        train=TrainConfig(seq_len=SEQ, global_batch_size=batch, micro_batch_size=1),
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return prepare_dataset(generated(tmp_path_factory.mktemp("prep")), VOCAB, SEQ, seed=0)


def stored_rows(card_url: str, split: str = "train") -> np.ndarray:
    card = read_card(card_url)
    return np.concatenate(
        [fetch_shard(card.url_of(s.name), s, card.dtype, card.sample_len) for s in card.split_shards(split)]
    )


def test_prepare_writes_consistent_shards_and_manifest(dataset: str) -> None:
    card = read_card(dataset)
    tokenizer = load_tokenizer(dataset)
    assert card.dtype == "uint16" and card.sample_len == SEQ + 1
    assert tokenizer.get_vocab_size() == card.tokenizer_vocab_size <= VOCAB
    assert card.totals["train"].shards > 1 and card.totals["val"].samples > 0
    for split, totals in card.totals.items():
        shards = card.split_shards(split)
        assert totals.samples == sum(s.samples for s in shards)
        assert totals.tokens == totals.samples * card.sample_len
        assert 0 <= totals.tokens_dropped < card.sample_len
        assert all(s.samples == 40 for s in shards[:-1])
    # Every corpus token (plus one EOS per document) is in a sample or counted as dropped.
    docs = generated_documents(120)
    corpus_tokens = sum(len(e.ids) + 1 for e in tokenizer.encode_batch(docs))
    assert corpus_tokens == sum(t.tokens + t.tokens_dropped for t in card.totals.values())
    rows = stored_rows(dataset)
    assert rows.max() < card.tokenizer_vocab_size
    assert (rows == card.eos_id).sum() > 0  # documents are separated, not padded
    assert "." in tokenizer.decode(rows[0].tolist())


def test_rerun_reuses_and_changed_inputs_make_a_new_version(tmp_path: Path) -> None:
    cfg = generated(tmp_path)
    first = prepare_dataset(cfg, VOCAB, SEQ, seed=0)
    files = sorted(Path(first).parent.iterdir())
    stamps = {f: f.stat().st_mtime_ns for f in files}
    assert prepare_dataset(cfg, VOCAB, SEQ, seed=0) == first
    assert {f: f.stat().st_mtime_ns for f in sorted(Path(first).parent.iterdir())} == stamps
    changed = prepare_dataset(cfg.model_copy(update={"max_documents": 100}), VOCAB, SEQ, seed=0)
    other_seq = prepare_dataset(cfg, VOCAB, SEQ * 2, seed=0)
    assert len({first, changed, other_seq}) == 3
    assert Path(changed).parent.parent == Path(first).parent.parent


def test_stdlib_corpus_small(tmp_path: Path) -> None:
    cfg = DataConfig(source="stdlib", output_url=str(tmp_path), max_documents=8, validation_fraction=0.25)
    url = prepare_dataset(cfg, 1024, 64, seed=0)
    card = read_card(url)
    assert card.totals["train"].documents == 6 and card.totals["val"].documents == 2
    text = load_tokenizer(url).decode(stored_rows(url)[:50].ravel().tolist())
    assert "import" in text and "def " in text


@pytest.mark.slow
def test_validation_split_is_disjoint_by_document(tmp_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"
    with corpus.open("w") as f:
        for i in range(60):
            f.write(json.dumps({"body": f"<d{i:03d}> " + " ".join(["alpha beta gamma"] * 8), "n": i}) + "\n")
    cfg = DataConfig(
        source="files",
        paths=[str(corpus)],
        text_field="body",
        output_url=str(tmp_path / "out"),
        validation_fraction=0.2,
        samples_per_shard=16,
    )
    url = prepare_dataset(cfg, 300, 16, seed=5)
    tokenizer = load_tokenizer(url)

    def documents(rows: np.ndarray) -> set[str]:
        return set(
            re.findall(r"<d\d{3}>", tokenizer.decode(rows.ravel().tolist(), skip_special_tokens=False))
        )

    train_docs, val_docs = documents(stored_rows(url)), documents(stored_rows(url, "val"))
    assert len(val_docs) >= 10 and len(train_docs) >= 45
    assert not train_docs & val_docs
    assert read_card(url).totals["val"].documents == 12
    # A different seed holds out different documents.
    other = prepare_dataset(cfg, 300, 16, seed=6)
    assert documents(stored_rows(other, "val")) != val_docs


def take(loader: StepLoader, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(steps)]


def test_loader_order_is_a_seeded_permutation_per_epoch(dataset: str) -> None:
    card = read_card(dataset)
    epoch_len = card.totals["train"].samples
    stored = stored_rows(dataset)
    samples = ShardedSamples(card, seed=3)
    epoch0, epoch1 = samples.rows(0, epoch_len), samples.rows(epoch_len, epoch_len)
    key = lambda rows: sorted(map(bytes, rows.astype(np.int64)))  # noqa: E731
    assert key(epoch0) == key(epoch1) == key(stored)
    assert not np.array_equal(epoch0, epoch1) and not np.array_equal(epoch0, stored.astype(np.int64))
    np.testing.assert_array_equal(ShardedSamples(card, seed=3).rows(5, 7), epoch0[5:12])
    assert not np.array_equal(ShardedSamples(card, seed=4).rows(0, 8), epoch0[:8])


@pytest.mark.parametrize("source", ["dataset", "synthetic"])
def test_loader_resumes_exactly_across_dp_sizes(dataset: str, source: str) -> None:
    url = dataset if source == "dataset" else None
    epoch_len = read_card(dataset).totals["train"].samples
    steps = epoch_len // 8 + 4  # crosses an epoch boundary
    reference = take(build_loader(job(url), 0, 1), steps)
    inputs, targets = reference[0]
    assert inputs.shape == (8, SEQ) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])

    # dp=2 for k steps, save, resume on dp=1: the same global batches as the uninterrupted run.
    k = 3
    ranks = [build_loader(job(url), r, 2) for r in range(2)]
    for step, batches in enumerate(zip(*(take(loader, k) for loader in ranks), strict=True)):
        assert torch.equal(torch.cat([b[0] for b in batches]), reference[step][0])
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() == {"samples_consumed": k * 8, "epoch": 0}
    resumed = build_loader(job(url, workers=2), 0, 1)
    resumed.load_state_dict(state)
    for got, want in zip(take(resumed, steps - k), reference[k:], strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert resumed.state_dict()["epoch"] == (1 if url else 0)
    resumed.close()

    # dp=1 → dp=2: each rank's rows are its slice of the global batch.
    single = build_loader(job(url), 0, 1)
    take(single, k)
    halves = [build_loader(job(url), r, 2) for r in range(2)]
    for loader in halves:
        loader.load_state_dict(json.loads(json.dumps(single.state_dict())))  # survives serialisation
    for step in range(k, k + 3):
        assert torch.equal(torch.cat([next(h)[0] for h in halves]), reference[step][0])


def test_evaluation_draws_a_seeded_sample_spread_over_the_validation_shards(tmp_path: Path) -> None:
    """Not the first samples in stored order (one part of the corpus, often one document): a draw by
    seed across every val shard, the same on every call, with the tokens and documents it covers."""
    cfg = DataConfig(
        source="generated",
        output_url=str(tmp_path / "data"),
        samples_per_shard=8,
        max_documents=120,
        validation_fraction=0.3,
    )
    url = prepare_dataset(cfg, VOCAB, SEQ, seed=0)
    val = read_card(url).totals["val"]
    rows = stored_rows(url, "val")
    sample = validation_sample(url, 16, seed=0)
    assert sample.rows.shape == (16, SEQ + 1) and sample.tokens == 16 * SEQ
    assert np.array_equal(sample.rows, validation_sample(url, 16, seed=0).rows)
    assert not np.array_equal(sample.rows, validation_sample(url, 16, seed=1).rows)
    positions = [next(i for i, row in enumerate(rows) if np.array_equal(row, drawn)) for drawn in sample.rows]
    shards = {i // cfg.samples_per_shard for i in positions}
    assert len(positions) == len(set(positions)) and len(shards) > val.shards // 2, positions
    assert val.documents // 3 < sample.documents <= val.documents
    assert np.array_equal(validation_sample(url, 10**6, seed=0).rows, rows)  # asked for more: all of them


def test_validation_batches_and_loader_checks(dataset: str) -> None:
    first = [b[0] for b in validation_batches(dataset, 4, 2)]
    assert len(first) == 2 and first[0].shape == (4, SEQ)
    assert all(torch.equal(a, b[0]) for a, b in zip(first, validation_batches(dataset, 4, 2), strict=True))
    with pytest.raises(DataError, match="seq_len"):
        build_loader(
            job(dataset).model_copy(
                update={"train": TrainConfig(seq_len=64, global_batch_size=8, micro_batch_size=1)}
            ),
            0,
            1,
        )
    with pytest.raises(DataError, match="global_batch_size"):
        build_loader(job(dataset), 0, 3)


def test_corrupt_or_missing_shard_is_named(tmp_path: Path) -> None:
    url = prepare_dataset(generated(tmp_path), VOCAB, SEQ, seed=0)
    card = read_card(url)
    victim = Path(card.url_of(card.split_shards("train")[0].name))
    data = bytearray(victim.read_bytes())
    data[1000] ^= 0xFF
    victim.write_bytes(bytes(data))
    loader = build_loader(job(url, batch=card.totals["train"].samples), 0, 1)
    with pytest.raises(DataError, match=rf"{victim.name} is corrupt"):
        next(loader)
    victim.unlink()
    loader = build_loader(job(url, batch=card.totals["train"].samples), 0, 1)
    with pytest.raises(DataError, match=rf"{victim.name} listed in the card is missing"):
        next(loader)


def bad_files(tmp_path: Path, name: str, content: bytes, **overrides: object) -> DataConfig:
    path = tmp_path / name
    path.write_bytes(content)
    return DataConfig(source="files", paths=[str(path)], output_url=str(tmp_path / "out"), **overrides)


@pytest.mark.parametrize(
    ("name", "content", "overrides", "message"),
    [
        ("empty.txt", b"", {}, "has no text"),
        ("blob.parquet", b"\x00\x01not parquet at all" * 10, {}, r"could not read .*blob.parquet"),
        ("blob.bin", b"\x00\x01", {}, r"cannot tell the format of .*blob.bin"),
        ("rows.jsonl", b'{"content": "hello"}\n', {}, r"data.text_field='text' is not a column"),
        ("tiny.txt", b"just a few words", {}, r"fewer than one sample of train.seq_len\+1"),
    ],
)
def test_bad_inputs_are_clear_errors(
    tmp_path: Path, name: str, content: bytes, overrides: dict, message: str
) -> None:
    cfg = bad_files(tmp_path, name, content, validation_fraction=0.0, **overrides)
    with pytest.raises(DataError, match=message):
        prepare_dataset(cfg, VOCAB, 64, seed=0)
    assert not list((tmp_path / "out").rglob("manifest.json"))


def test_missing_paths_and_unwritable_output(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nothing-here\*.txt' matches no files"):
        prepare_dataset(
            DataConfig(source="files", paths=[str(tmp_path / "nothing-here*.txt")]), VOCAB, SEQ, 0
        )
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(DataError, match=r"data.output_url=.*a-file/data.* is not writable"):
        prepare_dataset(DataConfig(source="generated", output_url=str(blocker / "data")), VOCAB, SEQ, 0)


def test_given_tokenizer_and_multiprocess_map_give_the_same_dataset(dataset: str, tmp_path: Path) -> None:
    card = read_card(dataset)
    cfg = generated(tmp_path, tokenizer=card.url_of(card.tokenizer), num_proc=2)
    url = prepare_dataset(cfg, VOCAB, SEQ, seed=0)
    again = read_card(url)
    assert again.tokenizer_sha256 == card.tokenizer_sha256
    assert [s.sha256 for s in again.shards] == [s.sha256 for s in card.shards]
    with pytest.raises(DataError, match=r"has \d+ tokens but model.vocab_size=300"):
        prepare_dataset(cfg, 300, SEQ, seed=0)


def test_document_attention_reads_the_end_of_text_id_from_the_dataset_card(dataset: str) -> None:
    documents = job(dataset).model_copy(
        update={"model": ModelConfig(preset="tiny", vocab_size=VOCAB, attention="document")}
    )
    assert (
        document_eos_id(documents)
        == read_card(dataset).eos_id
        == load_tokenizer(dataset).token_to_id("<|endoftext|>")
    )
    # Causal attention needs no documents, and synthetic tokens have none (each row is one).
    assert document_eos_id(job(dataset)) is None
    assert document_eos_id(documents.model_copy(update={"data_url": None})) is None
