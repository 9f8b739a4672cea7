"""Shared fixtures: a tiny random Llama with the embedded model's real tokenizer, built offline."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny import save_tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TinyLlama:
    """A saved HF checkpoint: random weights, SmolLM2's tokenizer; layer input widths 64 and 128."""

    path: Path

    def load(self, dtype=None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype or torch.float32)
        return model.eval(), AutoTokenizer.from_pretrained(self.path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> TinyLlama:
    return TinyLlama(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def free_port() -> int:
    """A loopback port nobody listens on right now (for servers the tests start)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
