"""Data preparation: corpus → tokenizer → parts (tokenize + pack + shard) → card, cached on its inputs.

A dataset lives in ``<output_url>/<fingerprint>/manifest.json``, where the fingerprint hashes
everything that determines its bytes (each part's identity, the tokenizer recipe, seq_len, seed, split
fraction, shard size, filters): a re-run with the same inputs finds the card and returns at once,
and changed inputs get a fresh directory instead of overwriting a dataset some run may still read.
Its shards live in ``<output_url>/parts/<part fingerprint>/`` (see :mod:`trainer.data.parts`), shared
by every dataset version that contains the part, so adding input files prepares only the new ones.
A mixture (``data.mixture``) prepares one dataset per source, all with one tokenizer, and writes
``<output_url>/mixture-<hash>.json`` naming them and their weights (:mod:`trainer.data.mixture`).

The steps are separate so an orchestrator can run the per-part ones anywhere (they pass small
models and URLs, never data); ``prepare_dataset`` runs them in order with any ``map``:

    plan = plan_preparation(cfg, vocab_size, seq_len, seed)   # cheap: a listing and hashes
    plan.prepared()                                            # done before? then stop
    tokenizer = prepare_tokenizer(plan)                        # trained on a deterministic sample
    digests = map(document_digests, plan.all_parts)            # only with data.dedup
    jobs = part_jobs(plan, tokenizer, digests)
    records = map(prepare_part, jobs)                          # the fan-out
    assemble(plan, tokenizer, jobs, records)                   # cards written last

Every step is deterministic (fixed tokenizer training on a fixed sample, part-seeded splits, fixed
tar metadata), so any number of workers, a retry or a concurrent run writes the same bytes to the
same names.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from pydantic import BaseModel

from trainer.config import CorpusConfig, DataConfig
from trainer.data.card import (
    CARD_FILE,
    FORMAT_VERSION,
    TOKENIZER,
    DatasetCard,
    FilterReport,
    ShardInfo,
    SplitTotals,
    require_card,
    write_card,
)
from trainer.data.corpus import Part, corpus_parts, read_documents
from trainer.data.errors import DataError
from trainer.data.mixture import MixtureManifest, SourceEntry, mixture_name, write_mixture
from trainer.data.parts import SPLITS, PartJob, PartRecord, document_digests, prepare_part
from trainer.data.shards import token_dtype
from trainer.data.tokenizer import EOS, parse_tokenizer, read_tokenizer_bytes, train_bpe
from trainer.storage import StoreError, ensure_writable, exists, join, write_atomic
from trainer.units import MiB

T = TypeVar("T")
R = TypeVar("R")
Mapper = Callable[[Callable[[T], R], list[T]], list[R]]


def serial_map(fn: Callable[[T], R], items: list[T]) -> list[R]:
    """Run in this process, one item after another: the default when no runner is named."""
    return [fn(item) for item in items]


class Tokenizer(BaseModel):
    url: str
    sha256: str


class Preparation(BaseModel):
    """The plan: every corpus's parts, the tokenizer recipe, and the URLs the results will have."""

    cfg: DataConfig
    vocab_size: int
    seq_len: int
    seed: int
    parts: dict[str, list[Part]]  # by source name, in corpus order
    tokenizer_recipe: dict[str, Any]
    datasets: dict[str, str]  # dataset directory by source name

    @property
    def all_parts(self) -> list[Part]:
        return [part for parts in self.parts.values() for part in parts]

    @property
    def data_url(self) -> str:
        """What training reads: the dataset's card, or for a mixture the mixture file."""
        if self.cfg.mixture is None:
            return join(self.datasets["main"], CARD_FILE)
        entries = self.mixture_entries()
        return join(self.cfg.output_url, mixture_name(entries, self.cfg.mixture.schedule))

    def prepared(self) -> str | None:
        """The data URL if everything is prepared already (cards exist), else None."""
        done = all(exists(join(url, CARD_FILE)) for url in self.datasets.values()) and exists(self.data_url)
        return self.data_url if done else None

    def mixture_entries(self) -> list[SourceEntry]:
        """The mixture's sources: each one's dataset (relative to ``output_url``) and base weight."""
        assert self.cfg.mixture is not None
        return [
            SourceEntry(name=s.name, manifest=_relative(self.datasets[s.name]), weight=s.weight)
            for s in self.cfg.mixture.sources
        ]


def plan_preparation(cfg: DataConfig, vocab_size: int, seq_len: int, seed: int) -> Preparation:
    corpora = cfg.corpora()
    parts = {name: corpus_parts(corpus) for name, corpus in corpora.items()}
    recipe = _tokenizer_recipe(cfg, vocab_size, parts)
    datasets = {}
    for name, corpus in corpora.items():
        inputs = _dataset_inputs(cfg, corpus, parts[name], recipe, vocab_size, seq_len, seed)
        digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]
        datasets[name] = join(cfg.output_url, digest)
    return Preparation(
        cfg=cfg,
        vocab_size=vocab_size,
        seq_len=seq_len,
        seed=seed,
        parts=parts,
        tokenizer_recipe=recipe,
        datasets=datasets,
    )


