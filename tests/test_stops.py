"""Every way of stopping ``tessera train`` stops everything it started, and one run directory has one
owner: real ``tessera train`` processes, real signals (SIGTERM, SIGKILL, SIGSTOP), real torchrun.

One scenario, three launches into one run directory:
1. A trains (slowed, so there is time to act);
2. B, started on the same run directory while A runs, is refused in one line naming A;
3. A's launcher is SIGKILLed: its agent and ranks follow it within seconds (parent-death signal);
4. C takes over at once (A's process is gone), resumes, and is stopped with SIGTERM: its ranks
   checkpoint the step they were on (preemption), it exits 143, nothing is left running and its
   lease is released.
And separately: an agent held by SIGSTOP is killed after ``faults.step_timeout_s`` instead of hanging
``tessera train`` forever; an unwritable checkpoint location is refused before training starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fault_report import FaultRow, record
from tests.pipeline_specs import MICRO_MODEL, run_of, tiny_spec_dict
from trainer.checkpoint import list_checkpoints
from trainer.metrics import read_metrics
from trainer.runtime.agents import is_stopped

pytestmark = pytest.mark.cold  # stops are about the launcher's own process tree and signals

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 120.0
SPEC: dict[str, Any] = {
    "name": "stops",
    "model": MICRO_MODEL,
    "data": {"loader_workers": 0},
    "train": {"steps": 200, "seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2},
    "parallel": {"dp_shard": 2},
    "cluster": {"chips_per_node": 2},
    "checkpoint": {"interval": 2, "mode": "sync"},
    "faults": {"max_restarts": 0, "step_timeout_s": 60},
}
SLOW = {"TESSERA_FAULT_SLOW_RANK": "0", "TESSERA_FAULT_SLOW_S": "0.2"}


def tessera_train(spec_file: Path, run_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "train", str(spec_file), "--run-dir", str(run_dir)],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def processes_of(run_dir: Path) -> list[int]:
    """Every live torchrun agent or rank whose command line names ``run_dir``."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if (
            state != "Z"
            and str(run_dir).encode() in argv
            and (b"torch.distributed.run" in argv or b"trainer.train" in argv)
        ):
            pids.append(int(proc.name))
    return pids


def wait_until(condition: Any, what: str, timeout_s: float = WAIT_S) -> float:
    """Poll ``condition`` until true; the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def steps_logged(run_dir: Path) -> int:
    records = read_metrics(run_dir / "metrics.jsonl")
    return records[-1]["step"] if records else 0


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    return path


@pytest.mark.dist
@pytest.mark.fault
def test_one_owner_a_killed_launcher_leaves_nothing_and_sigterm_stops_cleanly(
    spec_file: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    first = tessera_train(spec_file, run_dir, SLOW)
    try:
        wait_until(lambda: steps_logged(run_dir) >= 1, "A's first step")
        second = tessera_train(spec_file, run_dir)
        _, err = second.communicate(timeout=WAIT_S)
        assert second.returncode == 1, err
        assert f"in use by run 'run' (pid {first.pid} on " in err and "Traceback" not in err
        assert err.count("\n") == 1, err

        first.kill()  # SIGKILL: no handler runs; the kernel's parent-death signal reaches the agent
        first.communicate()
        orphans_gone_s = wait_until(lambda: not processes_of(run_dir), "A's agent and ranks to stop", 60)
    finally:
        first.kill()

    resumed_from = max(m.step for m in list_checkpoints(str(run_dir / "checkpoints")) if m.good)
    third = tessera_train(spec_file, run_dir, SLOW)
    try:
        wait_until(lambda: (run_dir / "checkpoints" / "owner.json").exists(), "C's lease")
        before = steps_logged(run_dir)
        wait_until(lambda: steps_logged(run_dir) > before, "C to train a step")
        third.send_signal(signal.SIGTERM)
        out, err = third.communicate(timeout=60)
    finally:
        third.kill()
    assert third.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    assert f"resumed from step {resumed_from}" in out  # A's last commit: nothing of A's work was lost twice
    assert not processes_of(run_dir), "SIGTERM left a torchrun agent or rank running"
    assert not (run_dir / "checkpoints" / "owner.json").exists(), "the lease was not released"
    assert not (run_dir / "user_error.json").exists(), "a stop is not a user error"
    # Preemption: the ranks finished the step they were on, checkpointed it, and exited; none is lost.
    preempted = int(out.split("preempted (SIGTERM) after step ", 1)[1].split(",", 1)[0])
    newest = max(m.step for m in list_checkpoints(str(run_dir / "checkpoints")) if m.good)
    assert newest == preempted == steps_logged(run_dir)
    record(
        FaultRow(
            "two tessera train on one run dir", "failed clearly", "second refused", None, None, None, None
        )
    )
    record(
        FaultRow(
            "kill -9 of the tessera train launcher",
            "recovered",
            "agents stopped",
            round(orphans_gone_s, 1),
            None,
            None,
            None,
        )
    )
    record(FaultRow("SIGTERM of tessera train (preemption)", "recovered", "preempted", None, 0, None, None))


@pytest.mark.dist
@pytest.mark.fault
def test_a_stopped_agent_is_killed_after_the_step_timeout_not_waited_for(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({**SPEC, "faults": {"max_restarts": 0, "step_timeout_s": 3}}))
    run_dir = tmp_path / "run"
    launch = tessera_train(spec_file, run_dir, SLOW)
    try:
        wait_until(lambda: steps_logged(run_dir) >= 1, "the first step")
        (agent,) = [
            pid
            for pid in processes_of(run_dir)
            if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        os.kill(agent, signal.SIGSTOP)
        assert is_stopped(agent) or wait_until(lambda: is_stopped(agent), "SIGSTOP to take", 5) >= 0
        stopped_at = time.monotonic()
        out, err = launch.communicate(timeout=WAIT_S)
        detected_s = time.monotonic() - stopped_at
    finally:
        launch.kill()
    assert launch.returncode != 0 and "training failed: node failure" in err, err[-3000:]
    assert f"tessera: agent {agent} was stopped for 3 s; killed it" in out
    assert not processes_of(run_dir)
    record(
        FaultRow(
            "SIGSTOP of the torchrun agent",
            "failed clearly",
            "node_failure",
            round(detected_s, 1),
            None,
            None,
            None,
        )
    )


def tessera_train_group(spec_file: Path, run_dir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """``tessera train`` as a shell job: the leader of a process group of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "train", str(spec_file), "--run-dir", str(run_dir)],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        process_group=0,
    )


