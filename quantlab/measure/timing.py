"""Timing model work: clocks, timed greedy generation, and the memory bandwidth this machine really has.

CUDA kernels run asynchronously: on GPU, CUDA events are recorded on the stream of the device that produces
the logits and read after `settle()`. Generation is a hand-written loop, not `generate()`: every token gets its
own timestamp, nothing stops early at end-of-sequence, and prefill computes the last position's logits only.
Prompts are seeded random token ids: the content does not change the work of a dense model.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@contextlib.contextmanager
def pinned_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` torch threads (measure.cpu_threads), then go back to the threads before it.
    None: the threads as they are. The host's share does not resize them meanwhile: the runner times the measure
    stage inside the host's timing lock (`host_share.HostShare.timing`)."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class CpuClock:
    description = "time.perf_counter"

    def mark(self) -> float:
        return time.perf_counter()

    def settle(self) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    description = "CUDA events"

    def __init__(self, record_on: torch.device, devices: Sequence[torch.device]):
        self.record_on = record_on
        self.devices = list(devices)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.record_on))
        return event

    def settle(self) -> None:
        """Wait until all queued work is done; read `seconds` only after this."""
        for device in self.devices:
            torch.cuda.synchronize(device)

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000


Clock = CpuClock | CudaClock


def clock_for(record_on: torch.device, devices: Sequence[torch.device]) -> Clock:
    """The clock for work on `devices`, whose results end up on `record_on`."""
    if record_on.type == "cuda":
        return CudaClock(record_on, [device for device in devices if device.type == "cuda"])
    return CpuClock()


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


@dataclass(frozen=True)
class BandwidthReading:
    bytes_per_s: float  # median over the samples
    method: str


def measure_copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> BandwidthReading:
    """Copy an `nbytes` tensor on `device` `repeats` times; each copy reads and writes `nbytes`, so it moves
    2 x nbytes (STREAM's "copy" convention). Measured, not looked up: a datasheet peak is one that a CPU VM or
    a throttled GPU may never reach, and the roofline efficiency is only honest against what this machine moves."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)  # ones, not empty: touch every page
    target = torch.empty_like(source)
    target.copy_(source)  # untimed: first-touch page faults and lazy allocation
    clock = clock_for(device, [device])
    samples = []
    for _ in range(repeats):
        clock.settle()
        start = clock.mark()
        target.copy_(source)
        end = clock.mark()
        clock.settle()
        samples.append(2 * nbytes / clock.seconds(start, end))
    return BandwidthReading(
        bytes_per_s=float(np.median(samples)),
        method=f"torch copy of {nbytes} B on {device} (read + write counted), median of {repeats}",
    )