def prepare_tokenizer(plan: Preparation) -> Tokenizer:
    """The given tokenizer, checked; or a byte-level BPE trained on the recipe's sample (stored once)."""
    _ensure_output_writable(plan.cfg.output_url)
    if plan.cfg.tokenizer is not None:
        url = plan.cfg.tokenizer
        data = read_tokenizer_bytes(url)
    else:
        url = join(plan.cfg.output_url, "tokenizers", f"{_hash(plan.tokenizer_recipe)}.json")
        try:
            data = read_tokenizer_bytes(url)
        except DataError:
            data = train_bpe(_sample_texts(plan), plan.vocab_size).to_str().encode()
            write_atomic(url, data)
    parse_tokenizer(data, url, plan.vocab_size)
    return Tokenizer(url=url, sha256=hashlib.sha256(data).hexdigest())


def part_jobs(
    plan: Preparation, tokenizer: Tokenizer, digests: list[list[str]] | None = None
) -> list[PartJob]:
    """One job per part, in plan order; ``digests`` (per part, in order) mark duplicates to drop."""
    duplicates = _duplicates(digests) if digests is not None else [()] * len(plan.all_parts)
    cfg = plan.cfg
    return [
        PartJob(
            part=part,
            tokenizer_url=tokenizer.url,
            tokenizer_sha256=tokenizer.sha256,
            vocab_size=plan.vocab_size,
            sample_len=plan.seq_len + 1,
            seed=plan.seed,
            validation_fraction=cfg.validation_fraction,
            samples_per_shard=cfg.samples_per_shard,
            min_chars=cfg.min_chars,
            max_chars=cfg.max_chars,
            duplicates=drop,
            output_url=cfg.output_url,
        )
        for part, drop in zip(plan.all_parts, duplicates, strict=True)
    ]


def assemble(plan: Preparation, tokenizer: Tokenizer, jobs: list[PartJob], records: list[PartRecord]) -> str:
    """Write each source's card (and the mixture file) from its parts' records; returns the data URL."""
    data = read_tokenizer_bytes(tokenizer.url)
    parsed = parse_tokenizer(data, tokenizer.url, plan.vocab_size)
    by_part = iter(zip(jobs, records, strict=True))
    for name, corpus in plan.cfg.corpora().items():
        done = [next(by_part) for _ in plan.parts[name]]
        url = plan.datasets[name]
        write_atomic(join(url, TOKENIZER), data)
        card = DatasetCard(
            fingerprint=url.rstrip("/").rsplit("/", 1)[-1],
            inputs=_dataset_inputs(
                plan.cfg,
                corpus,
                plan.parts[name],
                plan.tokenizer_recipe,
                plan.vocab_size,
                plan.seq_len,
                plan.seed,
            ),
            seq_len=plan.seq_len,
            sample_len=plan.seq_len + 1,
            dtype=token_dtype(plan.vocab_size),
            vocab_size=plan.vocab_size,
            tokenizer_vocab_size=parsed.get_vocab_size(),
            tokenizer_sha256=tokenizer.sha256,
            eos_id=parsed.token_to_id(EOS),
            seed=plan.seed,
            validation_fraction=plan.cfg.validation_fraction,
            totals=_totals(name, corpus, plan, [record for _, record in done]),
            shards=[
                ShardInfo(**{**shard.model_dump(), "name": f"../parts/{job.fingerprint}/{shard.name}"})
                for job, record in done
                for split in SPLITS
                for shard in record.shards
                if shard.split == split
            ],
            parts=[job.fingerprint for job, _ in done],
            filters=_filter_report(plan.cfg, [record for _, record in done]),
        )
        write_card(url, card)
    if plan.cfg.mixture is not None:
        write_mixture(
            plan.data_url,
            MixtureManifest(
                sources=plan.mixture_entries(),
                schedule=plan.cfg.mixture.schedule,
                tokenizer_sha256=tokenizer.sha256,
            ),
        )
    return plan.data_url


def prepare_dataset(
    cfg: DataConfig, vocab_size: int, seq_len: int, seed: int, map_parts: Mapper = serial_map
) -> str:
    """Prepare (or reuse) the dataset (or mixture) for these inputs; returns the URL training reads.

    ``map_parts(fn, items)`` runs the per-part steps: in this process by default, or fanned out (the
    ``prepare-dataset`` task passes mapped Prefect tasks on a Dask cluster).
    """
    plan = plan_preparation(cfg, vocab_size, seq_len, seed)
    done = plan.prepared()
    if done is not None:
        for url in plan.datasets.values():
            require_card(url)  # a reused dataset must still parse
        return done
    tokenizer = prepare_tokenizer(plan)
    digests = map_parts(document_digests, plan.all_parts) if cfg.dedup else None
    jobs = part_jobs(plan, tokenizer, digests)
    records = map_parts(prepare_part, jobs)
    return assemble(plan, tokenizer, jobs, records)