def commit_times(run_dir: Path) -> dict[int, float]:
    """When each good checkpoint was committed (its commit record's mtime), by step."""
    return {
        m.step: (run_dir / "checkpoints" / f"step-{m.step:06d}" / "tessera.json").stat().st_mtime
        for m in list_checkpoints(str(run_dir / "checkpoints"))
        if m.good
    }


@pytest.mark.dist
@pytest.mark.fault
def test_ranks_of_a_launch_killed_with_its_process_group_commit_nothing_beside_an_immediate_relaunch(
    spec_file: Path, tmp_path: Path
) -> None:
    """kill -9 of the whole ``tessera train`` process group: its ranks (in sessions of their own) get
    SIGTERM from their dying agent and would save the step they were on, while a relaunch started at
    once already holds the location. They must commit nothing once their launcher is gone."""
    run_dir = tmp_path / "run"
    first = tessera_train_group(spec_file, run_dir, SLOW)
    try:
        wait_until(lambda: steps_logged(run_dir) >= 3 and commit_times(run_dir), "A's first checkpoint")
        orphans = processes_of(run_dir)
        os.killpg(first.pid, signal.SIGKILL)
        killed_at = time.time()
        second = tessera_train_group(spec_file, run_dir, SLOW)  # at once: A's launcher is gone
        first.wait()
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in orphans), "A's ranks to end", 60)
        orphans_gone_at = time.time()
        late = {step: at for step, at in commit_times(run_dir).items() if killed_at < at <= orphans_gone_at}
        wait_until(lambda: (run_dir / "checkpoints" / "owner.json").exists(), "B's lease")
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=WAIT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.killpg(second.pid, signal.SIGKILL)
    # B needs its ~10 s of start-up before it can commit anything; A's ranks end within seconds.
    assert not late, f"A's ranks committed {sorted(late)} after their launcher was killed"
    assert not processes_of(run_dir)


def test_train_help_gives_the_exit_code_of_a_refused_launch() -> None:
    """A launch refused before training (invalid spec, location in use or unwritable) exits 1, as
    every CLI refusal does; 3 is the trainer's own user error (e.g. a NaN loss)."""
    done = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "train", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert "1 when it refuses to start" in done.stdout and "location is in use" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["a file", "a read-only filesystem"])
