"""Calibration samples: text from the recipe's source, tokenized and cut into equal blocks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab.corpora import load_texts
from quantlab.errors import bad_input
from quantlab.quantize.base import CalibrationSet

if TYPE_CHECKING:
    from quantlab.recipe import CalibrationSettings


def calibration_dataset(settings: CalibrationSettings, tokenizer, base_dir: Path) -> CalibrationSet:
    """`num_samples` blocks of `seq_len` tokens, drawn reproducibly (seeded) from the source text."""
    from datasets import Dataset

    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for text in load_texts(settings.source, base_dir):
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + separator
    blocks = [
        stream[start : start + settings.seq_len]
        for start in range(0, len(stream) - settings.seq_len + 1, settings.seq_len)
    ]
    if len(blocks) < settings.num_samples:
        found = f"{settings.source} holds {len(stream)} tokens: {len(blocks)} blocks of {settings.seq_len}"
        raise bad_input("", "calibration.num_samples", f"{found}, fewer than the {settings.num_samples} asked for")
    chosen = random.Random(settings.seed).sample(blocks, settings.num_samples)
    mask = [[1] * settings.seq_len for _ in chosen]
    return CalibrationSet(Dataset.from_dict({"input_ids": chosen, "attention_mask": mask}), settings.batch_size)
