"""A run: one spec, built once into everything the CLI, flows, tasks, trainer and renderer need.

A :class:`Run` owns the run's identity (its id, which names its directory and its flow run), the
resolved job (checkpoint location and cadence, the dataset, the run URL a remote run mirrors to), the
plan, every path of its directory (:class:`trainer.rundir.RunDir`) and the torchrun command each
launcher runs. :meth:`Run.open` decides all of them once; nothing else derives or rewrites any of
these. It imports no Prefect: ``tessera train`` opens a Run as the pipeline's tasks do.

The resume rules, which a user can predict:

- A new flow run is a new run (``<spec name>-<last 8 hex digits of the flow run id>``), with its own
  directory, so an edited rerun, a schedule or the UI's default run always trains.
- A Prefect retry of the same flow run, and a torchrun restart, reopen the same run and resume.
- ``resume_from: <run id>`` continues an earlier run in its directory. If the spec changed in a way
  that affects training, that is refused, naming the fields, unless ``allow_changes`` lists them.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments.spec import SpecError, TrainingSpec
from trainer import storage
from trainer.checkpoint.lease import Lease, launcher_env
from trainer.config import LATER_MODEL_DEFAULTS, JobConfig
from trainer.failures import UserError
from trainer.job import resolve_job
from trainer.plan import Plan, plan_for_job
from trainer.report.compare import leaves
from trainer.rundir import RunDir, runs_root
from trainer.runtime.launch import LaunchResult, launch_env, run_agents, torchrun_command
from trainer.runtime.replica_groups import replica_groups

# Spec fields that do not change what is trained (evaluation, logging, operations), so a continued
# run may differ in them freely. A prefix covers a whole section.
TRAINING_NEUTRAL = (
    "name",
    "eval",
    "faults",
    "train.log_every",
    "train.step_line_every",
    "data.num_proc",
    "data.dask_address",
    "cluster.work_pool",
    "cluster.image",
    "cluster.namespace",
    "cluster.credentials_secret",
    "cluster.queue",
    "cluster.service_account",
    "allow_oversubscribe",
    "resume_from",
    "allow_changes",
)


FLOW_RUN_PREFIX = "train-"  # the pipeline names its flow runs train-<run id>
CONTINUED = "-continued-"  # ... and a continuation train-<run id>-continued-<8 hex digits>


class RunConflict(SpecError):
    """Continuing a run with a spec that trains differently, or a run that does not exist."""


def _tail(token: str | None) -> str:
    """The last 8 hex digits of the flow run's id when there is one (a retry keeps it), else random.
    The last, because Prefect 3's flow run ids are time-ordered (UUIDv7): their first digits are a
    timestamp that every run created in the same minute shares, their tail is random."""
    return (token or uuid.uuid4().hex).replace("-", "")[-8:]


def new_run_id(name: str, token: str | None = None) -> str:
    """``<name>-<8 hex digits>``: a new run's id (see :func:`_tail`)."""
    return f"{name}-{_tail(token)}"


def run_id_for(spec: TrainingSpec, token: str | None = None) -> str:
    """The id of the run a flow run of ``spec`` with id ``token`` opens: the one ``resume_from``
    continues, else a new one. The only place a run's id is derived."""
    return spec.resume_from or new_run_id(spec.name, token)


def flow_run_name(spec: TrainingSpec, token: str) -> str:
    """``train-<run id>``, so every flow run has a name of its own and ``tessera compare`` takes it; a
    continuation is ``train-<run id>-continued-<8 hex digits>``, as the same run has several flow runs."""
    name = FLOW_RUN_PREFIX + run_id_for(spec, token)
    return f"{name}{CONTINUED}{_tail(token)}" if spec.resume_from else name


def find_run(ref: str) -> RunDir:
    """A run by its id (a directory under the runs root), its flow run's name, or its directory's path."""
    run_id = ref.removeprefix(FLOW_RUN_PREFIX).split(CONTINUED)[0]
    for path in (Path(ref), runs_root() / ref, runs_root() / run_id):
        if (path / "run.json").is_file():
            return RunDir(path.resolve())
    raise UserError(
        f"no run {ref!r}: give a run id (a directory under {runs_root()}), its flow run's name "
        "(train-<run id>) or a run directory's path"
    )


