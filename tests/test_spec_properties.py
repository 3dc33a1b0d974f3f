"""Untrusted specs (UI parameters, CLI files): every input validates and plans, or is one SpecError
naming the field — never another exception, never a traceback. Property-based, no processes."""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import validate

from deployments.spec import SpecError, TrainingSpec, parse_spec
from flows.pipeline import train_pipeline
from trainer.failures import UserError
from trainer.plan import plan_for_job

BASE: dict[str, Any] = {
    "name": "props",
    "model": {"preset": "tiny"},
    "train": {"steps": 4, "seq_len": 32, "global_batch_size": 4, "micro_batch_size": 2},
    "parallel": {"dp_shard": 2},
    "cluster": {"chips_per_node": 2},
}
SECTIONS = [name for name, info in TrainingSpec.model_fields.items() if info.annotation is not str]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def field_names(section: str) -> list[str]:
    annotation = TrainingSpec.model_fields[section].annotation
    fields = getattr(annotation, "model_fields", {})
    return sorted(fields) or ["x"]


@st.composite
def mutated_specs(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """The base spec with one field (known or unknown) of one section set to any JSON value."""
    spec = copy.deepcopy(BASE)
    section = draw(st.sampled_from(sorted(TrainingSpec.model_fields)))
    if section in SECTIONS and field_names(section) != ["x"]:
        key = draw(st.sampled_from(field_names(section)) | st.text(min_size=1, max_size=8))
        spec[section] = {**spec.get(section, {}), key: draw(json_values)}
    else:
        spec[section] = draw(json_values)
    return spec, section


def accept_or_name_the_field(spec: dict[str, Any], section: str) -> None:
    try:
        parsed = parse_spec(spec, "ui")
    except SpecError as error:
        assert str(error).startswith("ui is invalid:\n")
        # The field's path, or the section whose cross-field check failed (e.g. the layout).
        assert section in str(error) or "\nspec: " in str(error), str(error)
        return
    # A spec that validates but does not fit the cluster is a clear user error, before any launch.
    with contextlib.suppress(UserError):
        plan_for_job(parsed.job_config(data_url=None))


@settings(max_examples=2000, deadline=None)
@given(mutated_specs())
@example((BASE | {"model": {"preset": "custom", "n_layers": 10**15, "dim": 64, "n_heads": 4}}, "model"))
@example((BASE | {"name": "../escape"}, "name"))
@example((BASE | {"name": "naïve-run"}, "name"))
@example((BASE | {"name": "/abs/path"}, "name"))
@example((BASE | {"trian": {"steps": 1}}, "trian"))
def test_every_spec_validates_or_is_rejected_naming_a_field(case: tuple[dict[str, Any], str]) -> None:
    accept_or_name_the_field(*case)


@pytest.mark.parametrize("name", ["../x", "a/b", "run\u202e", "Ü", "x" * 60, ".", ""])
def test_names_that_could_escape_or_break_the_run_directory_are_rejected(name: str) -> None:
    with pytest.raises(SpecError, match=r"^ui is invalid:\nname: "):
        parse_spec(BASE | {"name": name}, "ui")


@pytest.mark.parametrize("data", [None, [], "train: 1", 3])
def test_a_spec_that_is_not_a_mapping_is_one_clear_error(data: object) -> None:
    with pytest.raises(SpecError, match="expected a mapping of spec fields"):
        parse_spec(data, "ui")


PIPELINE_SCHEMA = parameter_schema(train_pipeline).model_dump_for_openapi()


def server_accepts(spec: dict[str, Any]) -> bool:
    """What the Prefect server decides for a run's parameters: the deployment's JSON schema, checked
    by the same function the server's API calls before it creates a flow run."""
    return not validate({"spec": spec}, PIPELINE_SCHEMA, raise_on_error=False)


def spec_accepts(spec: dict[str, Any]) -> bool:
    """What `tessera validate`, `tessera run` and the flow's own parameter check decide."""
    try:
        parse_spec(spec, "door")
    except SpecError:
        return False
    return True


# No per-example deadline: a busy machine slows examples down, and speed is not what this checks.
@settings(max_examples=2000, deadline=None)
@given(mutated_specs())
@example((BASE | {"train": {**BASE["train"], "steps": True}}, "train"))
@example((BASE | {"optimizer": {"lr": float("inf")}}, "optimizer"))
@example((BASE | {"seed": 2**64}, "seed"))
@example((BASE | {"data": {"loader_workers": 100_000}}, "data"))
@example((BASE | {"cluster": {**BASE["cluster"], "namespace": "x; rm -rf /"}}, "cluster"))
@example((BASE | {"faults": {"collective_timeout_s": 1e300}}, "faults"))
def test_a_spec_the_cli_accepts_the_server_accepts_too(case: tuple[dict[str, Any], str]) -> None:
    """One door: nothing passes `tessera validate` and is then refused by the server (or the reverse
    for anything JSON schema can say; rules across fields, and finiteness, which JSON cannot express,
    are the flow's first check, within seconds of the run starting)."""
    spec, _ = case
    if spec_accepts(spec):
        assert server_accepts(json.loads(json.dumps(spec))), spec
