"""What a new user meets first: `tessera deploy` deploys the checkout they are in, Prefect commands
run there are quiet, and a benchmarks summary with no results says what to run instead of an empty table."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

import benchmarks.__main__ as bench
from tessera.register import REPO_ROOT, checkout
from trainer.failures import UserError


def test_deploy_uses_the_checkout_around_the_working_directory(tmp_path: Path) -> None:
    assert checkout(REPO_ROOT / "deployments" / "specs") == REPO_ROOT
    clone = tmp_path / "clone"
    (clone / "deployments" / "specs").mkdir(parents=True)
    (clone / "prefect.yaml").write_text("deployments: []\n")
    assert checkout(clone / "deployments") == clone.resolve()
    with pytest.raises(UserError, match="no tessera checkout at or above"):
        checkout(tmp_path)


def test_prefect_analytics_are_off_in_the_checkout() -> None:
    """Against a temporary SQLite server they only print "database is locked" tracebacks."""
    settings = tomllib.loads((REPO_ROOT / "prefect.toml").read_text())
    assert settings["server"]["analytics_enabled"] is False


def test_summary_only_without_results_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "results_path", lambda area: tmp_path / f"{area}.json")
    monkeypatch.setattr(sys, "argv", ["benchmarks", "--summary-only"])
    with pytest.raises(SystemExit, match=r"no benchmark results in .* yet; run `python -m benchmarks`"):
        bench.main()