def remote_run_url(spec: TrainingSpec, checkpoint_url: str, run_id: str) -> str | None:
    """Where a Kubernetes run's files live while it trains: ``<checkpoint.url>/runs/<run id>``; None for
    a run on this host, or one whose checkpoints are on a local path, which the renderer refuses.

    A pod's own run directory dies with the pod, so the trainer mirrors its metrics there and the
    train task follows them from there.
    """
    if spec.cluster.accelerator == "cpu" or "://" not in checkpoint_url:
        return None
    return storage.join(checkpoint_url, "runs", run_id)


def _covered(path: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(path == p or path.startswith(f"{p}.") for p in prefixes)


def training_changes(earlier: dict[str, Any], spec: TrainingSpec) -> list[str]:
    """``field: old → new`` for each field that differs and could change the loss curve."""
    old, new = leaves(earlier), leaves(spec.model_dump(mode="json"))
    # A run recorded before a model field existed trained with its default (which changes nothing).
    for name, default in LATER_MODEL_DEFAULTS.items():
        if not any(path == f"model.{name}" or path.startswith(f"model.{name}.") for path in old):
            old[f"model.{name}"] = default
    allowed = (*TRAINING_NEUTRAL, *spec.allow_changes)
    return [
        f"{path}: {old.get(path)!r} → {new.get(path)!r}"
        for path in sorted(old.keys() | new.keys())
        if old.get(path) != new.get(path) and not _covered(path, allowed)
    ]


@dataclass(frozen=True)
class TrainedRun:
    """What the pipeline returns: the run it trained, so ``tessera run`` is told rather than guesses, and
    its final checkpoint. Plain strings, so Prefect persists and shows it as any result."""

    run_id: str
    run_dir: str
    final_checkpoint_url: str


@dataclass(frozen=True)
class Run:
    """One training run of ``spec``: identity, directory, resolved job and plan; built by :meth:`open`."""

    spec: TrainingSpec
    dir: RunDir
    job: JobConfig
    plan: Plan

    @property
    def run_id(self) -> str:
        return self.dir.run_id

    @property
    def checkpoint_url(self) -> str:
        """Where the run's checkpoints are: decided when the run was opened, so never unset here."""
        assert self.job.checkpoint.url is not None, "a Run's job is resolved"
        return self.job.checkpoint.url

    @classmethod
    def open(
        cls,
        spec: TrainingSpec,
        run_dir: RunDir | None = None,
        data_url: str | None = None,
        token: str | None = None,
        on_this_host: bool = False,
    ) -> Run:
        """Start or continue a run, after the resume rules; writes ``run.json`` and ``job.json``.

        The directory is ``run_dir`` when given (``tessera train --run-dir``), else the run named by
        ``spec.resume_from``, else a new one named from ``token`` (the flow run id) under the runs root.
        ``on_this_host``: trained here whatever the accelerator (``tessera train``), so no run URL.
        """
        if run_dir is None:
            run_dir = RunDir(runs_root() / run_id_for(spec, token))
            if spec.resume_from and not run_dir.record.exists():
                raise RunConflict(
                    f"resume_from={spec.resume_from!r}: no such run under {run_dir.path.parent}; give the id "
                    "of an earlier run (a directory there), or leave resume_from empty for a new run"
                )
        run_dir = RunDir(run_dir.path.resolve())
        if run_dir.record.exists():
            earlier = json.loads(run_dir.record.read_text())["spec"]
            if changes := training_changes(earlier, spec):
                raise RunConflict(
                    f"run {run_dir.run_id} was started with a spec that trains differently: "
                    f"{'; '.join(changes)}. Start a new run (leave resume_from empty), or list the fields in "
                    "allow_changes if continuing with the change is intended"
                )
        job = spec.job_config(data_url, run_id=run_dir.run_id)
        plan = plan_for_job(
            job
        )  # the one plan of the run: the intervals, the plan task and the renderer read it
        job = resolve_job(job, run_dir, plan)
        assert job.checkpoint.url is not None, "resolve_job sets it"
        if not on_this_host:
            job = job.model_copy(update={"run_url": remote_run_url(spec, job.checkpoint.url, run_dir.run_id)})
        run = cls(spec, run_dir, job, plan)
        run.write()
        return run

    @classmethod
    def load(cls, run_dir: RunDir) -> Run:
        """The run recorded in ``run_dir`` as it was last opened (catch-up evaluation reads it); its plan
        is rebuilt from the recorded job, as no file holds it."""
        spec = TrainingSpec.model_validate(json.loads(run_dir.record.read_text())["spec"])
        job = JobConfig.model_validate_json(run_dir.job.read_text())
        return cls(spec, run_dir, job, plan_for_job(job))

    def write(self) -> None:
        self.dir.path.mkdir(parents=True, exist_ok=True)
        record = {"run_id": self.run_id, "spec": self.spec.model_dump(mode="json")}
        self.dir.record.write_text(json.dumps(record, indent=2))
        self.dir.job.write_text(self.job.model_dump_json(indent=2))

    def claim(self) -> Lease:
        """Own the run's checkpoint location for one launch (see :mod:`trainer.checkpoint.lease`).

        Also the pre-flight write check: a read-only location, or one that is a file, fails here in
        one line naming ``checkpoint.url``, before any step is trained and lost.
        """
        lease = Lease(self.checkpoint_url, self.run_id)
        try:
            lease.acquire()
        except storage.StoreError as error:
            raise UserError(
                f"checkpoint.url={self.checkpoint_url!r} cannot be written ({error}); point it at a "
                "writable directory or bucket"
            ) from None
        return lease

    def launch_local(
        self,
        commands: list[list[str]] | None = None,
        echo: Callable[[str], object] | None = None,
        poll: Callable[[], None] = lambda: None,
    ) -> LaunchResult:
        """Run this run's torchrun agents on this host (default: one, as ``tessera train`` does) with
        the backend's environment; an agent held stopped for ``faults.step_timeout_s`` is a hang. With
        ``faults.min_nodes`` a lost agent does not end the run (see :func:`trainer.runtime.launch.run_agents`); with
        ``faults.replica_fault_tolerance`` each replica group is an agent of its own, around the run's
        Lighthouse, and one that runs out of restarts stops no other."""
        faults = self.job.faults
        if commands is None and faults.replica_fault_tolerance:
            with replica_groups(self.job, self.dir.job, self.dir.path) as groups:
                return self._run_agents(groups, echo, poll, elastic=True)
        commands = commands or [self.torchrun_command()]
        return self._run_agents(commands, echo, poll, elastic=faults.min_nodes is not None)

    def _run_agents(
        self,
        commands: list[list[str]],
        echo: Callable[[str], object] | None,
        poll: Callable[[], None],
        elastic: bool,
    ) -> LaunchResult:
        return run_agents(
            commands,
            launch_env(self.job) | launcher_env(self.run_id),
            self.dir,
            echo=echo,
            poll=poll,
            stopped_after_s=self.job.faults.step_timeout_s,
            elastic=elastic,
        )

    def torchrun_command(
        self,
        node_rank: int = 0,
        rdzv_endpoint: str | None = None,
        job_path: Path | None = None,
        run_dir: Path | None = None,
        python: str = sys.executable,
        nodes: int | None = None,
    ) -> list[str]:
        """One torchrun agent of this run. Locally the defaults are right; a pod passes where its job
        file is mounted, its scratch run directory and the image's interpreter, and with replica fault
        tolerance the ``nodes`` of its replica group (default: the cluster's)."""
        hardware, faults = self.job.hardware, self.job.faults
        command = torchrun_command(
            job_path or self.dir.job,
            run_dir or self.dir.path,
            hardware.chips_per_node,
            nodes or hardware.nodes,
            node_rank,
            rdzv_endpoint,
            faults.max_restarts,
            run_id=self.run_id,
            min_nodes=faults.min_nodes,
            replacement_wait_s=faults.replacement_wait_s,
            warm_restart=faults.warm_restart,
        )
        return [python, *command[1:]]

    @staticmethod
    def of_spec(name: str) -> list[RunDir]:
        """The recorded runs of the spec ``name`` under the runs root, oldest first."""
        ids = re.compile(rf"{re.escape(name)}-[0-9a-f]{{8}}")
        runs = [RunDir(p) for p in runs_root().glob(f"{name}-*") if ids.fullmatch(p.name)]
        return sorted(
            (r for r in runs if r.record.exists() and r.job.exists()), key=lambda r: r.record.stat().st_mtime
        )
