"""``model.from_hf``: the model a Hugging Face ``config.json`` describes, as ModelConfig fields.

Read once, when the spec is validated: the file's ``model_type`` picks the family
(``ModelFamily.hf_model_types``) and the family's HF mapping turns the file into ModelConfig fields
(``HFMapping.model_fields``): a preset of that family and every dimension. What a spec, a run record,
a job file and a checkpoint's fingerprint carry from then on are those fields, never the path, so a
run never reads the file again, and an edited config.json cannot change a run that resumes.

The file is a local path (relative to the working directory, as ``data.paths`` are) or an fsspec URL
(``gs://``, ``s3://``); a directory means its ``config.json``. Never the Hub: download the model
first. No torch here: spec validation runs it.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec

from trainer.failures import UserError
from trainer.hub import HUB_URL_PREFIXES
from trainer.models import hf_model_types, hf_type_family

CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kB; anything far larger is the wrong file


def read_hf_config(location: str) -> dict[str, Any]:
    """The JSON object at location (or at location/config.json), or a ValueError naming the fix."""
    if location.startswith(HUB_URL_PREFIXES):
        raise ValueError(
            f"model.from_hf={location!r} is on the Hugging Face Hub, which tessera never reads; download "
            "the model's config.json and give its local path (or a gs:// / s3:// URL)"
        )
    try:
        raw = _read_bounded(location)
    except FileNotFoundError:
        raise ValueError(
            f"model.from_hf={location!r}: no such file; give the path of a Hugging Face config.json "
            "(relative to the working directory) or of the directory holding it"
        ) from None
    except NotARegularFile:
        raise ValueError(f"model.from_hf={location!r} is not a regular file; give a config.json") from None
    except (
        OSError,
        ValueError,
        ImportError,
    ) as exc:  # unreadable, an unknown protocol, a missing fsspec backend
        raise ValueError(f"model.from_hf={location!r}: cannot read it: {exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"model.from_hf={location!r} is over {MAX_CONFIG_BYTES:,} bytes; is it a config.json?"
        )
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        first = next(iter(str(exc).splitlines()), type(exc).__name__)
        raise ValueError(f"model.from_hf={location!r} is not JSON ({first}); give a config.json") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"model.from_hf={location!r} holds a JSON {type(config).__name__}, not the object of a config.json"
        )
    return config


class NotARegularFile(OSError):
    """A FIFO, a device or a socket where a config.json should be."""


def _read_bounded(location: str) -> bytes:
    """At most MAX_CONFIG_BYTES + 1 bytes of the file at location (or of its config.json)."""
    fs, path = fsspec.core.url_to_fs(location)
    if fs.isdir(path):
        path = f"{path.rstrip('/')}/{CONFIG_NAME}"
    if not fs.exists(path):
        raise FileNotFoundError(path)
    if not fs.isfile(path):  # a FIFO or a device: the read would block, or never end
        raise NotARegularFile(path)
    with fs.open(path, "rb") as file:
        return file.read(MAX_CONFIG_BYTES + 1)


def model_fields(location: str) -> dict[str, Any]:
    """The ModelConfig fields of the model the config.json at location describes."""
    config = read_hf_config(location)
    model_type = config.get("model_type")
    family = hf_type_family(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"model.from_hf={location!r} has model_type {model_type!r}, which tessera does not build; "
            f"supported: {', '.join(hf_model_types())}"
        )
    try:
        return family.hf().model_fields(config)
    except (ValueError, UserError) as exc:  # as a ValueError: what pydantic reports as the field's error
        raise ValueError(f"model.from_hf={location!r}: {exc}") from None
