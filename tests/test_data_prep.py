"""Preparation in parts: byte-identical on a Dask LocalCluster, incremental when files are added, filters."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from prefect import flow

from tasks.data import prepare_dataset_task
from trainer.config import DataConfig
from trainer.data import prepare_dataset, read_card
from trainer.data.corpus import GENERATED_DOCUMENT_BYTES, PART_BYTES

VOCAB, SEQ = 512, 32


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` by relative path, with the sha256 of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@flow
def prepare_flow(data: DataConfig) -> str:
    return prepare_dataset_task(data, VOCAB, SEQ, 0)


@pytest.mark.slow  # a local Dask cluster
@pytest.mark.usefixtures("prefect_harness")
def test_dask_workers_write_the_same_bytes_as_one_process(tmp_path: Path) -> None:
    documents = 3 * PART_BYTES // GENERATED_DOCUMENT_BYTES  # three parts
    cfg = DataConfig(source="generated", max_documents=documents, samples_per_shard=64)
    serial = prepare_dataset(cfg.model_copy(update={"output_url": str(tmp_path / "one")}), VOCAB, SEQ, 0)
    fanned = prepare_flow(cfg.model_copy(update={"output_url": str(tmp_path / "dask"), "num_proc": 2}))
    assert len(read_card(fanned).parts) == 3
    assert Path(fanned).relative_to(tmp_path / "dask") == Path(serial).relative_to(tmp_path / "one")
    assert tree(tmp_path / "dask") == tree(tmp_path / "one")


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def corpus_file(path: Path, tag: str, documents: int = 40) -> None:
    write_jsonl(
        path, [f"{tag} document {i}: " + "the quick brown fox jumps " * (5 + i % 7) for i in range(documents)]
    )


def test_added_files_prepare_only_the_new_part(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        corpus_file(tmp_path / f"{name}.jsonl", name)
    # A small sample budget: the tokenizer trains on the first file only, so it survives added files.
    cfg = DataConfig(
        source="files",
        paths=[str(tmp_path / "*.jsonl")],
        output_url=str(tmp_path / "out"),
        samples_per_shard=16,
        tokenizer_sample_mb=0.001,
    )
    first = read_card(prepare_dataset(cfg, VOCAB, SEQ, 0))
    parts = tmp_path / "out" / "parts"
    stamps = {p: p.stat().st_mtime_ns for p in parts.rglob("*")}
    corpus_file(tmp_path / "d.jsonl", "d")
    second = read_card(prepare_dataset(cfg, VOCAB, SEQ, 0))
    assert second.fingerprint != first.fingerprint
    assert second.tokenizer_sha256 == first.tokenizer_sha256
    assert second.parts[:3] == first.parts and len(second.parts) == 4
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # finished parts untouched
    assert {p.name for p in parts.iterdir()} == set(second.parts)
    assert second.totals["train"].documents > first.totals["train"].documents


def test_dedup_and_length_filter_are_recorded(tmp_path: Path) -> None:
    repeated = "an exact duplicate of a document, " * 10
    write_jsonl(tmp_path / "a.jsonl", [repeated, "short", *(f"doc {i} " + "words " * 40 for i in range(30))])
    write_jsonl(
        tmp_path / "b.jsonl",
        [repeated, repeated, "x" * 5000, *(f"more {i} " + "text " * 40 for i in range(30))],
    )
    cfg = DataConfig(
        source="files",
        paths=[str(tmp_path / "*.jsonl")],
        output_url=str(tmp_path / "out"),
        samples_per_shard=16,
        dedup=True,
        min_chars=20,
        max_chars=2000,
    )
    card = read_card(prepare_dataset(cfg, VOCAB, SEQ, 0))
    assert card.filters is not None
    assert (card.filters.duplicates, card.filters.too_short, card.filters.too_long) == (2, 1, 1)
    assert sum(t.documents for t in card.totals.values()) == 61
    plain = read_card(
        prepare_dataset(
            cfg.model_copy(update={"dedup": False, "min_chars": 0, "max_chars": None}), VOCAB, SEQ, 0
        )
    )
    assert plain.fingerprint != card.fingerprint and sum(t.documents for t in plain.totals.values()) == 65
