"""Builds the pass-key retrieval documents (`pydoc_passkey_*`) for lm-eval, offline, from CPython's own prose.

Each document is filler cut from the language reference (`quantlab.corpora.paragraphs("eval")`, the split quantizers
never see), with one sentence that states a five-digit pass key hidden at a seeded depth, then the question; the model
generates the key greedily and is scored by exact match. This is the pass-key retrieval test of Mohtashami and Jaggi
("Landmark Attention", 2023) with the filler taken from a package every machine has: no file to ship, the same
documents wherever it runs (seeded, and built from pydoc_data, which quantlab's other bundled tasks use too).

Lengths are counted in characters, sized for a target in tokens at the language reference's characters per token under
SmolLM2's tokenizer (4.42: 141,015 characters, 31,881 tokens); another tokenizer gives another count (README.md).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import datasets

EVALS_DIR = Path(__file__).resolve().parent
if str(EVALS_DIR.parent) not in sys.path:  # lm-eval imports this file by path: quantlab's corpora beside it
    sys.path.insert(0, str(EVALS_DIR.parent))

from quantlab import corpora  # noqa: E402

CHARS_PER_TOKEN = 4.42
QUESTION = "\n\nWhat is the pass key? The pass key is"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."


def documents(tokens: int, count: int, seed: int) -> list[dict[str, Any]]:
    """`count` documents of about `tokens` tokens each: filler from a seeded paragraph on (wrapping around the split),
    cut at a word, the key's sentence put at a seeded depth (the sentence boundary nearest it)."""
    paragraphs = corpora.paragraphs("eval")
    draw = random.Random(f"pydoc_passkey-{tokens}-{seed}")
    size = int(tokens * CHARS_PER_TOKEN)
    rows = []
    for _ in range(count):
        start = draw.randrange(len(paragraphs))
        filler, index = [], start
        while sum(len(p) + 2 for p in filler) < size:
            filler.append(paragraphs[index % len(paragraphs)])
            index += 1
        text = "\n\n".join(filler)[:size].rsplit(" ", 1)[0]
        key = str(draw.randrange(10_000, 100_000))
        depth = draw.random()
        at = text.rfind(". ", 0, int(depth * len(text)))  # after a sentence: the key's sentence stands alone
        at = 0 if at < 0 else at + 2
        context = text[:at] + NEEDLE.format(key=key) + " " + text[at:] + QUESTION
        rows.append({"context": context, "target": key, "depth": round(at / len(text), 3), "tokens": tokens})
    return rows


def load(tokens: int, documents_per_length: int = 64, seed: int = 0, split: str = "test", **_: Any):
    """The task's one split. lm-eval passes the task's metadata (version, model arguments) as keyword arguments too."""
    rows = documents(tokens, documents_per_length, seed)
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})
