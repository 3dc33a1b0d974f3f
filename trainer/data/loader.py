"""The training data loader: a seeded global sample order, cut into per-rank rows of each step.

Order rule (what makes resume exact for any dp size):
- Epoch ``e`` visits the train shards in ``permutation(num_shards)`` seeded by ``(seed, e)`` and,
  within shard ``k``, its samples in ``permutation(samples_k)`` seeded by ``(seed, e, k)``. Epochs
  follow each other, so global sample index ``g`` is position ``g % N`` of epoch ``g // N``.
- The global batch of a step is the next ``global_batch_size`` samples of that sequence; dp rank
  ``r`` of ``D`` takes rows ``[r * G/D, (r+1) * G/D)`` of it.
- The loader's state is ``samples_consumed`` (global samples handed out; ``epoch`` is derived and
  stored for humans). Because the order does not depend on ``D``, a state saved by a run on 4 ranks
  resumes on 2 ranks (or with other worker counts) with exactly the batches the first run would
  have seen next.

Each rank reads only the shards its rows fall in; with shards much larger than a global batch that
is every shard, once per epoch (shards are a few MB, far less than the compute they feed). A shard
is verified against the manifest's sha256 when fetched, decoded once, kept in a small cache, and the
next shard of the order is prefetched in a background thread.

Worker processes (``loader_workers``) each produce every W-th step; torch's DataLoader returns them
in step order. Each worker fetches the shards its steps touch (so W workers read each shard W times):
workers buy overlap of fetch/decode with training, not less I/O. State lives in the consuming process (a count of batches taken), so prefetched but
unconsumed batches are never lost or skipped on resume: a plain DataLoader suffices.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer.config import JobConfig
from trainer.data.errors import DataError
from trainer.data.manifest import DatasetManifest, ShardInfo, read_manifest
from trainer.data.shards import fetch_shard
from trainer.data.synthetic import SyntheticSamples
from trainer.data.tokenizer import parse_tokenizer, read_tokenizer_bytes

Batch = tuple[torch.Tensor, torch.Tensor]
SHARD_CACHE = 3


class SampleSource(Protocol):
    samples_per_epoch: int | None

    def rows(self, start: int, count: int) -> np.ndarray:
        """Samples ``start .. start+count-1`` of the global order: int array [count, seq_len + 1]."""


class ShardedSamples:
    """The train split of a prepared dataset in the seeded global order (see module docstring)."""

    def __init__(self, manifest: DatasetManifest, seed: int) -> None:
        self.manifest, self.seed = manifest, seed
        self.shards = manifest.split_shards("train")
        self.samples_per_epoch = sum(s.samples for s in self.shards)
        self._epoch: int | None = None
        self._shard_order: np.ndarray = np.empty(0, dtype=np.int64)
        self._offsets: list[int] = []
        self._within_key: tuple[int, int] | None = None
        self._within_order: np.ndarray = np.empty(0, dtype=np.int64)
        self._cache: OrderedDict[int, Future[np.ndarray]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None  # created on first use: after any worker fork

    def rows(self, start: int, count: int) -> np.ndarray:
        out = np.empty((count, self.manifest.sample_len), dtype=np.int64)
        for row, index in enumerate(range(start, start + count)):
            epoch, position = divmod(index, self.samples_per_epoch)
            self._set_epoch(epoch)
            slot = bisect.bisect_right(self._offsets, position) - 1
            shard = int(self._shard_order[slot])
            samples = self._shard(shard, prefetch=int(self._shard_order[(slot + 1) % len(self.shards)]))
            out[row] = samples[self._within(epoch, shard)[position - self._offsets[slot]]]
        return out

    def _within(self, epoch: int, shard: int) -> np.ndarray:
        """The sample order inside ``shard`` for ``epoch`` (memoised for the current shard)."""
        if self._within_key != (epoch, shard):
            self._within_key = (epoch, shard)
            self._within_order = np.random.default_rng([self.seed, epoch, shard]).permutation(
                self.shards[shard].samples
            )
        return self._within_order

    def _set_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._epoch = epoch
            self._shard_order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
            sizes = [self.shards[k].samples for k in self._shard_order]
            self._offsets = [0, *itertools.accumulate(sizes)][:-1]

    def _shard(self, index: int, prefetch: int) -> np.ndarray:
        for wanted in (index, prefetch):
            if wanted in self._cache:
                self._cache.move_to_end(wanted)
            else:
                self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="shard-prefetch")
                self._cache[wanted] = self._pool.submit(self._fetch, self.shards[wanted])
        while len(self._cache) > SHARD_CACHE:
            self._cache.popitem(last=False)
        return self._cache[index].result()

    def _fetch(self, shard: ShardInfo) -> np.ndarray:
        return fetch_shard(
            self.manifest.url_of(shard.name), shard, self.manifest.dtype, self.manifest.sample_len
        )


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
            )
            self._iterator = iter(loader)
        batch = next(self._iterator)
        self.samples_consumed += self.global_batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        per_epoch = self.source.samples_per_epoch
        return {
            "samples_consumed": self.samples_consumed,
            "epoch": self.samples_consumed // per_epoch if per_epoch else 0,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue right after the last sample the saved loader handed out (any dp size, any workers)."""
        self.close()
        self.samples_consumed = int(state["samples_consumed"])

    def close(self) -> None:
        """Stop the worker processes (they restart from the current position on the next ``next``)."""
        self._iterator = None


