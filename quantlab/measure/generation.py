"""Timed greedy generation with the model's own forward and KV cache.

A hand-written loop rather than `generate()`: every token gets its own timestamp without a
streamer in the way, nothing stops early at an end-of-sequence token, and prefill computes
logits for the last position only (as `generate()` does). Prompts are random token ids from a
seeded generator: the content does not change the work of a dense model.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from quantlab.measure.clocks import Clock


@dataclass(frozen=True)
class GenerationTiming:
    """One timed generation of `output_tokens` tokens for `batch_size` prompts."""

    batch_size: int
    prompt_tokens: int
    first_token_s: float  # prefill of every prompt + picking the first token
    inter_token_s: tuple[float, ...]  # one decode step each, output_tokens - 1 of them

    @property
    def output_tokens(self) -> int:
        return 1 + len(self.inter_token_s)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch_size * self.prompt_tokens / self.first_token_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch_size * len(self.inter_token_s) / sum(self.inter_token_s)


def random_prompt_ids(
    batch_size: int, prompt_tokens: int, vocab_size: int, seed: int, device: torch.device, excluded_ids: Iterable[int]
) -> torch.Tensor:
    """Seeded random token ids, avoiding `excluded_ids` (special tokens)."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[token for token in excluded_ids if 0 <= token < vocab_size]] = False
    pool = allowed.nonzero().squeeze(1)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(pool), (batch_size, prompt_tokens), generator=generator)
    return pool[picks].to(device)


def time_generation(
    model: torch.nn.Module, prompt_ids: torch.Tensor, output_tokens: int, clock: Clock
) -> GenerationTiming:
    forward_options: dict = {"use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        forward_options["logits_to_keep"] = 1
    with torch.inference_mode():
        clock.settle()
        # The first step is the prefill of every prompt; each later one decodes one token.
        marks, input_ids, cache = [clock.mark()], prompt_ids, None
        for _ in range(output_tokens):
            output = model(input_ids=input_ids, past_key_values=cache, **forward_options)
            input_ids = output.logits[:, -1:].argmax(-1).to(prompt_ids.device)
            cache = output.past_key_values
            marks.append(clock.mark())
        clock.settle()
    steps = [clock.seconds(before, after) for before, after in zip(marks, marks[1:])]
    return GenerationTiming(prompt_ids.shape[0], prompt_ids.shape[1], steps[0], tuple(steps[1:]))
