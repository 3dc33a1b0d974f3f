"""Imports point one way: ``trainer`` ← ``deployments`` ← ``tasks`` ← ``flows`` ← ``tessera``.

Read from the source (every import statement, the lazy ones inside functions included), so a layer
cannot reach up even where the import would only run later. A string that names a module of this
repository is an import of it too: an entry point (``"flows/pipeline.py:train_pipeline"``), a
``python -m pkg.mod`` command, or a dotted module name handed to a launcher. ``trainer`` also never
imports Prefect: it is the plain torch library that runs under ``torchrun`` alone; ``flows`` imports
only tasks, deployments, Prefect and the standard library, as it only wires tasks.

Inside ``trainer`` the same holds by where code runs: what a rank imports (everything reachable from
``trainer.train``, ``trainer.evaluate`` and ``trainer.rank``) never reaches the host side
(``trainer.runtime``) or reporting (``trainer.report``), and the planner reaches neither.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["trainer", "deployments", "tasks", "flows", "tessera"]  # each may import only those before it
ENTRY_POINT = re.compile(r"([A-Za-z_][\w/]*)\.py:\w+")  # flows/pipeline.py:train_pipeline
DASH_M = re.compile(r"(?:^|\s)-m\s+([A-Za-z_][\w.]*)")  # python -m pkg.mod
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")  # pkg.mod, as a launcher's argument


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes in ``tree``: prose about a module is not a use of it."""
    bodies = [n.body for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)]
    return {
        id(body[0].value)
        for body in bodies
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    }


def named_modules(text: str) -> set[str]:
    """This repository's modules a string names as an entry point, a ``-m`` command or a dotted name."""
    names = {m.replace("/", ".") for m in ENTRY_POINT.findall(text)} | set(DASH_M.findall(text))
    if DOTTED.fullmatch(text):
        names.add(text)
    return {name for name in names if module_file(name) is not None}


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, lazily or not, and this repository's modules its strings name
    (``from a import b`` counts ``a`` and ``a.b``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    prose = docstrings(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            found |= named_modules(node.value)
    return found


def imported_packages(path: Path) -> set[str]:
    """The top-level packages ``path`` imports or names."""
    return {name.split(".")[0] for name in imports(path)}


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    above = set(LAYERS[LAYERS.index(layer) + 1 :])
    offenders = {
        str(path.relative_to(REPO)): sorted(imported_packages(path) & above)
        for path in sorted((REPO / layer).rglob("*.py"))
        if imported_packages(path) & above
    }
    assert not offenders, f"{layer}/ imports layers above it: {offenders}"


def test_the_trainer_imports_no_prefect() -> None:
    offenders = [
        str(path.relative_to(REPO))
        for path in (REPO / "trainer").rglob("*.py")
        if "prefect" in imported_packages(path)
    ]
    assert not offenders, offenders


def test_flows_import_only_tasks_deployments_prefect_and_the_standard_library() -> None:
    allowed = {"tasks", "deployments", "prefect", *sys.stdlib_module_names}
    offenders = {
        str(path.relative_to(REPO)): sorted(imported_packages(path) - allowed)
        for path in sorted((REPO / "flows").rglob("*.py"))
        if imported_packages(path) - allowed
    }
    assert not offenders, f"flows/ imports more than tasks, deployments and prefect: {offenders}"


def test_modules_named_in_strings_count_as_imports(tmp_path: Path) -> None:
    """Registration in deployments/ naming a flow's entry point would be deployments reaching up to flows."""
    source = tmp_path / "register.py"
    source.write_text(
        '"""Run with python -m tasks.plan; a docstring is prose."""\n'
        'PIPELINE = "flows/pipeline.py:train_pipeline"\n'
        'COMMAND = ["python", "-m", "tessera.cli"]\n'
        'SHELL = "python -m trainer.train --job job.json"\n'
        'LABEL = "app.kubernetes.io/name"\n'
    )
    assert imported_modules(source) == {"flows.pipeline", "tessera.cli", "trainer.train"}


def test_prefect_yaml_entry_points_are_flows() -> None:
    """``prefect.yaml`` (generated by tessera/register.py) deploys only flows in ``flows/``, by entry points
    that exist."""
    entry_points = {
        d["entrypoint"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    }
    for entry_point in entry_points:
        path, function = entry_point.split(":")
        assert path.startswith("flows/") and f"def {function}(" in (REPO / path).read_text(), entry_point


def module_file(module: str) -> Path | None:
    """The source of a dotted module of this repository, or None for anything else."""
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """This repository's modules ``path`` imports or names."""
    return {name for name in imports(path) if module_file(name) is not None}


def reachable(roots: list[str]) -> dict[str, set[str]]:
    """Every module the ``roots`` import, directly or not (a package's ``__init__`` included), with its imports."""
    graph: dict[str, set[str]] = {}
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in graph:
            continue
        graph[module] = imported_modules(module_file(module))  # type: ignore[arg-type]
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + sorted(graph[module])
    return graph


def modules_under(package: str) -> list[str]:
    root = REPO.joinpath(*package.split("."))
    return [
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for path in sorted(root.rglob("*.py"))
    ]


def reaching(roots: list[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in reachable(roots).items()
        for target in targets
        if target.startswith(forbidden)
    )


HOST_OR_REPORT = ("trainer.runtime", "trainer.report", "deployments", "tasks", "flows", "tessera")


def test_rank_code_never_reaches_the_host_side_or_reporting() -> None:
    roots = ["trainer.train", "trainer.evaluate", *modules_under("trainer.rank")]
    assert not reaching(roots, HOST_OR_REPORT)


def test_the_planner_never_reaches_the_host_side_or_reporting() -> None:
    assert not reaching(modules_under("trainer.plan"), HOST_OR_REPORT)


def test_the_host_side_never_imports_reporting() -> None:
    assert not reaching(modules_under("trainer.runtime"), ("trainer.report",))


def test_the_import_graph_is_read_from_this_checkout() -> None:
    """The rules above see real edges: trainer.train reaches the model, and nothing outside the repo."""
    graph = reachable(["trainer.train"])
    assert "trainer.models.llama.model" in graph and "trainer.rank.optim" in graph
    assert {module.split(".")[0] for module in graph} == {"trainer"}


def test_a_reach_through_an_intermediate_module_is_caught() -> None:
    """trainer.train imports no local_tensor itself; it reaches it through the model and the parallelisms."""
    assert "trainer.rank.local_tensor" not in imported_modules(REPO / "trainer/train.py")
    assert any(
        edge.endswith("imports trainer.rank.local_tensor")
        for edge in reaching(["trainer.train"], ("trainer.rank.local_tensor",))
    )
