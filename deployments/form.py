"""The run form: what it shows, and the cross-field rules it enforces itself.

What it shows. Prefect 3's run form (its UI's schema form) renders a schema's ``properties``, each
nested object as a section, in ``position`` order, with no collapsed or hidden sections; a property
that is not in its object's ``required`` list is labelled "(Optional)"; a property typed ``X | None``
(``anyOf``) is a toggle between the two types; an object without ``properties`` is one JSON editor.
The spec's 100-odd fields rendered so were a 12,000 px form. So the spec's schema keeps every field
for validation inside ``allOf`` (the form does not render an object's ``allOf``) and shows, as its
``properties``, the fields a person fills in on most runs (:data:`ESSENTIALS`: name, preset, steps,
batch, nodes and chips, pool) with each other section as one JSON editor below them. Nothing else
changes: the server validates a submitted form against the whole schema, every field is still in
the form's values (the JSON view, Parameters ⋮ → "Use JSON input", edits them all), and the
flow's parameter is the same typed spec.

The Prefect UI validates a form against the deployment's parameter schema (on the server, with a
Draft 2020-12 validator) before it creates a flow run. ``if``/``then`` rules added to the spec's
schema make that validation refuse what the spec would refuse 20 s later at run start: a chip of
another accelerator, and a tensor- or pipeline-parallel degree a preset's shape cannot be cut into.
What JSON schema cannot express (degrees multiplying to the chip count, the plan fitting in HBM)
is still refused by the spec's own validation, before anything launches.
"""

from __future__ import annotations

from math import gcd
from typing import Any

from trainer.backends.chips import chips_for
from trainer.config import Accelerator, HardwareConfig, ModelConfig, TrainConfig
from trainer.divisors import divisors
from trainer.models import preset_names, preset_shape

ACCELERATORS: tuple[str, ...] = Accelerator.__args__


def _when(section: str, **conditions: dict[str, Any]) -> dict[str, Any]:
    """Matches a spec whose ``section`` has these property conditions; an absent section or property
    matches too, which is right because each condition below holds for the field's default."""
    return {"properties": {section: {"properties": conditions}}}


def _then(section: str, field: str, choices: list[Any]) -> dict[str, Any]:
    return {"properties": {section: {"properties": {field: {"enum": choices}}}}}


def chip_rules() -> list[dict[str, Any]]:
    """cluster.chip is one of cluster.accelerator's chips (the default accelerator is cpu)."""
    return [
        {
            "if": _when("cluster", accelerator={"const": accelerator}),
            "then": _then("cluster", "chip", chips_for(accelerator)),
        }
        for accelerator in ACCELERATORS
    ]


def layout_rules() -> list[dict[str, Any]]:
    """For a preset's own shape: tp divides its query and key/value heads, pp its layers. Not for a
    model.from_hf spec: its shape is in a file the schema cannot read (the spec's validation checks it)."""
    rules = []
    for preset in preset_names():
        shape = preset_shape(preset)
        if not shape:  # custom: the spec gives every dimension
            continue
        is_preset, unset = {"const": preset}, {"type": "null"}
        heads = gcd(int(shape["n_heads"]), int(shape["n_kv_heads"]))
        rules.append(
            {
                "if": _when("model", preset=is_preset, from_hf=unset, n_heads=unset, n_kv_heads=unset),
                "then": _then("parallel", "tp", divisors(heads)),
            }
        )
        rules.append(
            {
                "if": _when("model", preset=is_preset, from_hf=unset, n_layers=unset),
                "then": _then("parallel", "pp", divisors(int(shape["n_layers"]))),
            }
        )
    return rules


# The fields shown, by section, in the order shown: the ones changed on most runs.
ESSENTIALS: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "model": (ModelConfig, ("preset",)),
    "train": (TrainConfig, ("steps", "global_batch_size")),
    "cluster": (HardwareConfig, ("nodes", "chips_per_node")),
}
ELSEWHERE = "Every field, shown or not: Parameters ⋮ → Use JSON input (`tessera schema` lists them)."
WORK_POOL = {
    # A plain text box, not a string/None toggle: with no default, Prefect's validation lets it be null.
    "type": "string",
    "title": "Work Pool",
    "description": "Prefect work pool; empty: tessera-ACCELERATOR.",
}


def shown_section(name: str, full: dict[str, Any]) -> dict[str, Any]:
    """A section of the form with only its essential fields (the others stay in the values, unshown)."""
    model, fields = ESSENTIALS[name]
    own = model.model_json_schema()["properties"]
    properties = {field: own[field] for field in fields}
    if name == "cluster":
        properties["work_pool"] = WORK_POOL
    return {
        "type": "object",
        "title": name.capitalize(),
        "description": full["description"],
        "properties": properties,
    }


def json_section(name: str, full: dict[str, Any]) -> dict[str, Any]:
    """A section shown as one JSON editor of the values the spec sets (empty: the defaults)."""
    return {
        "type": "object",
        "title": f"{name.capitalize()} (JSON)",
        "description": f"{full['description']} Empty: the defaults.",
    }


def form_properties(full: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What the form renders, from the spec's own properties: essentials first, then the rest. Each
    accepts whatever the whole schema accepts (it checks nothing of its own that the spec does not)."""
    shown: dict[str, dict[str, Any]] = {"name": full["name"]}
    shown |= {name: shown_section(name, full[name]) for name in ESSENTIALS}
    for name, prop in full.items():
        if name in shown:
            continue
        if "$ref" in prop:
            shown[name] = json_section(name, prop)
        elif "anyOf" in prop:  # str | None: a text box, null allowed as it has no default
            shown[name] = {k: v for k, v in prop.items() if k in ("title", "description")} | {
                "type": "string"
            }
        else:
            shown[name] = prop
    return shown


def form_rules(schema: dict[str, Any]) -> None:
    """``json_schema_extra`` of the spec: the whole schema moves into ``allOf`` with the rules (still
    validated, not rendered); ``properties`` become what the form shows."""
    full = {
        "properties": schema.pop("properties"),
        "additionalProperties": schema.pop("additionalProperties"),
    }
    schema["properties"] = form_properties(full["properties"])
    schema["description"] = f"{schema['description']} {ELSEWHERE}"
    schema["allOf"] = [full, *chip_rules(), *layout_rules()]