def _tokenizer_recipe(cfg: DataConfig, vocab_size: int, parts: dict[str, list[Part]]) -> dict[str, Any]:
    """What determines the tokenizer: a given file's hash, or the training recipe and its sample's parts."""
    if cfg.tokenizer is not None:
        return {"file_sha256": hashlib.sha256(read_tokenizer_bytes(cfg.tokenizer)).hexdigest()}
    budget = _sample_budget(cfg, len(parts))
    return {
        "train": "byte-level-bpe",
        "vocab_size": vocab_size,
        "eos": EOS,
        "sample_bytes_per_source": budget,
        "sample": {name: [p.model_dump() for p in _leading(ps, budget)] for name, ps in parts.items()},
    }


def _sample_budget(cfg: DataConfig, sources: int) -> int:
    return int(cfg.tokenizer_sample_mb * MiB) // sources


def _leading(parts: list[Part], budget: int) -> list[Part]:
    """The first parts of a corpus whose sizes reach ``budget``: the tokenizer's sample is read from them.

    Chosen from the listing alone, so the sample (and the tokenizer) stays the same when files are
    added after them: new files then cost only their own tokenization.
    """
    chosen, total = [], 0
    for part in parts:
        if total >= budget:
            break
        chosen.append(part)
        total += part.size
    return chosen


def _sample_texts(plan: Preparation) -> Iterator[str]:
    """The leading documents of each source, up to its share of ``tokenizer_sample_mb``."""
    budget = _sample_budget(plan.cfg, len(plan.parts))
    for parts in plan.parts.values():
        yield from _take_bytes(
            (text for part in _leading(parts, budget) for text in read_documents(part)), budget
        )


def _take_bytes(texts: Iterable[str], budget: int) -> Iterator[str]:
    taken = 0
    for text in texts:
        if taken >= budget:
            return
        yield text[: budget - taken]
        taken += len(text)


def _duplicates(digests: list[list[str]]) -> list[tuple[int, ...]]:
    """Per part, the documents whose text appeared earlier in the corpus order (across every part)."""
    seen: set[str] = set()
    out = []
    for part_digests in digests:
        drop = []
        for index, digest in enumerate(part_digests):
            if digest in seen:
                drop.append(index)
            seen.add(digest)
        out.append(tuple(drop))
    return out


def _dataset_inputs(
    cfg: DataConfig,
    corpus: CorpusConfig,
    parts: list[Part],
    recipe: dict[str, Any],
    vocab_size: int,
    seq_len: int,
    seed: int,
) -> dict[str, Any]:
    # num_proc, dask_address and loader_workers are absent on purpose: they change speed, not bytes.
    return {
        "format_version": FORMAT_VERSION,
        "corpus": {"source": corpus.source, "parts": [p.model_dump() for p in parts]},
        "tokenizer": recipe,
        "vocab_size": vocab_size,
        "seq_len": seq_len,
        "seed": seed,
        "validation_fraction": cfg.validation_fraction,
        "samples_per_shard": cfg.samples_per_shard,
        "filters": {"dedup": cfg.dedup, "min_chars": cfg.min_chars, "max_chars": cfg.max_chars},
    }


def _totals(
    name: str, corpus: CorpusConfig, plan: Preparation, records: list[PartRecord]
) -> dict[str, SplitTotals]:
    where = f"the corpus (source {name}: data.source={corpus.source}, data.paths={corpus.paths})"
    if not sum(r.text_chars for r in records):
        raise DataError(f"{where} has no text; point data.paths at non-empty files")
    totals = {}
    for split in SPLITS:
        parts = [r.totals[split] for r in records]
        summed = SplitTotals(**{f: sum(getattr(t, f) for t in parts) for f in SplitTotals.model_fields})
        if summed.documents and not summed.samples:
            raise DataError(
                f"the {split} split of {where} has {summed.tokens_dropped} tokens ({summed.documents} "
                f"documents), fewer than one sample of train.seq_len+1={plan.seq_len + 1} per part; lower "
                "train.seq_len, add documents"
                + (" or raise data.validation_fraction" if split == "val" else " (data.max_documents)")
            )
        totals[split] = summed
    if plan.cfg.validation_fraction and not totals["val"].documents:
        raise DataError(
            f"{where} is too small to hold out data.validation_fraction={plan.cfg.validation_fraction} "
            "of its documents; raise it, add documents, or set it to 0"
        )
    return totals


def _filter_report(cfg: DataConfig, records: list[PartRecord]) -> FilterReport:
    return FilterReport(
        dedup=cfg.dedup,
        min_chars=cfg.min_chars,
        max_chars=cfg.max_chars,
        duplicates=sum(r.duplicates for r in records),
        too_short=sum(r.too_short for r in records),
        too_long=sum(r.too_long for r in records),
    )


def _ensure_output_writable(url: str) -> None:
    """Fail before any expensive work if the dataset directory cannot be written, naming the field."""
    try:
        ensure_writable(url)
    except StoreError as error:
        raise DataError(
            f"data.output_url={url!r} is not writable ({error}); point it at a writable directory or bucket"
        ) from error


def _relative(dataset_url: str) -> str:
    """A dataset's card named relative to ``output_url``, where the mixture file sits."""
    return f"{dataset_url.rstrip('/').rsplit('/', 1)[-1]}/{CARD_FILE}"


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
