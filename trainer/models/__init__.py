"""Model families: each one a folder, registered here, that gives the rest of tessera what it needs.

Core code never imports a family: the trainer builds and parallelizes through :func:`family_of`, the
planner counts parameters through it, and checkpoint export maps names through it. A spec names a
family by its preset (``model.preset``; ``custom`` is Llama's), so specs, job JSON and checkpoint
fingerprints carry no family field of their own. A spec's ``model.from_hf`` (a Hugging Face config.json)
names it through the file's ``model_type``: each family lists the types it builds (``hf_model_types``)
and its HF mapping's ``model_fields`` turns such a file into a preset of the family and its dimensions
(``from_hf.py``). As in torchtitan (``protocols/train_spec.py`` and
``models/<family>/``), a new architecture is a new folder and one ``register`` call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # spec validation reads presets from here: it must not import torch or trainer.config
    import torch
    from torch import Tensor, nn
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.config import ModelConfig, ParallelConfig

# The family a ``custom`` preset (every dimension given) builds.
CUSTOM_PRESET, CUSTOM_FAMILY = "custom", "llama"


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by where they live; pipeline stages and FLOP counts need the split, not just the sum."""

    embedding: int  # input table V·d (shared with the output projection when tied)
    per_layer: float  # mean over blocks (MoE and dense blocks differ when MoE is every n-th layer)
    per_layer_matmul: float  # a block's weights one token multiplies (active experts only; no norm gains)
    n_layers: int
    final_norm: int
    output: int  # V·d, or 0 when tied to the embedding
    routed: int = 0  # routed-expert weights, over all MoE layers (what expert parallelism splits)
    inactive: int = 0  # the part of them a token skips

    @property
    def total(self) -> int:
        return round(self.embedding + self.n_layers * self.per_layer + self.final_norm + self.output)

    @property
    def active(self) -> int:
        """Parameters one token uses (the published "active" count of an MoE model; total when dense)."""
        return self.total - self.inactive

    @property
    def matmul(self) -> int:
        """N in 6N: weights every token multiplies (the embedding lookup does no FLOPs; the output does)."""
        return self.n_layers * self.per_layer_matmul + self.output_matrix

    @property
    def output_matrix(self) -> int:
        """V·d: the output projection's size, tied or not."""
        return self.output or self.embedding


