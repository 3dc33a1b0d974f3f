"""The README cannot drift from the code: every command in its ``bash`` blocks is run or checked.

Cheap ``tessera`` commands (validate, schema, plan, render) run for real, outputs redirected to a
temporary directory; the rest (run, train, pools, deploy) must exist with every option the README
gives them. ``make`` targets must exist in the Makefile, ``python -m`` modules must import and take
the README's arguments, ``prefect`` commands must name real pools and deployments, and every repo
path the README mentions — in commands, prose or images — must exist.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from benchmarks.__main__ import parse_only
from deployments.pools import POOLS
from tessera.cli import app
from tessera.register import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
RUN_FOR_REAL = {"validate", "schema", "plan", "render"}
OUTPUT_OPTIONS = {"--out", "--chart", "--run-dir"}  # paths the command creates, not ones it reads
TOP_LEVEL = ("trainer", "tasks", "flows", "deployments", "tests", "benchmarks", "docs", ".ci")


def bash_commands() -> list[list[str]]:
    """Each command line of the README's bash blocks as argv, comments and env assignments removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                argv = argv[1:]
            if argv:
                commands.append(argv)
    return commands


COMMANDS = bash_commands()


def by_program(*programs: str) -> list[list[str]]:
    return [argv for argv in COMMANDS if argv[0] in programs]


def test_every_readme_command_has_a_check() -> None:
    known = {"make", ".venv/bin/tessera", "tessera", ".venv/bin/python", "prefect"}
    assert COMMANDS and {argv[0] for argv in COMMANDS} <= known


def test_the_two_commands_come_first() -> None:
    assert COMMANDS[:2] == [["make", "demo"], ["make", "test"]]


def test_make_targets_exist() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO_ROOT / "Makefile").read_text(), flags=re.MULTILINE))
    for argv in by_program("make"):
        assert set(argv[1:]) <= targets, f"README: `{shlex.join(argv)}`: no such Makefile target"


def tessera_commands() -> list[list[str]]:
    return [argv[1:] for argv in by_program(".venv/bin/tessera", "tessera")]


@pytest.mark.parametrize("args", tessera_commands(), ids=shlex.join)
def test_tessera_command(args: list[str], tmp_path: Path) -> None:
    runner = CliRunner()
    if args == ["--help"]:
        result = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 0
        for command in ("validate", "schema", "plan", "run", "train", "render", "pools", "deploy"):
            assert re.search(rf"│ {command} ", result.output), f"tessera --help does not list {command}"
        assert "Examples" in result.output
        return
    command = args[0]
    help_text = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert help_text.exit_code == 0, f"tessera {command} --help: {help_text.output}"
    assert "Example:" in help_text.output and f"tessera {command}" in help_text.output
    for option in (a for a in args if a.startswith("--")):
        assert option in help_text.output, f"README: tessera {command} has no option {option}"
    if command not in RUN_FOR_REAL:
        return
    real = [
        str(tmp_path / Path(a).name) if i and args[i - 1] in OUTPUT_OPTIONS else a for i, a in enumerate(args)
    ]
    result = runner.invoke(app, real)
    assert result.exit_code == 0, f"README: `tessera {shlex.join(args)}` failed:\n{result.output}"
    for i, option in enumerate(args):
        if option in OUTPUT_OPTIONS:
            assert (tmp_path / Path(args[i + 1]).name).exists(), f"{option} wrote nothing"


def test_python_modules_take_the_readmes_arguments() -> None:
    markers = {
        m.split(":")[0]
        for m in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
            "markers"
        ]
    }
    for argv in by_program(".venv/bin/python"):
        assert argv[1] == "-m", argv
        module, args = argv[2], argv[3:]
        assert importlib.util.find_spec(module), f"README: no module {module}"
        if module == "benchmarks" and "--only" in args:
            parse_only(args[args.index("--only") + 1])  # exits naming an unknown benchmark
        if module == "pytest" and "-m" in args:
            used = set(re.findall(r"\w+", args[args.index("-m") + 1])) - {"and", "or", "not"}
            assert used <= markers, f"README: unknown pytest markers {used - markers}"


def test_prefect_commands_name_real_pools_and_deployments() -> None:
    deployments = {
        f"{'train-pipeline' if d['entrypoint'].endswith('train_pipeline') else 'evaluate-checkpoints'}/{d['name']}"
        for d in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]
    }
    pools = {pool.name: pool.type for pool in POOLS.values()}
    for argv in by_program("prefect"):
        if argv[1:3] == ["worker", "start"]:
            pool, kind = argv[argv.index("--pool") + 1], argv[argv.index("--type") + 1]
            assert pools.get(pool) == kind, f"README: no {kind} pool {pool}"
        else:
            assert argv[1:3] == ["deployment", "run"] and argv[3] in deployments, argv


def mentioned_paths() -> set[str]:
    """Repo paths in commands, inline code and image links (placeholders like <name> excluded)."""
    inline = re.findall(r"`([^`\s]+)`", README) + re.findall(r"\]\(([^)]+)\)", README)
    tokens = [t for argv in COMMANDS for i, t in enumerate(argv) if not (i and argv[i - 1] in OUTPUT_OPTIONS)]
    paths = set()
    for token in inline + tokens:
        path = token.split(":")[0].rstrip("/")
        if path.split("/")[0] in TOP_LEVEL and "<" not in path and "*" not in path:
            paths.add(path)
    return paths


def test_every_mentioned_path_exists() -> None:
    paths = mentioned_paths()
    assert "deployments/specs/local-cpu.yaml" in paths and "docs/ui-run-form.png" in paths
    missing = sorted(p for p in paths if not (REPO_ROOT / p).exists() and not generated(p))
    assert not missing, f"README mentions missing paths: {missing}"


def generated(path: str) -> bool:
    """Outputs the documented commands write (benchmark results, run dirs) are ignored by git, not shipped."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO_ROOT).returncode == 0


def test_spec_example_is_the_shipped_spec() -> None:
    example = re.search(r"```yaml\n(.*?)```", README, flags=re.DOTALL)
    assert example is not None
    assert yaml.safe_load(example.group(1)) == yaml.safe_load(
        (REPO_ROOT / "deployments/specs/local-cpu.yaml").read_text()
    )
