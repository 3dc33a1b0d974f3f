"""The docs cannot drift from the code: every command in the ``bash`` blocks of README.md and
``docs/*.md`` is run or checked, or is listed below as needing a cluster, a server or an accelerator.

Cheap ``tessera`` commands (validate, schema, plan, render) run for real, outputs redirected to a
temporary directory; the rest (run, train, pools, deploy, ...) must exist with every option the docs
give them. ``make`` targets must dry-run (``make -n``), ``python -m`` modules must import and take the
docs' arguments, ``prefect`` commands must name real pools and deployments, and every repo path the
docs mention — in commands, prose, images or links — must exist.
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

DOCS = {
    path.relative_to(REPO_ROOT).as_posix(): path.read_text()
    for path in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
}
README = DOCS["README.md"]
RUN_FOR_REAL = {"validate", "schema", "plan", "render"}
OUTPUT_OPTIONS = {"--out", "--chart", "--run-dir"}  # paths the command creates, not ones it reads
TOP_LEVEL = ("trainer", "tasks", "flows", "deployments", "tests", "benchmarks", "docs", ".ci")
# Shown in the docs, but they need more than this machine: only their form is checked here (the
# Makefile target exists; the pool and the deployment are real). Keep this list short and reviewed.
NEEDS_CLUSTER_OR_ACCELERATOR = {
    "make k8s-smoke": "a Kubernetes cluster with JobSet (KUBECONFIG)",
    "make bench-gpu": "a CUDA host",
    "prefect worker start --pool tessera-gpu --type kubernetes": "a Kubernetes cluster",
    "prefect deployment run train-pipeline/gpu-llama3-8b-h100": "a Prefect server and a GPU worker",
}


def bash_commands(text: str) -> list[list[str]]:
    """Each command line of a page's bash blocks as argv, comments and env assignments removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                argv = argv[1:]
            if argv:
                commands.append(argv)
    return commands


COMMANDS = [argv for text in DOCS.values() for argv in bash_commands(text)]


def by_program(*programs: str) -> list[list[str]]:
    unique = {shlex.join(argv): argv for argv in COMMANDS if argv[0] in programs}
    return list(unique.values())


def test_every_documented_command_has_a_check() -> None:
    known = {"make", ".venv/bin/tessera", "tessera", ".venv/bin/python", "prefect"}
    assert COMMANDS and {argv[0] for argv in COMMANDS} <= known
    # prefect's commands reach a server: each one shown must be on the list of what needs more.
    for argv in by_program("prefect"):
        assert shlex.join(argv) in NEEDS_CLUSTER_OR_ACCELERATOR, f"docs: `{shlex.join(argv)}` is not checked"


def test_the_list_of_commands_needing_a_cluster_is_current() -> None:
    shown = {shlex.join(argv) for argv in COMMANDS}
    assert not set(NEEDS_CLUSTER_OR_ACCELERATOR) - shown, "listed commands the docs no longer show"


def test_the_two_commands_come_first() -> None:
    assert bash_commands(README)[:2] == [["make", "demo"], ["make", "test"]]


def test_make_targets_dry_run() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.MULTILINE))
    variables = set(re.findall(r"^([A-Z][A-Z_]*) \??:?=", makefile, flags=re.MULTILINE))
    for argv in by_program("make"):
        settings = {arg.split("=", 1)[0] for arg in argv[1:] if "=" in arg}
        assert settings <= variables, f"docs: `{shlex.join(argv)}`: no such Makefile variable"
        assert {a for a in argv[1:] if "=" not in a} <= targets, f"docs: `{shlex.join(argv)}`: no such target"
        if shlex.join(argv) in NEEDS_CLUSTER_OR_ACCELERATOR:
            continue
        dry = subprocess.run(["make", "-n", *argv[1:]], cwd=REPO_ROOT, capture_output=True, text=True)
        assert dry.returncode == 0, f"docs: `make -n {shlex.join(argv[1:])}` failed: {dry.stderr}"


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
        assert option in help_text.output, f"docs: tessera {command} has no option {option}"
    if command not in RUN_FOR_REAL:
        return
    real = [
        str(tmp_path / Path(a).name) if i and args[i - 1] in OUTPUT_OPTIONS else a for i, a in enumerate(args)
    ]
    result = runner.invoke(app, real)
    assert result.exit_code == 0, f"docs: `tessera {shlex.join(args)}` failed:\n{result.output}"
    for i, option in enumerate(args):
        if option in OUTPUT_OPTIONS:
            assert (tmp_path / Path(args[i + 1]).name).exists(), f"{option} wrote nothing"


