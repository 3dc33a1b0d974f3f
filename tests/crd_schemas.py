"""Validate custom resources against the real JobSet and Kueue CRD schemas vendored in tests/schemas.

Each CRD's ``openAPIV3Schema`` is checked with ``jsonschema``, made strict the way the API server's
``fieldValidation=Strict`` is: an object whose schema lists its properties rejects any other key
(unless the schema says ``x-kubernetes-preserve-unknown-fields``). CEL rules and admission webhooks
are not evaluated here (see tests/schemas/README.md).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA_DIR = Path(__file__).parent / "schemas"


def _strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {k: _strict(v) for k, v in schema.items()}
    lists_its_keys = "properties" in schema and "additionalProperties" not in schema
    if lists_its_keys and not schema.get("x-kubernetes-preserve-unknown-fields"):
        strict["additionalProperties"] = False
    return strict


@cache
def _validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    """(apiVersion, kind) → validator, for every served version of every vendored CRD."""
    validators = {}
    for path in sorted(SCHEMA_DIR.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version["served"]:
                schema = _strict(version["schema"]["openAPIV3Schema"])
                validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return validators


def crd_errors(manifest: dict[str, Any]) -> list[str]:
    """Every schema violation of ``manifest`` as ``path: message``; KeyError for a kind not vendored."""
    validator = _validators()[(manifest["apiVersion"], manifest["kind"])]
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '(root)'}: {error.message}"
        for error in sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    ]


def vendored_kinds() -> set[tuple[str, str]]:
    return set(_validators())
