"""The run form: field order, and the cross-field rules the form itself refuses, checked with the
validator the Prefect server runs on a submitted form (``prefect.utilities.schema_tools``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools import validate

from deployments.spec import SPEC_DIR, TrainingSpec, read_yaml
from flows.pipeline import train_pipeline
from tests.pipeline_specs import tiny_spec_dict

FORM = parameter_schema(train_pipeline).model_dump_for_openapi()


def form_errors(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(field path, message) for each rule the form breaks, as the server reports them."""
    errors = validate({"spec": spec}, FORM, raise_on_error=False, preprocess=True, ignore_required=True)
    return [(".".join(str(p) for p in e.path), e.message) for e in errors]


def shown(schema: dict[str, Any]) -> list[str]:
    """The fields the form renders, as paths, in order (sections are objects with properties)."""
    paths = []
    for name, prop in schema.get("properties", {}).items():
        nested = shown(prop)
        paths += [f"{name}.{p}" for p in nested] if nested else [name]
    return paths


def test_the_form_shows_what_people_change_first_and_every_other_section_as_one_editor() -> None:
    spec = FORM["definitions"]["TrainingSpec"]
    assert shown(spec)[:8] == [
        "name",
        "model.preset",
        "train.steps",
        "train.global_batch_size",
        "cluster.nodes",
        "cluster.chips_per_node",
        "cluster.work_pool",
        "parallel",  # a JSON editor, as every section below it
    ]
    assert len(shown(spec)) <= 17  # was 102
    assert not any("anyOf" in prop for prop in spec["properties"].values())  # no str/None toggles
    whole = spec["allOf"][0]  # every field, validated though not rendered
    assert (
        set(whole["properties"]) == set(TrainingSpec.model_fields) and whole["additionalProperties"] is False
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"train": {"stpes": 3}}, "spec.train"),  # a typo in a shown section
        ({"parallel": {"dp_shrad": 2}}, "spec.parallel"),  # ... and in a JSON one
        ({"cluster": {"work_pool": "no spaces"}}, "spec.cluster.work_pool"),
        ({"cluster": {"accelerator": "fpga"}}, "spec.cluster.accelerator"),  # not shown, still checked
    ],
)
def test_the_form_still_refuses_what_the_whole_spec_refuses(
    change: dict[str, Any], field: str, tmp_path: Path
) -> None:
    spec = tiny_spec_dict(tmp_path, "form", **change)
    assert field in [where for where, _ in form_errors(spec)]


def test_the_form_accepts_a_null_work_pool_and_a_missing_section(tmp_path: Path) -> None:
    spec = tiny_spec_dict(tmp_path, "form", cluster={"work_pool": None})
    del spec["optimizer"]
    assert form_errors(spec) == []


@pytest.mark.parametrize("path", sorted(SPEC_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_the_form_accepts_every_shipped_spec(path: Path) -> None:
    assert form_errors(read_yaml(path.read_text())) == []


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"parallel": {"dp_shard": 2, "tp": 3}}, "spec.parallel.tp", "3 is not one of [1, 2]"),
        (
            {"model": {"preset": "small"}, "parallel": {"pp": 3}},
            "spec.parallel.pp",
            "is not one of [1, 2, 4, 8]",
        ),
        (
            {"cluster": {"accelerator": "gpu", "chip": "tpu-v5p"}},
            "spec.cluster.chip",
            "'tpu-v5p' is not one of",
        ),
        ({"cluster": {"chip": "h100-sxm"}}, "spec.cluster.chip", "is not one of ['cpu']"),  # accelerator: cpu
    ],
)
def test_the_form_refuses_impossible_layouts(
    change: dict[str, Any], field: str, message: str, tmp_path: Path
) -> None:
    spec = tiny_spec_dict(tmp_path, "form", **change)
    ((where, said),) = form_errors(spec)
    assert where == field and message in said


def test_explicit_shapes_are_left_to_the_spec(tmp_path: Path) -> None:
    """A model whose heads are given is no preset's shape: the form cannot know its divisors."""
    spec = tiny_spec_dict(
        tmp_path, "form", model={"n_heads": 6, "n_kv_heads": 3, "dim": 192}, parallel={"tp": 3}
    )
    assert form_errors(spec) == []
