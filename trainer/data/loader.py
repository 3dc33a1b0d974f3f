"""The training data loader: a seeded global sample order, cut into per-rank rows of each step.

- The order is that of one prepared dataset (:mod:`trainer.data.order`), of a weighted mixture of
  several (:mod:`trainer.data.mixture`), or of synthetic tokens when there is no dataset.
- The global batch of a step is the next ``global_batch_size`` samples of that order; dp rank ``r``
  of ``D`` takes rows ``[r * G/D, (r+1) * G/D)`` of it.
- The loader's state is ``samples_consumed`` (global samples handed out) plus what the order needs
  to continue from there (a mixture's per-source counters; ``epoch`` for humans). Because the order
  does not depend on ``D``, a state saved by a run on 4 ranks resumes on 2 ranks (or with other
  worker counts) with exactly the batches the first run would have seen next.

Each rank reads only the shards its rows fall in; with shards much larger than a global batch that
is every shard, once per epoch (shards are a few MB, far less than the compute they feed). Shards
are fetched ahead and optionally cached on local disk (:mod:`trainer.data.fetch`).

Worker processes (``loader_workers``) each produce every W-th step; torch's DataLoader returns them
in step order. Each worker fetches the shards its steps touch (so W workers read each shard W times):
workers buy overlap of fetch/decode with training, not less I/O. State lives in the consuming process
(a count of batches taken), so prefetched but unconsumed batches are never lost or skipped on resume:
a plain DataLoader suffices.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer.config import JobConfig
from trainer.data.card import DatasetCard, require_card, resolve
from trainer.data.errors import DataError
from trainer.data.fetch import fetch_shard
from trainer.data.mixture import MixtureManifest, MixtureSamples, WeightSchedule, is_mixture, read_mixture
from trainer.data.order import SampleSource, ShardedSamples
from trainer.data.synthetic import SyntheticSamples
from trainer.data.tokenizer import parse_tokenizer, read_tokenizer_bytes

Batch = tuple[torch.Tensor, torch.Tensor]


class _StepStream(IterableDataset):
    """This rank's rows of every step from ``first_sample`` on; worker w of W makes steps w, w+W, ..."""

    def __init__(
        self, source: SampleSource, first_sample: int, global_batch: int, row_offset: int, local_batch: int
    ) -> None:
        super().__init__()
        self.source, self.first_sample, self.global_batch = source, first_sample, global_batch
        self.row_offset, self.local_batch = row_offset, local_batch

    def __iter__(self) -> Iterator[Batch]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        for step in itertools.count(worker_id, num_workers):
            start = self.first_sample + step * self.global_batch + self.row_offset
            yield to_batch(self.source.rows(start, self.local_batch))


def _leave_signals_to_the_rank(worker_id: int) -> None:
    """A loader worker leaves its rank's process group: a stop signals that whole group, and the rank
    must finish its step and checkpoint (:mod:`trainer.rank.preemption`), not fail on a worker killed under
    it. The worker still ends with the rank: torch's DataLoader stops it, and it watches its parent."""
    os.setpgid(0, 0)


def to_batch(rows: np.ndarray) -> Batch:
    tokens = torch.from_numpy(rows.astype(np.int64, copy=False))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class StepLoader:
    """Iterator of ``(inputs, targets)`` int64 tensors [global_batch // dp_size, seq_len], one per step."""

    def __init__(
        self, source: SampleSource, global_batch_size: int, dp_rank: int, dp_size: int, workers: int = 0
    ) -> None:
        if global_batch_size % dp_size:
            raise DataError(
                f"train.global_batch_size={global_batch_size} is not divisible by the "
                f"data-parallel size {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside [0, {dp_size})")
        self.source, self.global_batch_size, self.workers = source, global_batch_size, workers
        self.local_batch = global_batch_size // dp_size
        self.row_offset = dp_rank * self.local_batch
        self.samples_consumed = 0
        self._iterator: Iterator[Batch] | None = None

    def __iter__(self) -> StepLoader:
        return self

    def __next__(self) -> Batch:
        if self._iterator is None:
            stream = _StepStream(
                self.source, self.samples_consumed, self.global_batch_size, self.row_offset, self.local_batch
            )
            loader = DataLoader(
                stream,
                batch_size=None,
                num_workers=self.workers,
                prefetch_factor=2 if self.workers else None,
                persistent_workers=False,
                worker_init_fn=_leave_signals_to_the_rank,
            )
            self._iterator = iter(loader)
        batch = next(self._iterator)
        self.samples_consumed += self.global_batch_size
        return batch

    def state_dict(self) -> dict[str, object]:
        return {"samples_consumed": self.samples_consumed, **self.source.state_at(self.samples_consumed)}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue right after the last sample the saved loader handed out (any dp size, any workers)."""
        self.close()
        self.samples_consumed = int(state["samples_consumed"])  # type: ignore[call-overload]
        self.source.resume(self.samples_consumed, state)

    def source_samples(self) -> dict[str, int]:
        """Samples handed out per mixture source so far (empty for a single dataset)."""
        state = self.source.state_at(self.samples_consumed)
        return dict(state.get("source_samples", {}))  # type: ignore[call-overload]

    def close(self) -> None:
        """Stop the worker processes and shard downloads (they restart from here on the next ``next``)."""
        self._iterator = None
        self.source.close()


def build_loader(job: JobConfig, dp_rank: int, dp_size: int) -> StepLoader:
    """The loader for this dp rank: the prepared dataset or mixture at ``job.data_url``, or synthetic tokens."""
    if job.data_url is None:
        source: SampleSource = SyntheticSamples(job.seed, job.model.vocab_size, job.train.seq_len + 1)
    elif is_mixture(job.data_url):
        mixture = read_mixture(job.data_url)
        datasets = {
            entry.name: _checked(_source_card(job.data_url, entry.manifest), job) for entry in mixture.sources
        }
        source = MixtureSamples(
            {name: ShardedSamples(card, job.seed) for name, card in datasets.items()},
            WeightSchedule([entry.weight for entry in mixture.sources], mixture.schedule),
            job.seed,
            job.train.global_batch_size,
        )
    else:
        source = ShardedSamples(_checked(require_card(job.data_url), job), job.seed)
    return StepLoader(source, job.train.global_batch_size, dp_rank, dp_size, job.loader_workers)


def _checked(card: DatasetCard, job: JobConfig) -> DatasetCard:
    if card.seq_len != job.train.seq_len:
        raise DataError(
            f"dataset {job.data_url} was packed for seq_len={card.seq_len} but "
            f"train.seq_len={job.train.seq_len}; prepare it again with this seq_len"
        )
    if card.tokenizer_vocab_size > job.model.vocab_size:
        raise DataError(
            f"dataset {job.data_url} has token ids up to {card.tokenizer_vocab_size - 1} "
            f"but model.vocab_size={job.model.vocab_size}; raise model.vocab_size"
        )
    return card


def data_cards(data_url: str) -> list[DatasetCard]:
    """The dataset behind ``data_url``: one card, or a mixture's, one per source in source order."""
    if not is_mixture(data_url):
        return [require_card(data_url)]
    mixture: MixtureManifest = read_mixture(data_url)
    return [_source_card(data_url, entry.manifest) for entry in mixture.sources]


