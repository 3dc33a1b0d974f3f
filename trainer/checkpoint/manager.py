"""When to save, how (sync / async thread / async process), committing, resuming and retention.

A save writes DCP shards into ``<url>/step-NNNNNN/``, hashing each file as it is written
(:mod:`trainer.checkpoint.digests`); once every rank's shards and DCP's ``.metadata`` are written,
rank 0 checks the files against one listing and writes the ``tessera.json`` commit record with their
digests (the commit), then applies retention. Async saves do all of that off the training thread;
the next save (or ``close``) waits for it, so at most one save is ever in flight and retention never
races a write.

Process-mode async saves spawn a checkpoint process that re-imports ``__main__``: the entry point
needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter

from trainer import storage
from trainer.checkpoint import store
from trainer.checkpoint.commit import (
    COMMIT_FILE,
    IMPORTED_FROM,
    CommitRecord,
    check_model,
    checkpoint_files,
    list_checkpoints,
    read_commit,
    saved_files,
    step_dir_name,
    step_dirs,
    write_commit,
)
from trainer.checkpoint.errors import CheckpointError, CheckpointMismatch
from trainer.checkpoint.lease import check_launcher
from trainer.checkpoint.pins import pinned_steps
from trainer.checkpoint.state import APP_KEY, ModelOptimizerState, RNGState
from trainer.config import CheckpointConfig
from trainer.failures import is_infra_error
from trainer.rank.fault_injection import FaultInjector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveTimes:
    """Where the last committed save's time went, in seconds, phase after phase: copying the state to
    host memory (async modes only), writing the files, the commit (its digests and ``tessera.json``)
    and retention. Each commit logs the first three; the checkpoint benchmark reports them all."""

    staging_s: float
    write_s: float
    commit_s: float
    retain_s: float

    @property
    def total_s(self) -> float:
        return self.staging_s + self.write_s + self.commit_s + self.retain_s


class CheckpointManager:
    """One per training process; every method except ``latest`` is collective across ranks."""

    def __init__(
        self,
        url: str,
        cfg: CheckpointConfig,
        interval_steps: int,
        model_fingerprint: str,
        world_size: int,
        rank: int,
        layout: dict[str, Any],
        faults: FaultInjector | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.interval_steps = interval_steps
        self.model_fingerprint = model_fingerprint
        self.world_size = world_size
        self.rank = rank
        self.layout = layout
        self.faults = faults  # the fault tests' hook into a save; inert unless TESSERA_FAULT_* is set
        # Seconds checkpointing blocked the caller since the previous maybe_save: this call, plus any
        # optimizer step that waited for a background copy (summing it over steps gives the total).
        self.last_stall_s = 0.0
        self._hook_stall_s = 0.0
        # Rank 0's clock for not starting a save the run's end would wait for (see _would_outlast_run):
        # when the last maybe_save call came, the step time between the last two, when the save in
        # flight began, and how long the last committed one took from its start to its commit.
        self._last_call: float | None = None
        self._step_s: float | None = None
        self._save_began = 0.0
        self._staged_at: float | None = None
        self._save_s: float | None = None
        self.last_save_times: SaveTimes | None = None
        with store.store_errors("create checkpoint directory", self.url):
            storage.filesystem(self.url)  # fail now, naming the URL, rather than at the first save
            if rank == 0:
                storage.ensure_dir(self.url)
        self._distributed = dist.is_available() and dist.is_initialized()
        # An async save runs collectives from a background thread; its own gloo group keeps them from
        # interleaving with the training step's collectives on the default group.
        self._pg = dist.new_group(backend="gloo") if self._distributed and cfg.mode != "sync" else None
        self._stager = _stager(cfg.mode)
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        self._staging: Future | None = None
        self._upload: Future | None = None
        self._commit: Future | None = None
        self._guarded: set[int] = set()

    def latest(self) -> CommitRecord | None:
        """The newest committed or validated checkpoint; partial writes and corrupt ones are skipped."""
        good = [m for m in list_checkpoints(self.url) if m.good]
        return good[-1] if good else None

    def restore(self, state: dict[str, Stateful]) -> CommitRecord | None:
        """Load the newest good checkpoint that loads into ``state``; None if there is none.

        A checkpoint whose files are truncated or missing, or that fails to load, is marked corrupt
        (with the reason) and the next older one is tried: a retried job never trips on it again, so
        one bad checkpoint costs one checkpoint interval, not a crash loop. Truncation is caught by a
        size check against the record (one listing); flipped bytes are left to the validation task,
        since hashing every shard at each resume would cost minutes on a large model.
        """
        self.remove_partials()
        touched = False  # a failed load may have overwritten part of ``state``
        for record in reversed([m for m in list_checkpoints(self.url) if m.good]):
            problem = self._rank0_says(_size_problem(record) if self.rank == 0 else "")
            if not problem:
                try:
                    touched = True
                    self.load(record, state)
                    return record
                except CheckpointMismatch:
                    raise
                except CheckpointError as exc:
                    if is_infra_error(exc):  # the store failed, not the checkpoint: the retry reloads it
                        raise
                    problem = str(exc)
            self._mark_corrupt(record, problem)
        if touched:
            raise CheckpointError(
                f"no checkpoint under {self.url} loads: each is now marked corrupt, with the reason in its "
                "tessera.json; rerunning starts from step 0 unless a good checkpoint is put back"
            )
        return None

    def load(self, record: CommitRecord, state: dict[str, Stateful]) -> None:
        """Load ``record``'s checkpoint into ``state`` in place, resharding to this job's layout."""
        check_model(record, self.model_fingerprint)
        if record.weights_only:
            # An import: training starts from its weights at its step, with a fresh optimizer, RNG and data
            # order, as a new run would (there is nothing else in it to restore).
            state = {APP_KEY: state[APP_KEY].weights()}  # type: ignore[attr-defined]
            log.info("starting from the weights imported from %s", record.meta[IMPORTED_FROM])
        elif record.world_size != self.world_size:
            skipped = [key for key, value in state.items() if isinstance(value, RNGState)]
            state = {key: value for key, value in state.items() if key not in skipped}
            log.warning(
                "world size changed %d -> %d: not restoring per-rank RNG state %s",
                record.world_size,
                self.world_size,
                skipped,
            )
        store.load(state, record.url, no_dist=not self._distributed)
        log.info("loaded checkpoint %s (step %d)", record.url, record.step)

    def maybe_save(
        self,
        step: int,
        state: dict[str, Stateful],
        meta: dict[str, Any],
        force: bool = False,
        last_step: int | None = None,
    ) -> None:
        """Save at every ``interval_steps`` (or when forced); see ``last_stall_s`` for the time it blocked.

        With ``last_step`` (the run's final step, which is saved forced), an interval save that would
        still be in flight then is skipped: the final save would wait for it, and the run's end would be
        held up for more than one save."""
        start = time.perf_counter()
        if self._last_call is not None:
            self._step_s = start - self._last_call
        self._last_call = start
        stalled_in_optimizer, self._hook_stall_s = self._hook_stall_s, 0.0
        if not force and (step % self.interval_steps or self._would_outlast_run(step, last_step)):
            self.last_stall_s = stalled_in_optimizer
            return
        self._save(step, state, meta)
        self.last_stall_s = stalled_in_optimizer + time.perf_counter() - start

    def _would_outlast_run(self, step: int, last_step: int | None) -> bool:
        """Whether a save started at ``step`` would outlast the steps left before ``last_step``, at the
        last committed save's duration and the last step's time; rank 0's clock decides for every rank
        (they must all save, or none). Unknown until a save has committed: then it saves. A sync save
        is never in flight at the final step (it commits before the next step), so it always saves."""
        if last_step is None or self.cfg.mode == "sync":
            return False
        late = (
            self.rank == 0
            and self._step_s is not None
            and self._save_s is not None
            and (last_step - step) * self._step_s < self._save_s
        )
        if self._rank0_says("skip" if late else "") != "skip":
            return False
        log.info("not saving step %d: the save would still be in flight at the final step", step)
        return True

    def _save(self, step: int, state: dict[str, Stateful], meta: dict[str, Any]) -> None:
        """Save ``state`` as step ``step``, unless that step is already committed (a retried attempt)."""
        self._wait()
        self._save_began = time.perf_counter()
        self._staged_at = None
        step_url = storage.join(self.url, step_dir_name(step))
        existing = read_commit(step_url)
        if existing is not None and existing.good:
            log.info("checkpoint %s already committed; not saving it again", step_url)
            return
        self._clear(step_url)
        record = self._new_record(step, meta)
        writer = store.storage_writer(step_url)
        if self.faults is not None:
            writer = self.faults.checkpoint_writer(writer, step, self.rank, self.world_size)
        if self.cfg.mode == "sync":
            self._save_now(state, writer, record, step_url)
        else:
            self._start_save(state, writer, record, step_url)

    def _new_record(self, step: int, meta: dict[str, Any]) -> CommitRecord:
        meta = dict(meta)
        return CommitRecord(
            step=step,
            tokens=int(meta.pop("tokens", 0)),
            model_fingerprint=self.model_fingerprint,
            world_size=self.world_size,
            layout=self.layout,
            files={},
            meta=meta,
        )

    def _save_now(
        self, state: dict[str, Stateful], writer: StorageWriter, record: CommitRecord, step_url: str
    ) -> None:
        """Sync mode: write, then commit on rank 0, before returning."""
        with store.dcp_errors("saving", step_url):
            metadata = dcp.save(state, storage_writer=writer, no_dist=not self._distributed)
        if self.rank == 0:
            self._commit_and_retain(record, step_url, metadata)

    def _start_save(
        self, state: dict[str, Stateful], writer: StorageWriter, record: CommitRecord, step_url: str
    ) -> None:
        """Async modes: stage and upload in the background, then commit on rank 0 once the upload is
        done; the next save (or ``close``) waits for all three."""
        kind = (
            AsyncCheckpointerType.PROCESS
            if self.cfg.mode == "async_process"
            else AsyncCheckpointerType.THREAD
        )
        response = dcp.async_save(
            state,
            storage_writer=writer,
            process_group=self._pg,
            async_checkpointer_type=kind,
            async_stager=self._stager,
            no_dist=not self._distributed,
        )
        self._guard_optimizers(state)
        if isinstance(response, AsyncSaveResponse):
            self._staging, self._upload = response.staging_completion, response.upload_completion
            self._staging.add_done_callback(self._mark_staged)
        else:
            self._upload = response
        if self.rank == 0:
            self._commit = self._committer.submit(self._commit_after, self._upload, record, step_url)

    def close(self) -> None:
        """Finish and commit any save in flight."""
        self._wait()
        self._committer.shutdown()
        if self._stager is not None:
            self._stager.close()

    def _wait(self) -> None:
        try:
            with store.dcp_errors("saving", self.url):
                for future in (self._staging, self._upload, self._commit):
                    if future is not None:
                        future.result()
        finally:
            self._staging = self._upload = self._commit = None

    def _guard_optimizers(self, state: dict[str, Stateful]) -> None:
        """Make every optimizer step wait until the save in flight has copied the state.

        Staging runs in the background so the caller only pays for it if the next optimizer step
        (the first thing to change parameters or moments in place) comes before the copy is done.
        """
        for value in state.values():
            if isinstance(value, ModelOptimizerState):
                for optimizer in value.optimizers:
                    if id(optimizer) not in self._guarded:
                        optimizer.register_step_pre_hook(self._wait_for_staging)
                        self._guarded.add(id(optimizer))

    def _wait_for_staging(self, *_: Any) -> None:
        if self._staging is not None:
            start = time.perf_counter()
            self._staging.result()
            self._staging = None
            self._hook_stall_s += time.perf_counter() - start

    def _rank0_says(self, value: str) -> str:
        """Rank 0's ``value`` on every rank: each rank's own listing could differ, and a rank that
        loads while another falls back would deadlock in the load's collectives."""
        if not self._distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _mark_corrupt(self, record: CommitRecord, reason: str) -> None:
        log.error("checkpoint %s is corrupt, falling back to an older one: %s", record.url, reason)
        if self.rank == 0:
            record.status, record.reason = "corrupt", reason
            write_commit(record.url, record)
        if self._distributed:
            dist.barrier()

    def _clear(self, step_url: str) -> None:
        """Remove leftovers of an earlier attempt at this step, so they cannot mix with the new files.

        Rank 0 decides; the barrier keeps every rank from writing (DCP creates the directory) before.
        """
        if self.rank == 0:
            with store.store_errors("remove the partial checkpoint", step_url):
                if storage.exists(step_url):
                    log.info("removing partial checkpoint %s before rewriting it", step_url)
                    storage.remove(step_url, recursive=True)
        if self._distributed:
            dist.barrier()

    def _mark_staged(self, _: Future) -> None:
        self._staged_at = time.perf_counter()

    def _commit_after(self, upload: Future, record: CommitRecord, step_url: str) -> None:
        self._commit_and_retain(record, step_url, upload.result())

    def _commit_and_retain(self, record: CommitRecord, step_url: str, metadata: Metadata) -> None:
        """Commit with the digests the writer computed as it wrote (``metadata``: what the save returned)."""
        written = time.perf_counter()
        check_launcher(self.url)  # orphaned ranks of a killed launch commit nothing, and delete nothing
        record.files = saved_files(step_url, metadata)
        write_commit(step_url, record)
        committed = time.perf_counter()
        self._save_s = committed - self._save_began
        staged = self._staged_at or self._save_began
        log.info(
            "committed checkpoint %s (%d files, %.1f s: staging %.1f s, write %.1f s, commit %.2f s)",
            step_url,
            len(record.files),
            self._save_s,
            staged - self._save_began,
            written - staged,
            committed - written,
        )
        self._retain()
        self.last_save_times = SaveTimes(
            staging_s=staged - self._save_began,
            write_s=written - staged,
            commit_s=committed - written,
            retain_s=time.perf_counter() - committed,
        )

    def newest_step(self) -> int:
        """The newest good checkpoint's step as rank 0 lists it (0 if none), on every rank."""
        latest = self.latest() if self.rank == 0 else None
        return int(self._rank0_says(str(latest.step if latest else 0)))

    def remove_partials(self) -> None:
        """Rank 0 deletes what killed saves left (step directories without a record) before training:
        the launcher holds the location's lease, so no save is in flight, and on a full disk their
        space is what the first new checkpoint needs."""
        if self.rank != 0:
            return
        for step_url in step_dirs(self.url).values():
            if read_commit(step_url) is None:
                log.info("removing %s: a save that never committed", step_url)
                delete_checkpoint(step_url)

    def _retain(self) -> None:
        dirs = step_dirs(self.url)
        statuses = {
            step: record.status if (record := read_commit(url)) else None for step, url in dirs.items()
        }
        pinned = pinned_steps(self.url)  # queued for validation or evaluation: not now
        for step in steps_to_delete(statuses, self.cfg.keep_last, self.cfg.keep_every):
            if step not in pinned:
                delete_checkpoint(dirs[step])


def _size_problem(record: CommitRecord) -> str:
    """'' if every file the record lists is there with its recorded size; else what is not."""
    sizes = {name: entry.size for name, entry in checkpoint_files(record.url).items()}
    wrong = [
        f"{name} ({sizes.get(name, 'missing')}, expected {digest.size} bytes)"
        for name, digest in record.files.items()
        if sizes.get(name) != digest.size
    ]
    return f"files truncated or missing: {', '.join(wrong)}" if wrong else ""


def _stager(mode: str) -> DefaultStager | None:
    """The host-memory copy an async save writes from, kept for the whole run.

    Reusing its buffers keeps staging short: a fresh stager per save allocates (and page-faults) a
    full copy of the state every time. Staging runs in a background thread (optimizer steps wait for
    it, see ``_guard_optimizers``); pinned memory speeds device-to-host copies; shared memory lets a
    checkpoint process read the copy without another one.
    """
    if mode == "sync":
        return None
    accelerator = torch.accelerator.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=accelerator,
            use_shared_memory=mode == "async_process",
            use_async_staging=True,
            use_non_blocking_copy=accelerator,
        )
    )


def steps_to_delete(statuses: dict[int, str | None], keep_last: int, keep_every: int | None) -> list[int]:
    """Retention: keep the newest ``keep_last`` good checkpoints and every good multiple of ``keep_every``.

    ``statuses`` maps step -> record status, None for a directory without a record (a stale partial:
    only called between saves, so no write is in flight). Corrupt checkpoints are never kept.
    """
    good = sorted(step for step, status in statuses.items() if status in ("committed", "validated"))
    keep = set(good[-keep_last:])
    if keep_every:
        keep.update(step for step in good if step % keep_every == 0)
    return sorted(step for step in statuses if step not in keep)


def delete_checkpoint(step_url: str) -> None:
    """CommitRecord first: an interrupted delete leaves a partial (ignored), never a committed checkpoint
    with files missing."""
    record_url = storage.join(step_url, COMMIT_FILE)
    with store.store_errors("delete", step_url):
        if storage.exists(record_url):
            storage.remove(record_url)
        storage.remove(step_url, recursive=True)
    log.info("deleted checkpoint %s", step_url)
