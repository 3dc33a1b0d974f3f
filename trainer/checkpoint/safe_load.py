"""Loading checkpoints without executing code from them.

A checkpoint bucket is shared, long-lived storage that many jobs and people can write to, so a
checkpoint is untrusted input. torch 2.13's DCP unpickles two things with full ``pickle``: the
``.metadata`` index (``FileSystemReader.read_metadata``) and every non-tensor value
(``DefaultLoadPlanner.load_bytes``, ``torch.load(weights_only=False)``). Either lets a crafted file
run arbitrary code in every training process. Here the index is read by an unpickler that only
builds DCP's own metadata classes, and non-tensor values go through ``torch.load(weights_only=True)``
(tensors, numbers, strings, containers), which is all tessera's state holds.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from trainer.checkpoint.errors import CheckpointError

# Every global a DCP ``.metadata`` pickle references, and nothing that can run a command.
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        (dcp_metadata.__name__, name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    },
    (dcp_filesystem.__name__, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): dict,
}
_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpoint(CheckpointError):
    """The checkpoint asks to build an object outside the allowlist: refused, nothing executed."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return _METADATA_GLOBALS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_ENUMS):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"refusing to load {module}.{name}: not part of a DCP checkpoint index")


def read_metadata_safely(stream: io.IOBase) -> Metadata:
    try:
        metadata = _MetadataUnpickler(stream).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # a truncated or garbled index is corrupt, not a crash
        raise CheckpointError(f"checkpoint index unreadable: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"checkpoint index holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeMetadataReader:
    """Mixin for DCP filesystem readers: ``read_metadata`` through the allowlist unpickler.

    The index is read once per reader: callers that inspect it before ``dcp.load`` (which reads it
    again) cost no second request to the store.
    """

    fs: dcp_filesystem.FileSystemBase
    load_id: str

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        read: dict[int | None, Metadata] = self.__dict__.setdefault("_read_metadata", {})
        if rank not in read:
            path = self._get_metadata_path(rank)  # type: ignore[attr-defined]
            try:
                with self.fs.create_stream(path, "rb") as stream:
                    metadata = read_metadata_safely(stream)
            except OSError as exc:
                raise CheckpointError(f"checkpoint index {path} unreadable: {exc}") from None
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            read[rank] = metadata
        return read[rank]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor values are loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            culprit = re.search(r"unsupported GLOBAL (\S+)", str(exc), re.IGNORECASE)
            raise UnsafeCheckpoint(
                f"refusing to load {read_item.dest_index.fqn}: it unpickles "
                f"{culprit.group(1) if culprit else 'an object'}, not a tensor or plain value"
            ) from None
        # Placed as the parent does: flattened keys map back into the caller's nested dict.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