def test_an_unwritable_checkpoint_location_is_refused_before_training(tmp_path: Path, problem: str) -> None:
    if problem == "a file":
        location = str(tmp_path / "ckpt")
        Path(location).write_text("not a directory")
    else:
        location = "/proc/self/tessera-checkpoints"  # unwritable for root too, unlike a chmod
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({**SPEC, "checkpoint": {"url": location, "interval": 2}}))
    done = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "train", str(spec_file), "--run-dir", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 1, done.stderr
    assert f"checkpoint.url={location!r} cannot be written" in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 1 MiB tmpfs: less than one checkpoint of the micro model (mounting needs root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.dist
@pytest.mark.fault
def test_a_full_disk_is_named_on_every_attempt_and_leaves_no_debris(small_disk: Path, tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.yaml"
    spec = {
        **SPEC,
        "train": {**SPEC["train"], "steps": 4},
        "checkpoint": {"url": str(small_disk / "ckpt"), "interval": 2},
    }
    spec_file.write_text(yaml.safe_dump(spec))
    for attempt in (1, 2):  # the second finds the first's partial and the same full disk
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tessera.cli",
                "train",
                str(spec_file),
                "--run-dir",
                str(tmp_path / "run"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        output = done.stdout + done.stderr  # the ranks' lines come through the agent's output
        assert done.returncode == 3, (attempt, output[-3000:])
        # Either rank may fill the disk first (the other may be stopped before it does, or see its peer go).
        errors = [line for line in output.splitlines() if line.startswith("error: [rank ")]
        full = [line for line in errors if "out of space" in line]
        assert full and all("checkpoint.keep_last + 1 checkpoints" in line for line in full), (
            attempt,
            errors or output[-3000:],
        )
        assert not any("unexpected pos" in line for line in errors), errors
    leftovers = [p.name for p in small_disk.rglob("*") if ".tmp-" in p.name]
    assert not leftovers, leftovers
    assert not processes_of(tmp_path / "run")
    record(
        FaultRow(
            "disk full while checkpointing (twice)", "failed clearly", "user_error", None, None, None, None
        )
    )


def process_tree(root: int) -> dict[int, str]:
    """``root`` and its live descendants: pid -> start time (so a reused pid is not mistaken for one)."""
    stats = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            stats[int(proc.name)] = (int(fields[1]), fields[19])  # (ppid, start time)
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in stats:
            tree[pid] = stats[pid][1]
            frontier += [child for child, (ppid, _) in stats.items() if ppid == pid]
    return tree


def still_alive(tree: dict[int, str]) -> list[int]:
    alive = process_tree(1)  # every live process
    return [pid for pid, start in tree.items() if alive.get(pid) == start]


def listening_ports(pids: Iterable[int] | None = None) -> set[int]:
    """TCP ports in LISTEN state (IPv4 and IPv6): all of them, or those whose socket ``pids`` hold."""
    inodes = None
    if pids is not None:
        inodes = set()
        for pid in pids:
            with contextlib.suppress(OSError):
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        target = os.readlink(fd)
                        if target.startswith("socket:["):
                            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and (inodes is None or fields[9] in inodes):
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.dist
@pytest.mark.fault
def test_sigterm_of_tessera_run_stops_its_server_and_trainers_and_is_not_a_user_error(tmp_path: Path) -> None:
    """The whole local pipeline (temporary Prefect server, flow, agents, ranks) stopped by one SIGTERM."""
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(tiny_spec_dict(tmp_path, "stop-run", steps=200, interval=2)))
    runs = tmp_path / "runs"
    output = (tmp_path / "run.log").open("w+")  # a file, not a pipe: Prefect's logs must never block it
    launch = subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "run", str(spec_file)],
        cwd=REPO,
        env={**os.environ, **SLOW, "TESSERA_RUNS_DIR": str(runs), "PREFECT_HOME": str(tmp_path / "prefect")},
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def trained_a_step() -> bool:
            assert launch.poll() is None, (
                f"tessera run ended early:\n{(tmp_path / 'run.log').read_text()[-3000:]}"
            )
            run = run_of(runs, "stop-run")
            return run is not None and steps_logged(run.path) >= 1

        # the temporary server, data preparation and the launch come first
        wait_until(trained_a_step, "a step", timeout_s=300)
        tree = process_tree(launch.pid)
        ports_during = listening_ports(tree)
        launch.send_signal(signal.SIGTERM)
        launch.wait(timeout=60)
        stopped_s = wait_until(lambda: not still_alive(tree), "every process tessera run started to exit", 30)
    finally:  # on a failure, leave nothing behind: the temporary server would outlive a SIGKILLed parent
        for pid in process_tree(launch.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    output.seek(0)
    err = output.read()
    assert launch.returncode == 128 + signal.SIGTERM, err[-3000:]
    # Its own lines: the agents' output, relayed into the train task's log, includes torchrun's
    # account of the signal, as under tessera train (where it goes to stdout).
    own = "\n".join(line for line in err.splitlines() if "| Task run '" not in line)
    assert "stopped by SIGTERM" in own and "Traceback" not in own, err[-3000:]
    assert ports_during, "the temporary Prefect server was expected to listen while the run trained"
    assert not (listening_ports() & ports_during), "a port tessera run listened on is still listening"
    run = run_of(runs, "stop-run")
    assert run is not None and not (run.path / "user_error.json").exists(), "a stop is not a user error"
    record(FaultRow("SIGTERM of tessera run", "recovered", "stopped", round(stopped_s, 1), None, None, None))
