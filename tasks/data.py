"""Data preparation as a cached task: tokenize, pack and shard once per distinct input."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from trainer.config import DataConfig
from trainer.data.prepare import prepare_dataset
from trainer.progress import interactive


# Cached on the inputs and this task's source, with the result (the manifest URL) persisted, so a
# re-run of the pipeline, or a retry of the flow, skips the tokenizer and the shard writes.
@task(name="prepare-dataset", cache_policy=INPUTS + TASK_SOURCE, persist_result=True, tags=["data"])
def prepare_dataset_task(data: DataConfig, vocab_size: int, seq_len: int, seed: int) -> str:
    """Tokenize, pack into ``seq_len + 1`` samples and write webdataset shards; return the manifest URL."""
    return prepare_dataset(data, vocab_size=vocab_size, seq_len=seq_len, seed=seed, progress=interactive())
