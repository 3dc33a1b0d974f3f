"""Evaluate a checkpoint: held-out loss and perplexity, and a greedy sample.

Single process, unsharded: only the model weights are read (DCP reshards them from whatever layout
saved them), so evaluation runs beside training on a CPU or one chip.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.checkpoint import APP_KEY, CheckpointStoreError, check_model, read_manifest, store
from trainer.config import JobConfig
from trainer.model import Transformer


@dataclass
class EvalResult:
    step: int
    loss: float
    perplexity: float
    sample_ids: list[int]  # the generated continuation only, without the prompt


def load_model(step_url: str, job: JobConfig) -> tuple[int, Transformer]:
    """The checkpoint's step and its weights in a fresh unsharded model (eval mode)."""
    manifest = read_manifest(step_url)
    if manifest is None or not manifest.good:
        state = "no committed manifest" if manifest is None else f"status {manifest.status}"
        raise CheckpointStoreError(f"checkpoint {step_url} has {state}; evaluate a committed checkpoint")
    check_model(manifest, job.model_fingerprint())
    model = Transformer(job.model, max_seq_len=job.train.seq_len)
    store.load({APP_KEY: {"model": model.state_dict()}}, step_url, no_dist=True)
    return manifest.step, model.eval()


@torch.inference_mode()
def mean_loss(model: Transformer, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
    """Token-weighted mean next-token cross-entropy over (inputs, targets) batches of shape [B, T]."""
    total, tokens = 0.0, 0
    for inputs, targets in batches:
        logits = model(inputs)
        total += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").item()
        tokens += targets.numel()
    if not tokens:
        raise ValueError("evaluation got no batches; check the validation split of the dataset")
    return total / tokens


@torch.inference_mode()
def greedy_sample(model: Transformer, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Argmax decoding, the context clipped to the model's max_seq_len (no KV cache: samples are short)."""
    ids = list(prompt_ids)
    for _ in range(new_tokens):
        context = torch.tensor([ids[-model.max_seq_len :]])
        ids.append(int(model(context)[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def evaluate_checkpoint(
    step_url: str,
    job: JobConfig,
    batches: Iterable[tuple[Tensor, Tensor]],
    sample_prompt_ids: list[int] | None,
    sample_tokens: int,
) -> EvalResult:
    step, model = load_model(step_url, job)
    loss = mean_loss(model, batches)
    sample = greedy_sample(model, sample_prompt_ids, sample_tokens) if sample_prompt_ids else []
    return EvalResult(step=step, loss=loss, perplexity=math.exp(loss), sample_ids=sample)
