"""The corpus, as parts: which documents go in, and how one part's documents are read.

A part is the unit that preparation fans out over: one input file, or a run of stdlib/generated
documents about ``PART_BYTES`` long. Where the parts fall depends only on the corpus (never on how
many workers prepare it), and each part names what it reads precisely (size and store version key), so
a part that did not change is recognised and reused when files are added.

Three sources:
- ``stdlib``: the Python standard library's top-level ``.py`` files (sorted, one document per file,
  ~4.7 MB): real text present on every machine, so demos and tests need no download.
- ``generated``: a small deterministic synthetic corpus for fast tests.
- ``files``: local files, globs or fsspec URLs (gs://, s3://) in text, JSONL or Parquet, read through
  ``datasets``; one part per file.
"""

from __future__ import annotations

import functools
import hashlib
import random
import sys
import sysconfig
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from trainer.config import CorpusConfig
from trainer.data.errors import DataError
from trainer.hub import keep_hub_out
from trainer.storage import filesystem, retrying
from trainer.units import MiB

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
GENERATED_DOCUMENT_BYTES = 500  # about: sizes the generated corpus's parts and tokenizer sample
# Big enough that a part's fixed costs (a task, a tokenizer parse, two partial shards) are noise; small
# enough that the stdlib corpus makes ~20 parts, which balance over a handful of workers.
PART_BYTES = MiB // 4


class Part(BaseModel):
    """One slice of a corpus, prepared as a unit; its fields are what the part's fingerprint hashes."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["stdlib", "generated", "file"]
    url: str = ""  # the input file (kind=file)
    format: str = ""  # text | jsonl | parquet (kind=file)
    text_field: str = "text"
    first: int = 0  # the corpus's documents first .. first+count-1 (stdlib, generated)
    count: int | None = None  # None: all of the file's documents
    version: str  # the bytes read: sizes and mtimes/ETags, hashed
    size: int  # bytes of text, about: the tokenizer sample's budget counts them

    @property
    def key(self) -> int:
        """A number naming this part (not its position), to seed its held-out documents with."""
        return int(_digest(self.model_dump()), 16)


def corpus_parts(cfg: CorpusConfig) -> list[Part]:
    """The parts of a corpus, in corpus order, capped at ``max_documents``; cheap (a listing)."""
    if cfg.source == "stdlib":
        files = stdlib_files()[: cfg.max_documents]
        sizes = [f.stat().st_size for f in files]
        identity = [(f.name, size, f.stat().st_mtime_ns) for f, size in zip(files, sizes, strict=True)]
        return [
            Part(
                kind="stdlib",
                first=first,
                count=count,
                version=_digest([sys.version, identity[first : first + count]]),
                size=sum(sizes[first : first + count]),
            )
            for first, count in _ranges(sizes)
        ]
    if cfg.source == "generated":
        total = cfg.max_documents or GENERATED_DOCUMENTS
        return [
            Part(
                kind="generated",
                first=first,
                count=count,
                version="generated-v1",
                size=count * GENERATED_DOCUMENT_BYTES,
            )
            for first, count in _ranges([GENERATED_DOCUMENT_BYTES] * total)
        ]
    files = resolve_paths(cfg.paths)
    fmt = _format_of(cfg, files)
    parts = []
    for url in files:
        size, version = _version_of(url)
        parts.append(
            Part(kind="file", url=url, format=fmt, text_field=cfg.text_field, version=version, size=size)
        )
    return _capped(parts, cfg.max_documents) if cfg.max_documents else parts


def read_documents(part: Part) -> list[str]:
    """The part's documents, in order."""
    keep_hub_out()
    if part.kind == "stdlib":
        return [
            p.read_text(encoding="utf-8") for p in stdlib_files()[part.first : part.first + (part.count or 0)]
        ]
    if part.kind == "generated":
        return generated_documents(part.first + (part.count or 0))[part.first :]
    return _read_file(part)[: part.count]


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of documents of about ``PART_BYTES``: ``(first, count)`` each."""
    ranges, first, total = [], 0, 0
    for index, size in enumerate(sizes):
        total += size
        if total >= PART_BYTES:
            ranges.append((first, index + 1 - first))
            first, total = index + 1, 0
    if first < len(sizes):
        ranges.append((first, len(sizes) - first))
    return ranges


def _capped(parts: list[Part], max_documents: int) -> list[Part]:
    """The leading files holding the first ``max_documents`` documents (counting means reading them)."""
    capped, left = [], max_documents
    for part in parts:
        documents = len(_read_file(part))
        capped.append(part.model_copy(update={"count": min(documents, left)}))
        left -= documents
        if left <= 0:
            break
    return capped


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


@functools.cache
def stdlib_files() -> tuple[Path, ...]:
    """Listed once per process: every part of a preparation reads its slice of the same listing."""
    return tuple(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))


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
    return int(info.get("size") or 0), _digest(sorted(key.items()))


def _format_of(cfg: CorpusConfig, files: list[str]) -> str:
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


def _read_file(part: Part) -> list[str]:
    """One input file's documents through ``datasets``: a text file is one document, JSONL/Parquet a row each."""
    import datasets  # here, not at the top: seconds to import, and only file parts need it

    datasets.disable_progress_bars()
    options: dict[str, Any] = {"sample_by": "document"} if part.format == "text" else {}
    try:
        rows = datasets.load_dataset(
            _DATASETS_BUILDER[part.format], data_files=[part.url], split="train", **options
        )
    except Exception as error:
        raise DataError(
            f"could not read {part.url} as {part.format} ({type(error).__name__}: {error}); check the file "
            "or set data.format"
        ) from error
    field = "text" if part.format == "text" else part.text_field
    if field not in rows.column_names:
        raise DataError(
            f"data.text_field={field!r} is not a column of {part.url}; columns are {rows.column_names}"
        )
    feature = rows.features[field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"data.text_field={field!r} in {part.url} holds {feature}, not text")
    return rows[field]