def test_python_modules_take_the_docs_arguments() -> None:
    markers = {
        m.split(":")[0]
        for m in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
            "markers"
        ]
    }
    for argv in by_program(".venv/bin/python"):
        assert argv[1] == "-m", argv
        module, args = argv[2], argv[3:]
        assert importlib.util.find_spec(module), f"docs: no module {module}"
        if module == "benchmarks" and "--only" in args:
            parse_only(args[args.index("--only") + 1])  # exits naming an unknown benchmark
        if module == "pytest" and "-m" in args:
            used = set(re.findall(r"\w+", args[args.index("-m") + 1])) - {"and", "or", "not"}
            assert used <= markers, f"docs: unknown pytest markers {used - markers}"


def test_prefect_commands_name_real_pools_and_deployments() -> None:
    deployments = {
        f"{'train-pipeline' if d['entrypoint'].endswith('train_pipeline') else 'evaluate-checkpoints'}/{d['name']}"
        for d in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]
    }
    pools = {pool.name: pool.type for pool in POOLS.values()}
    for argv in by_program("prefect"):
        if argv[1:3] == ["worker", "start"]:
            pool, kind = argv[argv.index("--pool") + 1], argv[argv.index("--type") + 1]
            assert pools.get(pool) == kind, f"docs: no {kind} pool {pool}"
        else:
            assert argv[1:3] == ["deployment", "run"] and argv[3] in deployments, argv


def mentioned_paths() -> set[str]:
    """Repo paths in commands, inline code, images and links (placeholders like <name> excluded);
    a link is relative to its page, inline code and commands to the repository."""
    inline = [t for text in DOCS.values() for t in re.findall(r"`([^`\s]+)`", text)]
    links = [
        (Path(page).parent / target).as_posix().removeprefix("./")
        for page, text in DOCS.items()
        for target in re.findall(r"\]\(([^)#]+)\)", text)
        if "://" not in target
    ]
    tokens = [t for argv in COMMANDS for i, t in enumerate(argv) if not (i and argv[i - 1] in OUTPUT_OPTIONS)]
    paths = set()
    for token in inline + links + tokens:
        path = token.split(":")[0].rstrip("/")
        if path.split("/")[0] in TOP_LEVEL and "<" not in path and "*" not in path:
            paths.add(path)
    return paths


def test_every_mentioned_path_exists() -> None:
    paths = mentioned_paths()
    assert {"deployments/specs/local-cpu.yaml", "docs/ui-run-form.png", "docs/specs.md"} <= paths
    missing = sorted(p for p in paths if not (REPO_ROOT / p).exists() and not generated(p))
    assert not missing, f"the docs mention missing paths: {missing}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", README))
    assert linked == {page for page in DOCS if page.startswith("docs/")}


def generated(path: str) -> bool:
    """Outputs the documented commands write (benchmark results, run dirs) are ignored by git, not shipped."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO_ROOT).returncode == 0


def test_spec_example_is_the_shipped_spec() -> None:
    example = re.search(r"```yaml\n(.*?)```", DOCS["docs/specs.md"], flags=re.DOTALL)
    assert example is not None
    assert yaml.safe_load(example.group(1)) == yaml.safe_load(
        (REPO_ROOT / "deployments/specs/local-cpu.yaml").read_text()
    )
