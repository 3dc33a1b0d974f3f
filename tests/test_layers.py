"""Imports point one way: ``trainer`` ← ``deployments`` ← ``tasks`` ← ``flows`` ← ``tessera``.

Read from the source (every import statement, the lazy ones inside functions included), so a layer
cannot reach up even where the import would only run later. ``trainer`` also never imports Prefect:
it is the plain torch library that runs under ``torchrun`` alone.

Inside ``trainer`` the same holds by where code runs: what a rank imports (everything reachable from
``trainer.train``, ``trainer.evaluate`` and ``trainer.rank``) never reaches the host side
(``trainer.runtime``) or reporting (``trainer.report``), and the planner reaches neither.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["trainer", "deployments", "tasks", "flows", "tessera"]  # each may import only those before it


def imported_packages(path: Path) -> set[str]:
    """The top-level packages ``path`` imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


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


def module_file(module: str) -> Path | None:
    """The source of a dotted module of this repository, or None for anything else."""
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """This repository's modules ``path`` imports (``from a import b`` counts ``a.b`` when it is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if module_file(name) is not None}


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