def build_loader(job: JobConfig, dp_rank: int, dp_size: int) -> StepLoader:
    """The loader for this dp rank: the prepared dataset at ``job.data_url``, or synthetic tokens."""
    sample_len = job.train.seq_len + 1
    if job.data_url is None:
        source: SampleSource = SyntheticSamples(job.seed, job.model.vocab_size, sample_len)
    else:
        manifest = read_manifest(job.data_url)
        if manifest.seq_len != job.train.seq_len:
            raise DataError(
                f"dataset {job.data_url} was packed for seq_len={manifest.seq_len} but "
                f"train.seq_len={job.train.seq_len}; prepare it again with this seq_len"
            )
        if manifest.tokenizer_vocab_size > job.model.vocab_size:
            raise DataError(
                f"dataset {job.data_url} has token ids up to {manifest.tokenizer_vocab_size - 1} "
                f"but model.vocab_size={job.model.vocab_size}; raise model.vocab_size"
            )
        source = ShardedSamples(manifest, job.seed)
    return StepLoader(source, job.train.global_batch_size, dp_rank, dp_size, job.loader_workers)


def validation_batches(manifest_url: str, batch_size: int, max_batches: int) -> Iterator[Batch]:
    """Up to ``max_batches`` batches of the val split, in stored order (the same batches every call)."""
    manifest = read_manifest(manifest_url)
    pending: list[np.ndarray] = []
    produced = 0
    for shard in manifest.split_shards("val"):
        pending.extend(fetch_shard(manifest.url_of(shard.name), shard, manifest.dtype, manifest.sample_len))
        while len(pending) >= batch_size and produced < max_batches:
            yield to_batch(np.stack(pending[:batch_size]))
            pending, produced = pending[batch_size:], produced + 1
        if produced >= max_batches:
            return
    if pending and produced < max_batches:
        yield to_batch(np.stack(pending))


def load_tokenizer(manifest_url: str) -> Tokenizer:
    """The tokenizer the dataset was encoded with (checked against the manifest's sha256)."""
    manifest = read_manifest(manifest_url)
    url = manifest.url_of(manifest.tokenizer)
    data = read_tokenizer_bytes(url)
    if hashlib.sha256(data).hexdigest() != manifest.tokenizer_sha256:
        raise DataError(f"tokenizer {url} does not match the manifest's sha256; re-run data preparation")
    return parse_tokenizer(data, url, manifest.vocab_size)