def document_eos_id(job: JobConfig) -> int | None:
    """The id ending each packed document, which model.attention=document splits rows at; None when the
    model attends across documents or there are none (synthetic tokens: each row is then one document)."""
    if job.model.attention != "document" or job.data_url is None:
        return None
    return data_cards(job.data_url)[0].eos_id  # a mixture's sources share one tokenizer


def _source_card(mixture_url: str, relative: str) -> DatasetCard:
    return require_card(resolve(mixture_url.rstrip("/").rsplit("/", 1)[0], relative))


@dataclass(frozen=True)
class ValidationSample:
    """A fixed draw of held-out samples, ``[n, seq_len + 1]``, and how many documents it touches."""

    rows: np.ndarray
    documents: int  # with a token among the inputs; one that spans two shards counts twice

    @property
    def tokens(self) -> int:
        """Input tokens scored: ``seq_len`` per sample."""
        return self.rows.shape[0] * (self.rows.shape[1] - 1)

    def batches(self, batch_size: int) -> Iterator[Batch]:
        return (to_batch(self.rows[i : i + batch_size]) for i in range(0, len(self.rows), batch_size))


def validation_sample(data_url: str, samples: int, seed: int) -> ValidationSample:
    """``samples`` val samples (all, if fewer) drawn by ``seed`` uniformly over the split's shards (and a
    mixture's sources): the same ones every call, so checkpoints are compared on one sample. Uniform
    rather than the first ones in stored order, which sit in one part of the corpus, often one document.
    Only the shards holding a chosen sample are read."""
    shards = [(m, shard) for m in data_cards(data_url) for shard in m.split_shards("val")]
    counts = np.array([shard.samples for _, shard in shards], dtype=np.int64)
    starts = np.cumsum(counts) - counts
    total = int(counts.sum())
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=min(samples, total), replace=False))
    owner = np.searchsorted(starts, chosen, side="right") - 1
    picked, documents = [], 0
    for index in np.unique(owner):
        card, shard = shards[index]
        rows = fetch_shard(card.url_of(shard.name), shard, card.dtype, card.sample_len)
        eos = rows == card.eos_id
        first_document = np.cumsum(eos.sum(axis=1)) - eos.sum(axis=1)  # within the shard, at each row's start
        offsets = chosen[owner == index] - starts[index]
        picked.append(rows[offsets])
        # A row's inputs (all but its last token) touch its first document and one more after each EOS
        # before the last input token.
        documents += len(
            {d for o in offsets for d in range(first_document[o], first_document[o] + eos[o, :-2].sum() + 1)}
        )
    width = shards[0][0].sample_len if shards else 1
    return ValidationSample(np.concatenate(picked) if picked else np.empty((0, width), np.int64), documents)


def validation_batches(data_url: str, batch_size: int, max_batches: int, seed: int = 0) -> Iterator[Batch]:
    """``max_batches`` batches of :func:`validation_sample` (the same batches every call)."""
    return validation_sample(data_url, batch_size * max_batches, seed).batches(batch_size)


def load_tokenizer(data_url: str) -> Tokenizer:
    """The tokenizer the dataset was encoded with (checked against the card's sha256); a mixture's
    sources all share one."""
    card = data_cards(data_url)[0]
    url = card.url_of(card.tokenizer)
    data = read_tokenizer_bytes(url)
    if hashlib.sha256(data).hexdigest() != card.tokenizer_sha256:
        raise DataError(f"tokenizer {url} does not match the card's sha256; re-run data preparation")
    return parse_tokenizer(data, url, card.vocab_size)
