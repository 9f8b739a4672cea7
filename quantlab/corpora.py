"""Offline English text that every machine has: CPython's own `pydoc_data.topics`.

The language-reference topics are split into three disjoint parts by topic, so that the
text a quantizer calibrates on never appears in the text a variant is scored on:

- ``calibration``: AWQ calibration samples;
- ``perplexity``: perplexity and KL divergence against the baseline;
- ``eval``: source of the bundled lm-eval cloze task (``evals/``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

Split = Literal["calibration", "perplexity", "eval"]
SPLITS: tuple[Split, ...] = ("calibration", "perplexity", "eval")


def topic_names(split: Split) -> list[str]:
    """Names of the pydoc topics in one split (every third topic, in sorted order)."""
    import pydoc_data.topics

    offset = SPLITS.index(split)
    return sorted(pydoc_data.topics.topics)[offset::3]


def paragraphs(split: Split) -> list[str]:
    """Prose paragraphs of a split: blank-line separated, whitespace folded, code-free enough."""
    import pydoc_data.topics

    found: list[str] = []
    for name in topic_names(split):
        for block in pydoc_data.topics.topics[name].split("\n\n"):
            text = " ".join(block.split())
            if _looks_like_prose(text):
                found.append(text)
    return found


def text(split: Split) -> str:
    """All prose of a split, paragraphs separated by blank lines."""
    return "\n\n".join(paragraphs(split))


def _looks_like_prose(text: str) -> bool:
    words = text.split()
    if len(words) < 12:
        return False
    alphabetic = sum(word.strip(".,;:()'\"").isalpha() for word in words)
    return alphabetic / len(words) >= 0.8


# --- text sources named in a recipe -------------------------------------------------------

BUILTIN_SOURCES: dict[str, Split] = {
    "builtin:pydoc-calibration": "calibration",
    "builtin:pydoc-perplexity": "perplexity",
}


def text_source_problem(source: str, base_dir: Path) -> str | None:
    """Why a text source cannot be used, or None. Checks only what needs no network."""
    if source.startswith("builtin:"):
        if source not in BUILTIN_SOURCES:
            return f"unknown builtin text '{source}'; known: {', '.join(BUILTIN_SOURCES)}"
        return None
    if source.startswith("hf:"):
        if len(source.split(":")) != 4:
            return f"'{source}' should be hf:<dataset>:<split>:<text field>"
        return None
    path = (base_dir / source).resolve()
    if path.suffix not in (".txt", ".jsonl"):
        return f"'{source}' should be builtin:..., hf:..., or a .txt/.jsonl file"
    if not path.is_file():
        return f"no such file: {path}"
    return None


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
