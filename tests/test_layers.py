"""Imports point one way: ``trainer`` ← ``deployments`` ← ``tasks`` ← ``flows`` ← ``tessera``.

Read from the source (every import statement, the lazy ones inside functions included), so a layer
cannot reach up even where the import would only run later. ``trainer`` also never imports Prefect:
it is the plain torch library that runs under ``torchrun`` alone.
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
