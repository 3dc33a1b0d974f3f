"""Checkpoint files are hashed as they are written (trainer/checkpoint/digests.py): the digests a save
commits are exactly what reading the stored files back gives, DCP's index carries none of them, and a
commit refuses files that are not what was written. One process, no torchrun: a few seconds."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint import store
from trainer.checkpoint.commit import digest_files, saved_files
from trainer.checkpoint.digests import HashingStream, written_digests
from trainer.checkpoint.errors import CheckpointError


def state() -> dict[str, object]:
    """Tensors of several sizes and dtypes (split over the writer's files), and plain objects."""
    generator = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(512, 256, generator=generator),
        "half": torch.randn(300, generator=generator).to(torch.bfloat16),
        "ints": torch.arange(17),
        "extra": {"step": 3, "name": "x"},
    }


@pytest.mark.parametrize("where", ["local", "memory"])
def test_digests_written_while_saving_are_those_of_the_stored_files(tmp_path: Path, where: str) -> None:
    url = str(tmp_path / "step-000001") if where == "local" else f"memory://digests-{tmp_path.name}/step-1"
    metadata = dcp.save(state(), storage_writer=store.storage_writer(url), no_dist=True)
    written = written_digests(metadata)
    assert written is not None
    read_back = digest_files(url)  # what validation computes: every stored file, read and hashed
    assert written == read_back
    assert ".metadata" in written and len(written) > 2  # the index and more than one shard file
    assert saved_files(url, metadata) == read_back
    index = store.storage_reader(url).read_metadata()  # the index on the store holds only real entries
    assert not hasattr(index, "tessera_file_digests")
    assert {key.fqn for key in index.storage_data} == {"big", "half", "ints", "extra.step", "extra.name"}


def test_commit_refuses_files_that_are_not_what_was_written(tmp_path: Path) -> None:
    url = str(tmp_path / "step-000001")
    metadata = dcp.save(state(), storage_writer=store.storage_writer(url), no_dist=True)
    shard = sorted(tmp_path.glob("step-000001/*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])  # torn after the write
    (tmp_path / "step-000001" / "stray.bin").write_bytes(b"x")  # and a file no rank wrote
    with pytest.raises(CheckpointError) as refused:
        saved_files(url, metadata)
    message = str(refused.value)
    assert f"{shard.name} (" in message and "stray.bin (1 bytes, none written)" in message, message


def test_hashing_stream_hashes_what_it_passes_on_and_refuses_to_seek() -> None:
    raw = io.BytesIO()
    stream = HashingStream(raw)
    stream.write(b"abc")
    stream.write(memoryview(torch.arange(4, dtype=torch.int32).numpy()))  # a typed buffer, counted in bytes
    assert stream.tell() == 3 + 16
    with pytest.raises(io.UnsupportedOperation):
        stream.seek(0)
    digest = stream.digest()
    assert (digest.sha256, digest.size) == (hashlib.sha256(raw.getvalue()).hexdigest(), 19)
    stream.close()
    assert raw.closed
