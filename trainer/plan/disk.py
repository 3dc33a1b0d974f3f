"""The raw speed of the disk under a directory: what a checkpoint write and read are held against.

One large sequential write in big blocks, fsync'd (a checkpoint is durable only once it is on the
disk, and without the fsync the figure is the page cache's), then the same file read back after its
pages are dropped from the page cache (``posix_fadvise(DONTNEED)``: no root needed, unlike
``drop_caches``), so the read is the disk's too. ``tessera calibrate`` writes the write speed into the
profile as ``checkpoint_write_bandwidth``; ``make bench-gpu`` sets checkpoint saves and loads beside both.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from trainer.units import MiB

BLOCK = 64 * MiB  # large enough that the per-call cost is nil, small enough to hold twice


def drop_cached(path: Path) -> None:
    """Ask the kernel to forget ``path``'s cached pages (written back already, so none is lost)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_disk_speed(directory: Path, nbytes: int) -> dict[str, float]:
    """Sequential write (with fsync) and read of ``nbytes`` in a scratch file under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(min(BLOCK, nbytes))  # incompressible, in case the store compresses
    blocks = max(1, nbytes // len(block))
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".raw-disk-") as scratch:
        fd = scratch.fileno()
        began = time.perf_counter()
        for _ in range(blocks):
            os.write(fd, block)
        os.fsync(fd)
        write_s = time.perf_counter() - began
        drop_cached(Path(scratch.name))
        began = time.perf_counter()
        with open(scratch.name, "rb", buffering=0) as source:
            while source.read(len(block)):
                pass
        read_s = time.perf_counter() - began
    size = blocks * len(block)
    return {
        "bytes": size,
        "write_s": write_s,
        "write_gbps": size / write_s / 1e9,
        "read_s": read_s,
        "read_gbps": size / read_s / 1e9,
    }
