"""The seeded global sample order of one prepared dataset, and what every sample source provides.

Order rule (what makes resume exact for any dp size):
- Epoch ``e`` visits the train shards in ``permutation(num_shards)`` seeded by ``(seed, e)`` and,
  within shard ``k``, its samples in ``permutation(samples_k)`` seeded by ``(seed, e, k)``. Epochs
  follow each other, so global sample index ``g`` is position ``g % N`` of epoch ``g // N``.

Shards are read through a :class:`~trainer.data.fetch.ShardReader`, told which shards come next in
this order so it can fetch them ahead.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from trainer.data.card import DatasetCard
from trainer.data.fetch import FetchSettings, ShardReader


class SampleSource(Protocol):
    samples_per_epoch: int | None

    def rows(self, start: int, count: int) -> np.ndarray:
        """Samples ``start .. start+count-1`` of the global order: int array [count, seq_len + 1]."""

    def state_at(self, sample: int) -> dict[str, object]:
        """What a checkpoint stores besides ``sample`` (the global samples handed out) to resume here."""

    def resume(self, sample: int, state: Mapping[str, object]) -> None:
        """Continue at global sample ``sample`` from a saved ``state_at(sample)``."""

    def close(self) -> None:
        """Stop background reads (the source stays usable: they restart on the next ``rows``)."""


class ShardedSamples:
    """The train split of a prepared dataset in the seeded global order (see the module docstring)."""

    def __init__(self, card: DatasetCard, seed: int, fetch: FetchSettings | None = None) -> None:
        self.card, self.seed = card, seed
        self.shards = card.split_shards("train")
        self.samples_per_epoch = sum(s.samples for s in self.shards)
        self.reader = ShardReader(card, self.shards, fetch or FetchSettings.from_env())
        self._layouts: dict[int, tuple[np.ndarray, list[int]]] = {}
        self._within_key: tuple[int, int] | None = None
        self._within_order: np.ndarray = np.empty(0, dtype=np.int64)

    def rows(self, start: int, count: int) -> np.ndarray:
        out = np.empty((count, self.card.sample_len), dtype=np.int64)
        row = 0
        while row < count:  # one run of consecutive positions inside one shard per pass
            epoch, position = divmod(start + row, self.samples_per_epoch)
            order, offsets = self._layout(epoch)
            slot = bisect.bisect_right(offsets, position) - 1
            shard = int(order[slot])
            first = position - offsets[slot]
            take = min(count - row, self.shards[shard].samples - first)
            samples = self.reader.get(shard, self._upcoming(epoch, slot))
            out[row : row + take] = samples[self._within(epoch, shard)[first : first + take]]
            row += take
        return out

    def state_at(self, sample: int) -> dict[str, object]:
        return {"epoch": sample // self.samples_per_epoch}

    def resume(self, sample: int, state: Mapping[str, object]) -> None:
        """Nothing to restore: the order is a function of the sample index alone."""

    def close(self) -> None:
        self.reader.close()

    def _upcoming(self, epoch: int, slot: int) -> list[int]:
        """The shards read after slot ``slot`` of ``epoch``, into the next epoch: what to fetch ahead."""
        ahead = self.reader.settings.prefetch
        following = [
            *self._layout(epoch)[0][slot + 1 : slot + 1 + ahead],
            *self._layout(epoch + 1)[0][:ahead],
        ]
        return [int(k) for k in following[:ahead]]

    def _layout(self, epoch: int) -> tuple[np.ndarray, list[int]]:
        """The shard order of ``epoch`` and each slot's first position (kept for this and the next epoch)."""
        if epoch not in self._layouts:
            self._layouts = {e: layout for e, layout in self._layouts.items() if e >= epoch - 1}
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
            sizes = [self.shards[k].samples for k in order]
            self._layouts[epoch] = (order, [0, *itertools.accumulate(sizes)][:-1])
        return self._layouts[epoch]

    def _within(self, epoch: int, shard: int) -> np.ndarray:
        """The sample order inside ``shard`` for ``epoch`` (memoised for the current shard)."""
        if self._within_key != (epoch, shard):
            self._within_key = (epoch, shard)
            self._within_order = np.random.default_rng([self.seed, epoch, shard]).permutation(
                self.shards[shard].samples
            )
        return self._within_order
