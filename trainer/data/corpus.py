"""The corpus: which documents go in, read through ``datasets``, one row (column ``text``) per document.

Three sources:
- ``stdlib``: the Python standard library's top-level ``.py`` files (sorted, one document per file,
  ~4.7 MB): real text present on every machine, so demos and tests need no download.
- ``generated``: a small deterministic synthetic corpus for fast tests.
- ``files``: local files, globs or fsspec URLs (gs://, s3://) in text, JSONL or Parquet.
"""

from __future__ import annotations

import hashlib
import random
import sys
import sysconfig
from pathlib import Path
from typing import Any

import datasets

from trainer.config import DataConfig
from trainer.data.errors import DataError
from trainer.data.fs import filesystem, retrying
from trainer.hub import keep_hub_out

_FORMAT_BY_SUFFIX = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".py": "text",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}
_DATASETS_BUILDER = {"text": "text", "jsonl": "json", "parquet": "parquet"}
GENERATED_DOCUMENTS = 400


def load_corpus(cfg: DataConfig) -> datasets.Dataset:
    """All documents of the configured corpus, capped at ``max_documents``, as a ``text`` column."""
    keep_hub_out()
    datasets.disable_progress_bars()
    if cfg.source == "stdlib":
        corpus = datasets.Dataset.from_dict({"text": [p.read_text(encoding="utf-8") for p in stdlib_files()]})
    elif cfg.source == "generated":
        corpus = datasets.Dataset.from_dict(
            {"text": generated_documents(cfg.max_documents or GENERATED_DOCUMENTS)}
        )
    else:
        corpus = _load_files(cfg)
    if cfg.max_documents is not None and len(corpus) > cfg.max_documents:
        corpus = corpus.select(range(cfg.max_documents))
    # An empty text file reads as one empty document; larger all-blank corpora fail at packing instead
    # ("fewer than one sample"), which avoids a full pass over the text here.
    if len(corpus) == 0 or (len(corpus) == 1 and not corpus[0]["text"].strip()):
        raise DataError(
            f"the corpus (data.source={cfg.source}, data.paths={cfg.paths}) has no text; "
            "point data.paths at non-empty files"
        )
    return corpus


def corpus_identity(cfg: DataConfig) -> dict[str, Any]:
    """What the corpus is, cheaply: names, sizes and store version keys (mtime/ETag), not contents."""
    identity: dict[str, Any] = {"source": cfg.source, "max_documents": cfg.max_documents}
    if cfg.source == "stdlib":
        identity["files"] = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in stdlib_files()]
        identity["python"] = sys.version
    elif cfg.source == "files":
        files = resolve_paths(cfg.paths)
        identity.update(
            format=_format_of(cfg, files),
            text_field=cfg.text_field,
            files=[(url, *_version_of(url)) for url in files],
        )
    return identity


def stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def generated_documents(count: int, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English: a fixed vocabulary of made-up words in short sentences.

    Repeated words and sentence structure give BPE merges to learn and a model something to fit.
    """
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ten", "sa", "ru", "vo", "pel", "dan", "or", "ist", "qu", "e", "a"]
    words = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(300)})
    documents = []
    for _ in range(count):
        sentences = []
        for _ in range(rng.randint(3, 12)):
            sentence = " ".join(rng.choices(words, k=rng.randint(4, 14)))
            sentences.append(sentence[0].upper() + sentence[1:] + ".")
        documents.append(" ".join(sentences))
    return documents


def resolve_paths(paths: list[str]) -> list[str]:
    """Expand globs and fsspec URLs into a sorted list of file URLs; every pattern must match."""
    if not paths:
        raise DataError("data.source=files needs data.paths: files, globs or gs:// / s3:// URLs")
    resolved: list[str] = []
    for pattern in paths:
        fs, path = filesystem(pattern)
        matches = sorted(retrying(lambda fs=fs, path=path: fs.glob(path), f"list {pattern}"))
        files = [m for m in matches if not fs.isdir(m)]
        if not files:
            raise DataError(f"data.paths entry {pattern!r} matches no files; check the path or glob")
        resolved.extend(fs.unstrip_protocol(m) if "://" in pattern else m for m in files)
    return resolved


def _version_of(url: str) -> tuple[int, str]:
    fs, path = filesystem(url)
    info = retrying(lambda: fs.info(path), f"stat {url}")
    key = {
        k: str(info.get(k))
        for k in ("mtime", "LastModified", "ETag", "md5Hash", "generation", "updated")
        if info.get(k) is not None
    }
    return int(info.get("size") or 0), hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:16]


def _format_of(cfg: DataConfig, files: list[str]) -> str:
    if cfg.format != "auto":
        return cfg.format
    formats = {}
    for url in files:
        suffix = Path(url).suffix.lower()
        if suffix not in _FORMAT_BY_SUFFIX:
            raise DataError(
                f"cannot tell the format of {url!r} from its suffix; set data.format to "
                "text, jsonl or parquet"
            )
        formats[_FORMAT_BY_SUFFIX[suffix]] = url
    if len(formats) > 1:
        raise DataError(
            f"data.paths mixes formats {sorted(formats)} (e.g. {list(formats.values())}); "
            "prepare one format per dataset"
        )
    return next(iter(formats))


def _load_files(cfg: DataConfig) -> datasets.Dataset:
    files = resolve_paths(cfg.paths)
    fmt = _format_of(cfg, files)
    options: dict[str, Any] = {"sample_by": "document"} if fmt == "text" else {}
    try:
        corpus = datasets.load_dataset(_DATASETS_BUILDER[fmt], data_files=files, split="train", **options)
    except Exception as error:
        raise DataError(
            f"could not read {files} as {fmt} ({type(error).__name__}: {error}); check the files "
            "or set data.format"
        ) from error
    if fmt == "text":
        return corpus
    if cfg.text_field not in corpus.column_names:
        raise DataError(
            f"data.text_field={cfg.text_field!r} is not a column of {files}; "
            f"columns are {corpus.column_names}"
        )
    feature = corpus.features[cfg.text_field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"data.text_field={cfg.text_field!r} in {files} holds {feature}, not text")
    corpus = corpus.select_columns([cfg.text_field])
    return corpus if cfg.text_field == "text" else corpus.rename_column(cfg.text_field, "text")
