"""Data pipeline: corpus → byte-level BPE → packed ``seq_len + 1`` samples → webdataset shards + manifest,
and the resumable, dp-size-independent loader that reads them back. Plain library: no Prefect here.

    manifest_url = prepare_dataset(cfg.data, vocab_size, seq_len, seed)   # cached on its inputs
    loader = build_loader(job, dp_rank, dp_size)                         # next(loader) -> (inputs, targets)

See ``prepare`` for the separately callable steps and ``loader`` for the global order rule.
"""

from trainer.data.errors import DataError
from trainer.data.loader import StepLoader, build_loader, load_tokenizer, validation_batches
from trainer.data.manifest import DatasetManifest, read_manifest
from trainer.data.prepare import build_shards, dataset_url, find_prepared, prepare_dataset, prepare_tokenizer

__all__ = [
    "DataError",
    "DatasetManifest",
    "StepLoader",
    "build_loader",
    "build_shards",
    "dataset_url",
    "find_prepared",
    "load_tokenizer",
    "prepare_dataset",
    "prepare_tokenizer",
    "read_manifest",
    "validation_batches",
]
