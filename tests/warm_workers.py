"""One fork server for the whole test session (a pytest plugin, registered in ``tests/conftest.py``).

Every torchrun launch in the suite starts ranks that import torch and the trainer (~3 s of CPU each,
with compiled bytecode; a 4-rank launch ~12 CPU-s on a 2-core box). The product can fork its workers
from a warm server instead (:mod:`trainer.runtime.fork_server`, ``$TESSERA_FORK_SERVER``): this plugin
starts one, lazily, before the first test that launches processes, and exports its socket, so every
launch of the session (``Run.launch_local``, ``tessera train`` subprocesses, Prefect workers' flow runs,
:func:`tests.torchrun.run_torchrun`) forks its ranks from it.

Tests marked ``cold`` see no such server: those about cold starts, warm restarts' own per-run server,
process trees (they find ranks by command line or parentage), signals and kill -9. ``TESSERA_TEST_COLD=1``
runs the whole session cold, as before this plugin.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from trainer.runtime.fork_server import SHARED_ENV, ForkServer

LAUNCHING = ("dist", "e2e", "fault", "smoke", "slow", "browser")  # markers of tests that may start ranks
_server: ForkServer | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures (module-scoped ones too): the server's socket in the environment, or not."""
    global _server
    if item.get_closest_marker("cold") or os.environ.get("TESSERA_TEST_COLD") == "1":
        os.environ.pop(SHARED_ENV, None)
        return
    if _server is None and any(item.get_closest_marker(name) for name in LAUNCHING):
        os.environ.pop(SHARED_ENV, None)  # the server itself is started from a clean environment
        # One intra-op thread, as the CPU backend's launch environment and run_torchrun give every rank.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        _server = ForkServer(Path(tempfile.mkdtemp(prefix="tessera-fork-")), env)
    if _server is not None:
        os.environ[SHARED_ENV] = str(_server.path)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _server is not None:
        _server.stop()
        os.environ.pop(SHARED_ENV, None)
