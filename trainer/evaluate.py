"""Evaluate a checkpoint: held-out loss and perplexity, and a greedy sample.

Single process, unsharded: only the model weights are read (DCP reshards them from whatever layout
saved them), in fp32. The pipeline's evaluate task calls :func:`evaluation_record` in the flow's
process when the model fits there, and otherwise runs this module as a one-pod Job on the training
pool (``deployments/eval_placement.py`` decides), which writes the same record to ``--out``::

    python -m trainer.evaluate --job job.json --step-url URL --batches 8 \
        --sample-prompt "def " --sample-tokens 32 --out URL/evals/step-000040.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer import storage
from trainer.checkpoint import APP_KEY, CheckpointStoreError, check_model, read_commit, store
from trainer.checkpoint.errors import CheckpointError
from trainer.config import JobConfig
from trainer.data.errors import DataError
from trainer.data.loader import document_eos_id, load_tokenizer, validation_sample
from trainer.failures import EXIT_INFRA, EXIT_OK, EXIT_USER_ERROR, UserError, is_infra_error
from trainer.models import family_of


@dataclass
class EvalResult:
    step: int
    loss: float
    perplexity: float
    sample_ids: list[int]  # the generated continuation only, without the prompt


def load_model(step_url: str, job: JobConfig) -> tuple[int, nn.Module]:
    """The checkpoint's step and its weights in a fresh unsharded model (eval mode)."""
    manifest = read_commit(step_url)
    if manifest is None or not manifest.good:
        state = "no committed manifest" if manifest is None else f"status {manifest.status}"
        raise CheckpointStoreError(f"checkpoint {step_url} has {state}; evaluate a committed checkpoint")
    check_model(manifest, job.model_fingerprint())
    model = family_of(job.model).build(job.model, job.train.seq_len)
    model.eos_id = document_eos_id(job)
    store.load({APP_KEY: {"model": model.state_dict()}}, step_url, no_dist=True)
    return manifest.step, model.eval()


@torch.inference_mode()
def mean_loss(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
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
def greedy_sample(model: nn.Module, prompt_ids: list[int], new_tokens: int) -> list[int]:
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


def evaluation_record(
    step_url: str, job: JobConfig, batches: int, sample_prompt: str, sample_tokens: int
) -> dict[str, Any]:
    """Evaluate on ``batches`` micro-batches drawn by the job's seed across the validation split; the
    record the run stores (the result, the tokens and documents it covered, the decoded sample and the
    checkpoint URL)."""
    assert job.data_url is not None, "evaluation reads the prepared dataset's validation split"
    tokenizer = load_tokenizer(job.data_url)
    held_out = validation_sample(job.data_url, batches * job.train.micro_batch_size, job.seed)
    result = evaluate_checkpoint(
        step_url,
        job,
        held_out.batches(job.train.micro_batch_size),
        tokenizer.encode(sample_prompt).ids,
        sample_tokens,
    )
    return {
        **asdict(result),
        "tokens": held_out.tokens,
        "documents": held_out.documents,
        "sample": sample_prompt + tokenizer.decode(result.sample_ids),
        "url": step_url,
    }


def main(argv: list[str]) -> int:
    """The evaluation Job's entry point; exit codes as the trainer's (:mod:`trainer.failures`), so the
    Job's failure policy fails a user error at once and retries an infrastructure failure."""
    try:
        evaluate_to(argv)
    except Exception as exc:
        if is_infra_error(exc):
            print(f"error: infrastructure failure, retryable: {exc}", file=sys.stderr, flush=True)
            return EXIT_INFRA
        if not isinstance(exc, UserError | CheckpointError | DataError):
            raise  # a bug: the traceback is the report
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return EXIT_OK


def evaluate_to(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, required=True, help="the run's job.json")
    parser.add_argument("--step-url", required=True, help="the checkpoint to evaluate")
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--sample-prompt", required=True)
    parser.add_argument("--sample-tokens", type=int, required=True)
    parser.add_argument("--out", required=True, help="URL the record is written to, as JSON")
    args = parser.parse_args(argv)
    job = JobConfig.model_validate_json(args.job.read_text())
    record = evaluation_record(args.step_url, job, args.batches, args.sample_prompt, args.sample_tokens)
    storage.write_atomic(args.out, json.dumps(record, indent=2).encode())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
