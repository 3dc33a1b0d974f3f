"""Rules the run form enforces itself: the cross-field checks JSON schema can express.

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
from trainer.config import Accelerator
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
    """For a preset's own shape: tp divides its query and key/value heads, pp its layers."""
    rules = []
    for preset in preset_names():
        shape = preset_shape(preset)
        if not shape:  # custom: the spec gives every dimension
            continue
        is_preset = {"const": preset}
        heads = gcd(int(shape["n_heads"]), int(shape["n_kv_heads"]))
        rules.append(
            {
                "if": _when("model", preset=is_preset, n_heads={"type": "null"}, n_kv_heads={"type": "null"}),
                "then": _then("parallel", "tp", divisors(heads)),
            }
        )
        rules.append(
            {
                "if": _when("model", preset=is_preset, n_layers={"type": "null"}),
                "then": _then("parallel", "pp", divisors(int(shape["n_layers"]))),
            }
        )
    return rules


def form_rules(schema: dict[str, Any]) -> None:
    """``json_schema_extra`` of the spec: adds the rules to its schema."""
    schema["allOf"] = [*chip_rules(), *layout_rules()]
