"""One owner per checkpoint location: a lease object that a second run is refused by.

Two launches writing one checkpoint location delete each other's in-flight checkpoints, adopt each
other's commits and interleave their metrics. So the launcher (``tessera train``, the pipeline's
train task) holds ``<checkpoint url>/owner.json`` while its agents run, on a local disk, ``gs://`` or
``s3://`` alike:

- taking it is an exclusive create the store arbitrates (:func:`trainer.storage.create_exclusive`),
  so of two launches started together exactly one wins;
- the holder renews it every ``ttl_s / 3`` seconds; a holder that crashed stops renewing and its
  lease expires after ``ttl_s``, or at once when it was a process on this host that is gone;
- an expired lease is taken over by deleting it and creating a new one. Two launches racing for the
  same expired lease within one round trip could both delete; the loser of the create is refused.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from trainer import storage
from trainer.failures import UserError

log = logging.getLogger(__name__)

LEASE_NAME = "owner.json"
TTL_S = 30.0
# Set for the ranks of a launch on this host: the lease holder (host, pid, run id) that launched them.
LAUNCHER_ENV = "TESSERA_LAUNCHER"


class LeaseHeld(UserError):
    """Another launch owns the checkpoint location; the message names it and when its lease ends."""


def _this_launch() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


class LauncherGone(RuntimeError):
    """This rank's launcher no longer holds the lease: it must not commit (or delete) checkpoints."""


def launcher_env(run_id: str) -> dict[str, str]:
    """The environment that tells a launch's ranks which lease holder launched them."""
    return {LAUNCHER_ENV: json.dumps({**_this_launch(), "run_id": run_id})}


def check_launcher(checkpoint_url: str) -> None:
    """Raise :class:`LauncherGone` unless the launcher named by :data:`LAUNCHER_ENV` is alive and
    still holds the lease on ``checkpoint_url`` (where anyone holds it). Called before every commit:
    a ``tessera train`` killed with ``kill -9`` leaves its ranks (in sessions of their own) alive for
    seconds, and a relaunch may already own the location; they would commit, and retire checkpoints,
    beside it.
    Ranks launched without it (a Kubernetes job: its lease lives with the orchestrator) are not checked."""
    launcher = json.loads(os.environ.get(LAUNCHER_ENV) or "null")
    if launcher is None:
        return
    if _gone(launcher):
        raise LauncherGone(
            f"launcher pid {launcher['pid']} of run {launcher['run_id']!r} is gone; not committing to "
            f"{checkpoint_url}"
        )
    holder = Lease(checkpoint_url, launcher["run_id"]).current()
    # No holder: a launch that claimed nothing (a test or benchmark calling Run.launch_local alone);
    # its launcher is alive, checked above, and nobody else owns the location.
    if holder is not None and {key: holder.get(key) for key in launcher} != launcher:
        raise LauncherGone(
            f"the lease on {checkpoint_url} is no longer this launch's (held by {holder}); not committing"
        )


def _gone(holder: dict[str, Any]) -> bool:
    """True when the holder was a process on this host that no longer exists."""
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, TypeError, ValueError):
        return False
    return False


@dataclass
class Lease:
    """The lease on ``checkpoint_url`` for ``run_id``; use as a context manager around the launch."""

    checkpoint_url: str
    run_id: str
    ttl_s: float = TTL_S

    def __post_init__(self) -> None:
        self.url = storage.join(self.checkpoint_url, LEASE_NAME)
        self.me = {**_this_launch(), "run_id": self.run_id}
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost: str | None = None  # set when another launch took the lease from under us

    def _is_mine(self, holder: dict[str, Any] | None) -> bool:
        return holder is not None and {k: holder.get(k) for k in self.me} == self.me

    def _record(self) -> bytes:
        return json.dumps({**self.me, "expires": time.time() + self.ttl_s}).encode()

    def current(self) -> dict[str, Any] | None:
        try:
            return json.loads(storage.read(self.url))
        except storage.StoreNotFound:
            return None
        except ValueError:  # a torn or hand-edited file: nobody can be shown to hold it
            return {}

    def acquire(self) -> None:
        """Take the lease, or raise :class:`LeaseHeld` naming the holder."""
        for _ in range(3):
            if storage.create_exclusive(self.url, self._record()):
                break
            holder = self.current()
            if holder is None:
                continue  # released between our create and our read: try again
            expired = float(holder.get("expires", 0)) < time.time() or _gone(holder)
            if not expired:
                raise LeaseHeld(
                    f"checkpoint location {self.checkpoint_url} is in use by run {holder.get('run_id')!r} "
                    f"(pid {holder.get('pid')} on {holder.get('host')}, lease renewed until "
                    f"{time.strftime('%H:%M:%S', time.localtime(float(holder['expires'])))}); wait for it to "
                    "finish or stop it, or give this run its own run directory / checkpoint.url"
                )
            log.warning("taking over the expired lease of %s on %s", holder, self.checkpoint_url)
            storage.remove(self.url)
        else:
            raise LeaseHeld(f"could not take the lease on {self.checkpoint_url}: it keeps changing hands")
        self._renewer = threading.Thread(target=self._renew, name="lease-renewer", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                holder = self.current()
                if holder is not None and not self._is_mine(holder):
                    self.lost = (
                        f"run {holder.get('run_id')!r} (pid {holder.get('pid')} on {holder.get('host')})"
                    )
                    log.error("lost the lease on %s to %s", self.checkpoint_url, self.lost)
                    return
                storage.write_atomic(self.url, self._record())
            except storage.StoreError as error:  # a store hiccup: the next renewal may succeed
                log.warning("could not renew the lease on %s: %s", self.checkpoint_url, error)

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self._is_mine(self.current()):
            storage.remove(self.url)

    def __enter__(self) -> Lease:
        if self._renewer is None:  # not yet taken (``Run.claim`` hands over a lease it already holds)
            self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
