"""Progress bars show in a terminal and nowhere else: a real pseudo-terminal vs CI and pipes."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.register import REPO_ROOT

# Follows a metrics file the way `tessera run` and `tessera train` do, for a little over two polls.
FOLLOW = """
import sys, time
from pathlib import Path
from tessera.progress import StepProgress
with StepProgress(lambda: Path(sys.argv[1]), total_steps=4):
    time.sleep(1.2)
"""


def follow(metrics: Path, env: dict[str, str], tty: bool) -> str:
    """Run FOLLOW with stderr on a pseudo-terminal (or a pipe); return what it wrote there."""
    if not tty:
        done = subprocess.run(
            [sys.executable, "-c", FOLLOW, str(metrics)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", FOLLOW, str(metrics)],
        cwd=REPO_ROOT,
        env=env,
        stderr=follower,
        stdout=subprocess.DEVNULL,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode(errors="replace")


@pytest.fixture
def metrics(tmp_path: Path) -> Path:
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "loss": 5.0 - s, "tokens_per_s": 1000.0} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_bar_in_a_terminal_shows_step_loss_and_throughput(metrics: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    shown = follow(metrics, {**env, "COLUMNS": "120"}, tty=True)
    assert "3/4" in shown and "loss 2.0000" in shown and "1,000 tok/s" in shown


def test_quiet_under_ci_and_when_not_a_terminal(metrics: Path) -> None:
    assert follow(metrics, {**os.environ, "CI": "true"}, tty=True) == ""
    assert follow(metrics, {k: v for k, v in os.environ.items() if k != "CI"}, tty=False) == ""
