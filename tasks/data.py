"""Data preparation as a cached task, its parts fanned out as mapped tasks on Dask when the spec asks.

``data.num_proc > 1`` runs the per-part steps (``document-digests`` with ``data.dedup``, then
``prepare-part``) as mapped Prefect tasks on Prefect's Dask task runner over a ``LocalCluster`` of that
many single-threaded worker processes; ``data.dask_address`` sends them to a running Dask cluster
instead. Otherwise they run in this process, one after another.

Dask rather than Ray: the work is a flat map of pure functions over files, which is what Dask's
futures do with no more than a scheduler process, and ``prefect-dask`` is Prefect's own maintained
runner for it (the UI shows each part as a task run). Ray's strengths (actors, GPU scheduling, an
object store for large intermediate data) buy nothing here, where parts return a small record and
write their shards straight to the store; and a Ray cluster is a heavier thing to run next to
Kubernetes training jobs than a Dask scheduler.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import TaskRunner
from prefect_dask import DaskTaskRunner

from trainer.config import DataConfig
from trainer.data.parts import document_digests, prepare_part
from trainer.data.prepare import Mapper, plan_preparation, prepare_dataset, serial_map

# Each Dask worker is one process with one thread, so the tokenizer must not start its own thread pool.
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false"}

# The library's per-part steps as tasks. Not cached by Prefect: a part caches itself (part.json).
_PART_TASKS = {
    fn: task(fn, name=name, cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
    for fn, name in ((prepare_part, "prepare-part"), (document_digests, "document-digests"))
}


def dask_runner(data: DataConfig) -> DaskTaskRunner | None:
    """The Dask runner the spec names (a cluster's address, or a LocalCluster of num_proc workers), or None."""
    if data.dask_address is not None:
        return DaskTaskRunner(address=data.dask_address)
    if data.num_proc > 1:
        return DaskTaskRunner(
            cluster_kwargs={
                "n_workers": data.num_proc,
                "threads_per_worker": 1,
                "processes": True,
                "env": WORKER_ENV,
                "dashboard_address": None,
            }
        )
    return None


def mapped_on(runner: TaskRunner) -> Mapper:
    """``map_parts`` for the library: each item a task run of the step's task, on ``runner``."""

    def map_parts(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        parameter = next(iter(inspect.signature(fn).parameters))
        return runner.map(_PART_TASKS[fn], {parameter: items}).result()

    return map_parts


# Not cached by Prefect: the store keys itself by content (``<output_url>/<fingerprint>/manifest.json``),
# so a re-run finds the dataset after listing the corpus and returns at once. A Prefect cache, keyed on
# the inputs and kept in PREFECT_HOME, would outlive the files it points to (`make clean`, a second
# checkout, whose relative ``output_url`` is another directory) and hand training a missing dataset.
@task(name="prepare-dataset", cache_policy=NO_CACHE)
def prepare_dataset_task(data: DataConfig, vocab_size: int, seq_len: int, seed: int) -> str:
    """Tokenize, pack into ``seq_len + 1`` samples and write webdataset shards (per source of a mixture),
    or find them already there; return the URL training reads."""
    runner = dask_runner(data)
    if runner is None or plan_preparation(data, vocab_size, seq_len, seed).prepared():
        return prepare_dataset(data, vocab_size, seq_len, seed, map_parts=serial_map)  # no cluster to start
    with runner:
        return prepare_dataset(data, vocab_size, seq_len, seed, map_parts=mapped_on(runner))
