"""Weighted mixtures of prepared datasets: the mixture file, and the seeded order that draws from it.

``<output_url>/mixture-<hash>.json`` names each source's prepared dataset, its weight and the weight
schedule; training reads only its URL (``JobConfig.data_url``), as it would a single card.

Which source global sample ``g`` comes from is a pure function of ``(seed, g, weights at g's step)``:
``u = frac(g / φ + offset(seed))`` (a golden-ratio Weyl sequence, in exact 64-bit integer arithmetic)
falls into one source's slice of the cumulative weights. A low-discrepancy sequence rather than
independent draws: over any N consecutive samples each source's share is within a few samples of
its weight (|error| ~ log N / N, not 1/√N), so even one global batch is close to the mixture.

Within a source, samples follow that source's own seeded order (:class:`ShardedSamples`) from a
counter: the mixture's state is the number of samples drawn from each source so far. Those counters
make resume exact across a change of data-parallel degree (every rank derives the same counters
from the same global order) and across a change of schedule: the weights of steps already trained
never enter the state, so a run resumed with new weights from step S on continues every source
exactly where it stopped and draws with the new weights from S.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, Field

from trainer.config import MixtureStage
from trainer.data.errors import DataError
from trainer.data.order import SampleSource
from trainer.storage import StoreNotFound, read, write_atomic

MIXTURE_PREFIX = "mixture-"
# 2^64 / φ, odd: multiples of it mod 2^64 are the golden-ratio Weyl sequence in fixed point.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_UNIT = 2.0**-53


class SourceEntry(BaseModel):
    name: str
    manifest: str = Field(description="The source's manifest.json, relative to the mixture file's directory.")
    weight: float


class MixtureManifest(BaseModel):
    kind: str = "mixture"
    sources: list[SourceEntry]
    schedule: list[MixtureStage] = Field(default_factory=list)
    tokenizer_sha256: str = Field(description="Every source is tokenized with this tokenizer.")


def mixture_name(entries: list[SourceEntry], schedule: list[MixtureStage]) -> str:
    content = json.dumps(
        [[e.model_dump() for e in entries], [s.model_dump() for s in schedule]], sort_keys=True
    )
    return f"{MIXTURE_PREFIX}{hashlib.sha256(content.encode()).hexdigest()[:16]}.json"


def is_mixture(url: str) -> bool:
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return name.startswith(MIXTURE_PREFIX) and name.endswith(".json")


def write_mixture(url: str, mixture: MixtureManifest) -> None:
    write_atomic(url, mixture.model_dump_json(indent=2).encode())


def read_mixture(url: str) -> MixtureManifest:
    try:
        return MixtureManifest.model_validate_json(read(url))
    except StoreNotFound:
        raise DataError(f"no mixture file at {url!r}; run data preparation first (or fix data_url)") from None
    except ValueError as error:
        raise DataError(f"{url!r} is not a tessera mixture file ({error})") from error


class WeightSchedule:
    """Cumulative source weights for any step: the base weights, replaced at each schedule stage."""

    def __init__(self, base: list[float], schedule: list[MixtureStage]) -> None:
        self.first_steps = np.array([stage.step for stage in schedule], dtype=np.int64)
        stages = [base, *(stage.weights for stage in schedule)]
        cumulative = np.cumsum(np.asarray(stages, dtype=np.float64), axis=1)
        self.cumulative = cumulative / cumulative[:, -1:]
        self.cumulative[:, -1] = 1.0  # exactly: u < 1 always lands in some source

    def stage_of(self, steps: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.first_steps, steps, side="right")


class MixtureSamples:
    """The global sample order of a mixture: ``rows(start, count)`` as for one dataset, plus counters."""

    samples_per_epoch: int | None = None  # sources cycle through their own epochs independently

    def __init__(
        self,
        sources: Mapping[str, SampleSource],
        weights: WeightSchedule,
        seed: int,
        global_batch_size: int,
    ) -> None:
        self.names = list(sources)
        self.sources = list(sources.values())
        self.weights, self.global_batch_size = weights, global_batch_size
        self.offset = np.uint64(np.random.default_rng([seed, 0x6D6978]).integers(2**63))
        self._anchor = (0, np.zeros(len(self.sources), dtype=np.int64))  # set by resume()
        self._memo = self._anchor  # counters at a later sample, to advance from

    def choices(self, start: int, count: int) -> np.ndarray:
        """The source index of global samples ``start .. start+count-1``."""
        g = np.arange(start, start + count, dtype=np.uint64)
        u = ((g * _GOLDEN + self.offset) >> np.uint64(11)).astype(np.float64) * _UNIT
        steps = np.arange(start, start + count, dtype=np.int64) // self.global_batch_size + 1
        cumulative = self.weights.cumulative[self.weights.stage_of(steps)]
        return (u[:, None] >= cumulative).sum(axis=1)

    def counts_at(self, sample: int) -> np.ndarray:
        """Samples drawn from each source before global sample ``sample`` (at or after the resume point)."""
        start, counts = self._memo if self._memo[0] <= sample else self._anchor
        if sample < start:
            raise ValueError(f"sample {sample} is before the loader's resume point {start}")
        counts = counts + np.bincount(self.choices(start, sample - start), minlength=len(self.sources))
        self._memo = (sample, counts)
        return counts

    def rows(self, start: int, count: int) -> np.ndarray:
        counts = self.counts_at(start)
        picks = self.choices(start, count)
        parts = {}
        for index, source in enumerate(self.sources):
            chosen = picks == index
            if chosen.any():
                parts[index] = (chosen, source.rows(int(counts[index]), int(chosen.sum())))
        out = np.empty((count, next(iter(parts.values()))[1].shape[1]), dtype=np.int64)
        for chosen, rows in parts.values():
            out[chosen] = rows
        return out

    def state_at(self, sample: int) -> dict[str, dict[str, int]]:
        counts = self.counts_at(sample)
        return {"source_samples": {name: int(n) for name, n in zip(self.names, counts, strict=True)}}

    def close(self) -> None:
        for source in self.sources:
            source.close()

    def resume(self, sample: int, state: Mapping[str, object]) -> None:
        """Continue from global sample ``sample`` with each source at its saved counter."""
        saved = state.get("source_samples")
        if not isinstance(saved, Mapping) or set(saved) != set(self.names):
            raise DataError(
                f"the loader state's sources {sorted(saved) if isinstance(saved, Mapping) else saved} "
                f"are not this mixture's {sorted(self.names)}; a run keeps its set of sources (give a "
                "source weight 0 in data.mixture.schedule to stop drawing from it)"
            )
        self._anchor = (sample, np.array([int(saved[name]) for name in self.names], dtype=np.int64))
        self._memo = self._anchor
