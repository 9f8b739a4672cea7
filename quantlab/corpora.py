"""Offline English text that every machine has: CPython's own `pydoc_data.topics`, split by topic
into three disjoint parts so that the text a quantizer calibrates on is never the text a variant is
scored on: ``calibration`` (AWQ samples), ``perplexity`` (perplexity and KL against the baseline)
and ``eval`` (source of the bundled lm-eval cloze task, ``evals/``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

Split = Literal["calibration", "perplexity", "eval"]
SPLITS: tuple[Split, ...] = ("calibration", "perplexity", "eval")


def paragraphs(split: Split) -> list[str]:
    """Prose paragraphs of a split (every third topic, in sorted order): blank-line separated,
    whitespace folded, code-free enough."""
    from pydoc_data.topics import topics

    names = sorted(topics)[SPLITS.index(split) :: 3]
    blocks = (" ".join(block.split()) for name in names for block in topics[name].split("\n\n"))
    return [block for block in blocks if _looks_like_prose(block)]


def text(split: Split) -> str:
    """All prose of a split, paragraphs separated by blank lines."""
    return "\n\n".join(paragraphs(split))


def _looks_like_prose(text: str) -> bool:
    words = text.split()
    alphabetic = sum(word.strip(".,;:()'\"").isalpha() for word in words)
    return len(words) >= 12 and alphabetic / len(words) >= 0.8


BUILTIN_SOURCES: dict[str, Split] = {  # the recipe's names for the splits a recipe may use
    "builtin:pydoc-calibration": "calibration",
    "builtin:pydoc-perplexity": "perplexity",
}


def text_source_problem(source: str, base_dir: Path) -> str | None:
    """Why a text source cannot be used, or None. Checks only what needs no network."""
    if source.startswith("builtin:"):
        known = ", ".join(BUILTIN_SOURCES)
        return None if source in BUILTIN_SOURCES else f"unknown builtin text '{source}'; known: {known}"
    if source.startswith("hf:"):
        return None if len(source.split(":")) == 4 else f"'{source}' should be hf:<dataset>:<split>:<text field>"
    path = (base_dir / source).resolve()
    if path.suffix not in (".txt", ".jsonl"):
        return f"'{source}' should be builtin:..., hf:..., or a .txt/.jsonl file"
    return None if path.is_file() else f"no such file: {path}"


def load_texts(source: str, base_dir: Path) -> list[str]:
    """The documents of a text source: paragraphs, JSONL `text` fields, or a hub dataset column."""
    if source in BUILTIN_SOURCES:
        return paragraphs(BUILTIN_SOURCES[source])
    if source.startswith("hf:"):
        import datasets

        _, name, split, field = source.split(":")
        return [row[field] for row in datasets.load_dataset(name, split=split)]
    path = (base_dir / source).resolve()
    if path.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [block.strip() for block in path.read_text(encoding="utf-8").split("\n\n") if block.strip()]
