"""Hugging Face Llama safetensors export and import of tessera checkpoints, through DCP's HF storage.

``export_hf`` reads a committed checkpoint's weights (resharded from whatever layout saved them, as
evaluation does), renames them to transformers' ``LlamaForCausalLM`` names, and writes them with DCP's
``HuggingFaceStorageWriter``: ``model-0000i-of-0000n.safetensors`` files of at most 5 GB (the Hub's
default shard size), ``model.safetensors.index.json``, and a ``config.json`` in HF's Llama format, so
``LlamaForCausalLM.from_pretrained(OUT_DIR)`` loads it. ``import_hf`` reads such a directory with
``HuggingFaceStorageReader`` and writes a committed tessera checkpoint (weights only, step 0), which
``tessera evaluate``/validation load, which DCP reshards onto any layout, and which a run whose
checkpoint location holds it trains from (its record's ``imported_from`` marks it weights-only).

The names, layouts and ``config.json`` are the model family's (``ModelFamily.hf``; Llama's in
``trainer/models/llama/hf.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch import Tensor
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException

from trainer import storage
from trainer.checkpoint import store
from trainer.checkpoint.commit import (
    IMPORTED_FROM,
    CommitRecord,
    list_checkpoints,
    read_commit,
    saved_files,
    step_dir_name,
    write_commit,
)
from trainer.checkpoint.state import APP_KEY
from trainer.config import JobConfig, ModelConfig
from trainer.evaluate import load_model
from trainer.failures import UserError
from trainer.models import HFMapping, family_of

HFDtype = Literal["bf16", "fp32"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HF_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}
MAX_FILE_BYTES = 5 * 10**9
CONFIG_NAME = "config.json"


def file_index(tensors: dict[str, Tensor], max_bytes: int = MAX_FILE_BYTES) -> dict[str, int]:
    """Which safetensors file (1..n) each tensor goes to: in order, a new file once max_bytes is full."""
    index, used, mapping = 1, 0, {}
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if used and used + size > max_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping


def resolve_step(checkpoint_url: str) -> str:
    """A step directory as given, or the newest good checkpoint under a checkpoints directory."""
    if read_commit(checkpoint_url) is not None:
        return checkpoint_url.rstrip("/")
    good = [m for m in list_checkpoints(checkpoint_url) if m.good]
    if not good:
        raise UserError(f"no committed checkpoint at {checkpoint_url}; give a step-N directory or its parent")
    return good[-1].url


def export_hf(checkpoint_url: str, job: JobConfig, out_dir: str | Path, dtype: HFDtype = "bf16") -> Path:
    """Write the checkpoint's weights as HF Llama (or Mixtral) safetensors + config.json into out_dir."""
    hf = hf_mapping(job.model)
    hf.check_exportable(job.model)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} is not empty; export into a new directory")
    _, model = load_model(resolve_step(checkpoint_url), job)  # committed, fingerprint-checked
    tensors = hf.to_hf(model.state_dict(), job.model, DTYPES[dtype])
    writer = HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=file_index(tensors))
    dcp.save(tensors, storage_writer=writer, no_dist=True)
    config = hf.hf_config(job.model, job.train.seq_len, HF_DTYPE_NAMES[dtype])
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def first_line(exc: BaseException) -> str:
    return next(iter(str(exc).splitlines()), type(exc).__name__)


def read_hf_config(source: Path) -> dict[str, Any]:
    """``config.json`` as a mapping, or a one-line error naming the file and what is wrong with it."""
    path = source / CONFIG_NAME
    try:
        config = json.loads(path.read_bytes())
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}; give the directory of an HF export") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise UserError(f"{path} is not JSON: {first_line(exc)}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object of model settings, but a {type(config).__name__}")
    return config


def check_safetensors_headers(source: Path) -> None:
    """Open every safetensors file's header before DCP reads them: a hostile or truncated one (a header
    claiming 10 GB, not JSON, offsets past the end) is one line naming the file and safetensors' cause,
    where DCP would print a traceback and say only ``CheckpointException ranks:dict_keys([0])``."""
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise UserError(f"{source} holds no *.safetensors files; give the directory of an HF export")
    for path in files:
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            cause = first_line(exc).removeprefix("Error while deserializing header: ")
            raise UserError(f"cannot read the HF weights in {path}: {cause}") from None


def import_hf(hf_dir: str | Path, job: JobConfig, checkpoint_url: str, step: int = 0) -> str:
    """Write HF Llama/Mixtral safetensors as a committed tessera checkpoint (weights only) at checkpoint_url/step-N.

    Returns the step directory's URL. The weights load as fp32 (tessera's master weights).
    """
    hf = hf_mapping(job.model)
    hf.check_convertible(job.model)
    source = Path(hf_dir)
    hf.check_hf_config(read_hf_config(source), job.model)
    check_safetensors_headers(source)
    step_url = storage.join(checkpoint_url, step_dir_name(step))
    if read_commit(step_url) is not None:
        raise UserError(f"{step_url} already holds a checkpoint; import into another checkpoint URL or step")
    meta = _meta_state(job)
    # The HF names and shapes of this model, as export would write them (fp32: tessera's master weights).
    tensors = {hf: torch.empty(t.shape) for hf, t in hf.to_hf(meta, job.model, torch.float32).items()}
    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(source)), no_dist=True)
    except (CheckpointException, RuntimeError) as exc:
        cause = next(iter(exc.failures.values()))[0] if isinstance(exc, CheckpointException) else exc
        raise UserError(f"cannot read the HF weights in {source}: {first_line(cause)}") from None
    weights = hf.from_hf(tensors, job.model)
    # State the HF format has no place for (routing biases, balance: bias) starts at zero, as in a fresh model.
    unset = {fqn: torch.zeros(t.shape) for fqn, t in meta.items() if fqn not in weights}
    with store.dcp_errors("saving", step_url):
        metadata = dcp.save(
            {APP_KEY: {"model": weights | unset}},
            storage_writer=store.storage_writer(step_url),
            no_dist=True,
        )
    record = CommitRecord(
        step=step,
        tokens=0,
        model_fingerprint=job.model_fingerprint(),
        world_size=1,
        layout=job.parallel.model_dump(),
        files=saved_files(step_url, metadata),
        meta={IMPORTED_FROM: str(source)},
    )
    write_commit(step_url, record)
    return step_url


def hf_mapping(cfg: ModelConfig) -> HFMapping:
    family = family_of(cfg)
    if family.hf is None:
        raise UserError(f"model family {family.name!r} has no Hugging Face format; it cannot convert")
    return family.hf()


def _meta_state(job: JobConfig) -> dict[str, Tensor]:
    with torch.device("meta"):
        return family_of(job.model).build(job.model, job.train.seq_len).state_dict()
