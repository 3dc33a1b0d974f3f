"""Data pipeline: corpus → byte-level BPE → packed ``seq_len + 1`` samples → webdataset shards + card,
and the resumable, dp-size-independent loader that reads them back. Plain library: no Prefect here.

    data_url = prepare.prepare_dataset(cfg.data, vocab_size, seq_len, seed)   # cached on its inputs
    loader = loader.build_loader(job, dp_rank, dp_size)  # next(loader) -> (inputs, targets)

The names below are imported from their modules on first use (PEP 562), not with the package: a
preparation worker needs neither torch (the loader) nor ``datasets`` (only for reading input files),
and each costs seconds to import in every worker process.

See ``prepare`` for the separately callable steps (the per-part ones fan out), ``parts`` for one
part's work, ``mixture`` for weighted sources, ``order`` and ``loader`` for the global order rule and
``fetch`` for prefetching and the local cache.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataError": "errors",
    "DatasetCard": "card",
    "read_card": "card",
    "require_card": "card",
    "StepLoader": "loader",
    "build_loader": "loader",
    "load_tokenizer": "loader",
    "validation_batches": "loader",
    "plan_preparation": "prepare",
    "prepare_dataset": "prepare",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