class HFMapping(Protocol):
    """A family's Hugging Face safetensors format: names, layouts and ``config.json``."""

    def check_convertible(self, cfg: ModelConfig) -> None:
        """Raise a UserError naming the field when the HF format cannot hold this model (either way)."""

    def check_exportable(self, cfg: ModelConfig) -> None:
        """As ``check_convertible``, plus what only an export would lose."""

    def to_hf(self, state: dict[str, Tensor], cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Tensor]:
        """tessera's model state dict as HF tensors."""

    def from_hf(self, state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        """HF tensors as tessera's model state dict."""

    def hf_config(self, cfg: ModelConfig, max_seq_len: int, dtype: str) -> dict[str, Any]:
        """The ``config.json`` an export writes."""

    def check_hf_config(self, config: dict[str, Any], cfg: ModelConfig) -> None:
        """Raise a UserError naming each field where an HF ``config.json`` differs from the spec."""

    def model_fields(self, config: dict[str, Any]) -> dict[str, Any]:
        """The ModelConfig fields (``preset`` naming a preset of this family, and every dimension) of the
        model an HF ``config.json`` describes, for ``model.from_hf``; a ValueError naming the config key
        and the fix for anything the family would build differently (refused, never approximated).
        Runs at spec validation: keep torch out of it."""


@dataclass(frozen=True)
class ModelFamily:
    """What a family gives: its presets, shape rules, module, parameter count, parallelize plan, HF format.

    ``build`` returns a module (on the current default device, ``meta`` when the trainer builds) whose
    blocks sit in ``layers`` (an ``nn.ModuleDict``: the units FSDP wraps, activation checkpointing and
    compile wrap, and pipeline stages split), with ``init_weights(seed)``, and ``forward(tokens,
    targets)`` returning the mean token loss, and an ``eos_id`` attribute (None by default) that the
    builder sets to the dataset's end-of-text id for ``model.attention=document``. ``parallelize`` applies the layout to one model or stage
    in place, refusing what the family does not support. ``presets``, ``check`` and ``count_params``
    run on every spec validation, so a family's ``__init__`` keeps torch out of them and imports its
    module and plans inside ``build``/``parallelize``/``hf``.
    """

    name: str
    presets: Mapping[str, Mapping[str, Any]]  # preset name -> the ModelConfig fields it fills
    check: Callable[[ModelConfig], None]  # the family's shape rules; ValueError naming the field and fix
    build: Callable[[ModelConfig, int], nn.Module]  # (cfg, max_seq_len)
    count_params: Callable[[ModelConfig], ParamCounts]  # exact, from the config alone (the planner's N)
    parallelize: Callable[[nn.Module, DeviceMesh, ParallelConfig], nn.Module]
    # Loads the family's Hugging Face mapping (on use); None: no HF format.
    hf: Callable[[], HFMapping] | None = None
    # The config.json ``model_type`` values ``model.from_hf`` builds this family from (its mapping's
    # ``model_fields`` reads them); each type belongs to one family.
    hf_model_types: tuple[str, ...] = ()
    # Layouts the family refuses (e.g. no TP plan): one error per field, naming it and the fix.
    check_layout: Callable[[ModelConfig, ParallelConfig], list[str]] | None = None


_FAMILIES: dict[str, ModelFamily] = {}
_PRESET_FAMILY: dict[str, str] = {CUSTOM_PRESET: CUSTOM_FAMILY}
_HF_TYPE_FAMILY: dict[str, str] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add family; its preset names become valid ``model.preset`` values, its HF model types valid
    ``model.from_hf`` configs. Names, presets and model types are unique."""
    taken = [name for name in family.presets if name in _PRESET_FAMILY]
    taken += [name for name in family.hf_model_types if name in _HF_TYPE_FAMILY]
    if family.name in _FAMILIES or taken:
        raise ValueError(
            f"model family {family.name!r} or its presets/HF model types {taken} are already registered"
        )
    if family.hf_model_types and family.hf is None:
        raise ValueError(f"model family {family.name!r} names HF model types but has no HF mapping (hf)")
    _FAMILIES[family.name] = family
    _PRESET_FAMILY.update(dict.fromkeys(family.presets, family.name))
    _HF_TYPE_FAMILY.update(dict.fromkeys(family.hf_model_types, family.name))
    return family


def get(name: str) -> ModelFamily:
    if name not in _FAMILIES:
        raise KeyError(f"no model family {name!r}; registered: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


def preset_names() -> list[str]:
    """Every registered preset, then ``custom``: the values ``model.preset`` takes."""
    return [*(p for p in _PRESET_FAMILY if p != CUSTOM_PRESET), CUSTOM_PRESET]


def preset_family(preset: str) -> ModelFamily:
    return get(_PRESET_FAMILY[preset])


def preset_shape(preset: str) -> Mapping[str, Any]:
    """The fields a preset fills (none for ``custom``)."""
    return {} if preset == CUSTOM_PRESET else preset_family(preset).presets[preset]


def hf_model_types() -> list[str]:
    """Every config.json ``model_type`` some family builds (``model.from_hf``)."""
    return list(_HF_TYPE_FAMILY)


def hf_type_family(model_type: str) -> ModelFamily | None:
    """The family that builds HF models of ``model_type``; None if none does."""
    name = _HF_TYPE_FAMILY.get(model_type)
    return None if name is None else get(name)


def family_of(cfg: ModelConfig) -> ModelFamily:
    return preset_family(cfg.preset)


def param_count(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once); works on meta-device models."""
    return sum(p.numel() for p in model.parameters())


# The built-in families register themselves on import; last, since they import this module.
from trainer.models import deepseek, llama  # noqa: E402, F401
