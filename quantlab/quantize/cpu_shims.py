"""Workarounds that let llm-compressor 0.14 calibrate on a machine with no accelerator.

AWQ pins cached activations (`IntermediatesCache.pin_memory`) to speed host-to-device copies;
on a CPU-only machine `Tensor.pin_memory()` raises "Cannot access accelerator device when none
is available". Pinning only helps transfers to an accelerator, so without one it is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def pinned_memory_optional() -> Iterator[None]:
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original
