"""Pins: a checkpoint queued for validation or evaluation is not deleted by retention under it.

The pipeline pins a checkpoint when it queues its validation and unpins it when the evaluation is
over; retention (``CheckpointManager``) skips pinned steps. A pin is an empty object under
``<checkpoint url>/pins/`` whose name carries the step, who pinned it and when, so reading the pins is
one listing. A pin older than :data:`PIN_TTL_S` (its pipeline crashed) protects nothing any more.
"""

from __future__ import annotations

import contextlib
import re
import time

from trainer import storage
from trainer.checkpoint.store import store_errors

PINS_DIR = "pins"
PIN_TTL_S = 6 * 3600.0
_PIN = re.compile(r"^step-(\d+)\.([A-Za-z0-9_-]+)\.(\d+)$")


def pin(checkpoint_url: str, step: int, holder: str) -> str:
    """Protect ``step`` from retention on behalf of ``holder``; returns the pin's URL, for :func:`unpin`."""
    url = storage.join(checkpoint_url, PINS_DIR, f"step-{step:06d}.{holder}.{int(time.time())}")
    with store_errors("pin", url):
        storage.write_atomic(url, b"")
    return url


def unpin(pin_url: str) -> None:
    with store_errors("unpin", pin_url), contextlib.suppress(storage.StoreNotFound):
        storage.remove(pin_url)


def pinned_steps(checkpoint_url: str, now: float | None = None) -> set[int]:
    """Steps with a live pin under ``checkpoint_url``."""
    url = storage.join(checkpoint_url, PINS_DIR)
    with store_errors("list the pins at", url):
        try:
            entries = storage.list_dir(url)
        except storage.StoreNotFound:
            return set()
    oldest = (now or time.time()) - PIN_TTL_S
    matches = (_PIN.match(entry.name) for entry in entries)
    return {int(m.group(1)) for m in matches if m and int(m.group(3)) >= oldest}
