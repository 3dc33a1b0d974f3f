"""A reader of a mixture that checkpoints like training, to be killed with SIGKILL and resumed.

Its own module, importing only the loader, so that a reader process starts in seconds: the data
benchmark and ``tests/test_data_mixture.py`` both kill one mid-way and compare what it read with an
uninterrupted reader's.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.config import DataConfig, JobConfig, ModelConfig, TrainConfig
from trainer.data.loader import StepLoader, build_loader

MIXTURE_WEIGHTS = (0.5, 0.3, 0.2)
MIXTURE_VOCAB, MIXTURE_SEQ_LEN = 512, 32
SAVE_EVERY = 10  # steps between saved loader states: a kill loses up to this many, then replays them
LOG = "log.jsonl"


def mixture_spec(output_url: str, weights: tuple[float, ...] = MIXTURE_WEIGHTS) -> DataConfig:
    """Three sources: Python sources and two synthetic corpora of different sizes."""
    corpora = [
        {"name": "python", "source": "stdlib", "max_documents": 40},
        {"name": "prose", "source": "generated", "max_documents": 400},
        {"name": "notes", "source": "generated", "max_documents": 120},
    ]
    sources = [{**c, "weight": w} for c, w in zip(corpora, weights, strict=True)]
    return DataConfig(output_url=output_url, samples_per_shard=64, mixture={"sources": sources})


def mixture_loader(data_url: str, batch: int) -> StepLoader:
    """One rank reading whole global batches of ``batch`` samples of ``MIXTURE_SEQ_LEN`` tokens."""
    job = JobConfig(
        data_url=data_url,
        loader_workers=0,
        model=ModelConfig(preset="tiny", vocab_size=MIXTURE_VOCAB),
        train=TrainConfig(seq_len=MIXTURE_SEQ_LEN, global_batch_size=batch, micro_batch_size=1),
    )
    return build_loader(job, 0, 1)


def read_steps(data_url: str, out: str, steps: int, batch: int, save_every: int) -> None:
    """A reader that checkpoints like training: each step's batch hash is logged, the loader state
    saved every ``save_every`` steps; restarted, it resumes from the state and cuts the log back to it."""
    log, state_file = Path(out) / LOG, Path(out) / "state.json"
    loader = mixture_loader(data_url, batch)
    done = 0
    if state_file.exists():
        state = json.loads(state_file.read_text())
        loader.load_state_dict(state)
        done = state["samples_consumed"] // batch
    kept = (
        [line for line in log.read_text().splitlines() if json.loads(line)["step"] <= done]
        if log.exists()
        else []
    )
    log.write_text("".join(line + "\n" for line in kept))
    with log.open("a") as stream:
        for step in range(done + 1, steps + 1):
            inputs, _ = next(loader)
            stream.write(
                json.dumps({"step": step, "sha": hashlib.sha256(inputs.numpy().tobytes()).hexdigest()}) + "\n"
            )
            stream.flush()
            if step % save_every == 0:
                tmp = state_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(loader.state_dict()))
                tmp.replace(state_file)


def kill_and_resume(data_url: str, root: Path, steps: int, batch: int, kill_after: int) -> bool:
    """Whether a reader process killed with SIGKILL after ``kill_after`` steps, then restarted, logs the
    same batches as a reader that ran straight through."""
    straight, killed = root / "straight", root / "killed"
    for out in (straight, killed):
        out.mkdir(parents=True)
    read_steps(data_url, str(straight), steps, batch, SAVE_EVERY)
    code = "from benchmarks.mixture_reader import read_steps; read_steps(*sys.argv[1:3], *map(int, sys.argv[3:]))"
    command = [
        sys.executable,
        "-c",
        f"import sys; {code}",
        data_url,
        str(killed),
        str(steps),
        str(batch),
        str(SAVE_EVERY),
    ]
    reader = subprocess.Popen(command)
    log = killed / LOG
    while not (log.exists() and len(log.read_text().splitlines()) >= kill_after):
        if reader.poll() is not None:
            raise RuntimeError("the reader finished before it could be killed; raise steps")
        time.sleep(0.01)
    os.kill(reader.pid, signal.SIGKILL)
    reader.wait()
    subprocess.run(command, check=True)
    want = (straight / LOG).read_text()
    return (killed / LOG).read_text() == want and len(want.splitlines()) == steps
