"""Data prep and loading through real object stores: the GCS emulator (gcsfs) and moto's S3 (s3fs)."""

from __future__ import annotations

import json

import fsspec
import pytest
import torch

from tests.stores import FlakyStore
from trainer.config import DataConfig, JobConfig, ModelConfig, TrainConfig
from trainer.data import build_loader, load_tokenizer, prepare_dataset, read_card, validation_batches

pytestmark = pytest.mark.store

VOCAB, SEQ = 512, 32


def round_trip(cfg: DataConfig) -> list[torch.Tensor]:
    """Prepare, then read back the first steps of the train order and one val batch."""
    url = prepare_dataset(cfg, VOCAB, SEQ, seed=0)
    assert url.startswith(cfg.output_url) and read_card(url).totals["train"].shards > 1
    job = JobConfig(
        data_url=url,
        loader_workers=1,
        model=ModelConfig(vocab_size=VOCAB),
        train=TrainConfig(seq_len=SEQ, global_batch_size=8, micro_batch_size=1),
    )
    loader = build_loader(job, 0, 1)
    batches = [next(loader)[0] for _ in range(6)]
    loader.close()
    assert load_tokenizer(url).get_vocab_size() <= VOCAB
    return [*batches, next(validation_batches(url, 4, 1))[0]]


def generated(output_url: str) -> DataConfig:
    return DataConfig(source="generated", max_documents=80, samples_per_shard=30, output_url=output_url)


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    return round_trip(generated(str(tmp_path_factory.mktemp("local"))))


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_gcs_round_trip_matches_local(gcs_bucket: str, local_reference: list[torch.Tensor]) -> None:
    cfg = generated(f"{gcs_bucket}/round-trip")
    assert_same(round_trip(cfg), local_reference)
    assert prepare_dataset(cfg, VOCAB, SEQ, seed=0).startswith(cfg.output_url)  # reused, not rewritten


def test_s3_corpus_and_output(s3_bucket: str, local_reference: list[torch.Tensor]) -> None:
    assert_same(round_trip(generated(f"{s3_bucket}/round-trip")), local_reference)
    # A JSONL corpus on s3:// is read through datasets + s3fs.
    corpus = f"{s3_bucket}/corpus/docs.jsonl"
    with fsspec.open(corpus, "w") as f:
        f.writelines(
            json.dumps({"text": f"document {i}: " + "lorem ipsum dolor " * 20}) + "\n" for i in range(40)
        )
    cfg = DataConfig(source="files", paths=[corpus], output_url=f"{s3_bucket}/from-s3", samples_per_shard=30)
    card = read_card(prepare_dataset(cfg, VOCAB, SEQ, seed=0))
    assert card.totals["train"].documents + card.totals["val"].documents == 40


def test_flaky_store_is_retried(flaky_s3_bucket: FlakyStore, local_reference: list[torch.Tensor]) -> None:
    assert_same(round_trip(generated(f"{flaky_s3_bucket.url}/flaky")), local_reference)
    assert flaky_s3_bucket.proxy.failures >= 3
